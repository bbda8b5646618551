"""Fuzzing the coordinator's Contribute stream: random bytes and mutated contributions are refused with the
documented status codes (grpc_server's table), none of them is merged or held, and the coordinator serves on."""

import collections
import contextlib
import random
import socket

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator
from island_jax.outer import codec

SEED = 1729
CONTRIBUTE = "/island_jax.exchange.Exchange/Contribute"
IA, DL, FP, RE = "INVALID_ARGUMENT", "DATA_LOSS", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"
ELEMENTS = 100_000
CHUNK_BYTES = 64 * 1024
# cases of each kind (200 in all), sent in a seeded random order
MIX = {
    "random": 40, "random_tail": 15, "bitflip": 30, "truncate": 15, "drop": 15, "duplicate": 15, "reorder": 10,
    "unknown_fragment": 10, "future_round": 10, "total_bytes": 8, "layout": 7, "index_out_of_range": 10,
    "empty": 5, "header_only": 5, "undecodable_header": 5,
}
# the status codes each kind of damage may end with (grpc_server's table); each case's own code is predicted exactly
CODES = {
    "random": {IA, DL, RE}, "random_tail": {IA, DL, RE},  # by the first bad frame: kind, size, CRC
    "bitflip/header_kind": {IA}, "bitflip/header_crc": {DL}, "bitflip/header_body": {DL},
    "bitflip/chunk_kind": {IA}, "bitflip/chunk_index": {IA}, "bitflip/chunk_offset": {IA},
    "bitflip/chunk_crc": {DL}, "bitflip/chunk_data": {DL},
    "truncate/header": {IA, DL}, "truncate/chunk": {IA},  # a header cut to 0 bytes is an empty frame (IA)
    "drop/header": {IA}, "drop/chunks": {FP}, "duplicate/header": {IA}, "duplicate/chunk": {FP},
    "duplicate/chunk_first": {IA}, "reorder": {IA}, "unknown_fragment": {IA}, "future_round": {FP},
    "total_bytes": {IA}, "layout": {IA}, "index_out_of_range": {IA}, "empty": {DL}, "header_only": {FP},
    "undecodable_header": {IA},
}


def _small_config():
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.comm.chunk_bytes = CHUNK_BYTES
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    return c


@pytest.fixture
def local_server():
    c = _small_config()
    coordinator = Coordinator(c, {"w": np.zeros(ELEMENTS, np.float32)}, ["a", "b"])
    server, service, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    yield c, coordinator, service, port
    server.stop(grace=0)


def _first_frame_code(frame: bytes, limit: int) -> str | None:
    """The code for a stream whose first frame is `frame` and not a sound header (None: not predictable)."""
    if len(frame) > limit:
        return RE  # larger than any frame of the plan: refused before it is buffered
    if frame[:1] in (wire.HEADER, wire.TRAILER):
        if len(frame) >= 5 and wire.crc32(frame[5:]) == int.from_bytes(frame[1:5], "little"):
            return None  # a matching CRC by chance: then it depends on what the bytes parse to
        return DL  # a header or trailer whose CRC-32C fails (or that is too short to hold one)
    return IA  # empty, unknown kind, truncated, or not a header


def _inner_frame_code(frame: bytes, limit: int) -> str | None:
    """The code for `frame` arriving after a valid header (and some of its chunks): random bytes that are no
    chunk of the plan (None: not predictable)."""
    if frame[:1] == wire.CHUNK and wire.FRAMING_BYTES <= len(frame) <= limit:
        if int.from_bytes(frame[1:5], "little") < 7:
            return None  # a random chunk frame that names a chunk of the plan: off its offset or size, or not
    return _first_frame_code(frame, limit)


class _Cases:
    """Seeded cases: (kind, frames, a description of them, the expected status code or None if not predictable)."""

    def __init__(self, rng: random.Random, layout: str, plan: list[codec.Chunk], payload: bytes, limit: int):
        self.rng, self.layout, self.plan, self.total, self.limit = rng, layout, plan, len(payload), limit
        self.chunks = [frame for _, frame in wire.chunk_frames(payload, plan)]
        self.data = [payload[k.offset : k.offset + k.nbytes] for k in plan]

    def header(self, **fields) -> pb.PayloadHeader:
        h = pb.PayloadHeader(round=0, island="a", tokens=10, layout=self.layout, total_bytes=self.total, streams=1,
                             fragment=0, attempt=self.rng.getrandbits(64) | 1 << 63)  # a fresh attempt per case
        for name, value in fields.items():
            setattr(h, name, value)
        return h

    def valid(self, **fields) -> tuple[list[bytes], list[str]]:
        names = ["H" + "".join(f" {k}={v!r}" for k, v in fields.items())] + [f"C{k}" for k in range(len(self.chunks))]
        return [wire.header_frame(self.header(**fields)), *self.chunks], names

    def random_frame(self) -> bytes:
        r = self.rng
        size = r.choice([0, r.randint(1, 16), r.randint(17, 4096), r.randint(17, 4096), r.randint(17, 4096),
                         r.randint(CHUNK_BYTES, 2 * CHUNK_BYTES + wire.FRAMING_BYTES)])
        frame = bytearray(r.randbytes(size))
        if frame and r.random() < 0.5:  # often a known kind, so that the frame is parsed further
            frame[0] = r.choice(b"HCRT")
        return bytes(frame)

    def make(self, kind: str):
        r = self.rng
        if kind == "random":
            frames = [self.random_frame() for _ in range(r.randint(1, 3))]
            return kind, frames, [f"{f[:1]!r}x{len(f)}" for f in frames], _first_frame_code(frames[0], self.limit)
        if kind == "random_tail":  # a valid header, some of its chunks, then random frames
            frames, names = self.valid()
            k = r.randint(0, len(self.chunks))
            tail = [self.random_frame() for _ in range(r.randint(1, 2))]
            names = names[: 1 + k] + [f"{f[:1]!r}x{len(f)}" for f in tail]
            return kind, frames[: 1 + k] + tail, names, _inner_frame_code(tail[0], self.limit)
        if kind == "bitflip":
            frames, names = self.valid()
            which = r.randrange(len(frames))
            frame = bytearray(frames[which])
            if which == 0:
                pos = r.randrange(len(frame))
                region, code = ("kind", IA) if pos == 0 else ("crc", DL) if pos < 5 else ("body", DL)
                kind = "bitflip/header_" + region
            else:
                pos = r.randrange(wire.FRAMING_BYTES) if r.random() < 0.5 else r.randrange(wire.FRAMING_BYTES, len(frame))
                region = "kind" if pos == 0 else "index" if pos < 5 else "offset" if pos < 13 else "crc" if pos < 17 else "data"
                code = DL if pos >= 13 else IA  # a CRC-32C that fails, or a chunk off the plan / of unknown kind
                kind = "bitflip/chunk_" + region
            bit = r.randrange(8)
            frame[pos] ^= 1 << bit
            frames[which] = bytes(frame)
            names[which] += f"(bit {bit} of byte {pos} flipped)"
            return kind, frames, names, code
        if kind == "truncate":
            frames, names = self.valid()
            which = r.randrange(len(frames))
            n = r.choice([0, r.randint(1, wire.FRAMING_BYTES), r.randrange(len(frames[which]))])
            names[which] += f"(cut to {n} of {len(frames[which])} bytes)"
            frames[which] = frames[which][:n]
            code = (IA if n == 0 else DL) if which == 0 else IA
            return f"truncate/{'header' if which == 0 else 'chunk'}", frames, names, code
        if kind == "drop":
            frames, names = self.valid()
            gone = set(r.sample(range(len(frames)), r.randint(1, 3)))
            frames = [f for i, f in enumerate(frames) if i not in gone]
            names = [n for i, n in enumerate(names) if i not in gone]
            # no header: the first frame is a chunk; else chunks never arrived (the coordinator refuses it)
            return f"drop/{'header' if 0 in gone else 'chunks'}", frames, names, IA if 0 in gone else FP
        if kind == "duplicate":
            frames, names = self.valid()
            which, where = r.randrange(len(frames)), r.randint(0, len(frames))
            frames.insert(where, frames[which])
            names.insert(where, names[which] + "(again)")
            if which == 0:
                return "duplicate/header", frames, names, IA  # a second header inside the contribution
            # a chunk before the header, or a repeated chunk (the coordinator refuses it)
            return f"duplicate/chunk{'_first' if where == 0 else ''}", frames, names, IA if where == 0 else FP
        if kind == "reorder":
            frames, names = self.valid()
            order = list(range(len(frames)))
            while order[0] == 0:
                r.shuffle(order)
            return kind, [frames[i] for i in order], [names[i] for i in order], IA  # a chunk before the header
        if kind in ("unknown_fragment", "future_round", "total_bytes", "layout"):
            field, value, code = {
                "unknown_fragment": ("fragment", r.choice([7, 7, 1, -1, 2**31 - 1]), IA),
                "future_round": ("round", r.choice([5, 5, 1, 2, 10**6]), FP),
                "total_bytes": ("total_bytes", r.choice([0, self.total - 1, self.total + 1, 2 * self.total, -1, 2**40]), IA),
                "layout": ("layout", r.choice(["", self.layout + "x", self.layout[:-1], r.randbytes(12).hex()]), IA),
            }[kind]
            frames, names = self.valid(**{field: value})
            k = r.choice([0, r.randint(1, len(self.chunks)), len(self.chunks)])  # the header alone, or with chunks
            return kind, frames[: 1 + k], names[: 1 + k], code
        if kind == "index_out_of_range":
            frames, names = self.valid()
            index, j = r.choice([7, 8, 2**32 - 1, r.randrange(7, 2**32)]), r.randrange(len(self.chunks))
            bad = wire.chunk_frame(index, self.plan[j].offset, self.data[j])  # chunk j's data and CRC, index off
            how = r.choice(["replace", "insert", "append"])
            if how == "replace":
                frames[1 + j], names[1 + j] = bad, f"C{index}(data of C{j})"
            else:
                where = len(frames) if how == "append" else r.randint(1, len(frames))
                frames.insert(where, bad)
                names.insert(where, f"C{index}(data of C{j})")
            return f"index_out_of_range/{how}", frames, names, IA
        if kind == "empty":
            return kind, [], [], DL  # the stream ended before a header
        if kind == "header_only":
            frames, names = self.valid()
            return kind, frames[:1], names[:1], FP  # every chunk missing
        if kind == "undecodable_header":  # a header frame whose CRC-32C holds, over bytes that are no PayloadHeader
            body = r.choice([
                bytes([r.randint(1, 15) << 3 | r.choice([6, 7])]) + r.randbytes(r.randint(0, 32)),  # no such wire type
                b"\x12\x02\xff\xfe",  # island: two bytes that are not UTF-8
            ])
            frame = wire.HEADER + wire.crc32(body).to_bytes(4, "little") + body
            k = r.choice([0, len(self.chunks)])
            return kind, [frame, *self.chunks[:k]], [f"H(body {body.hex()})"] + [f"C{i}" for i in range(k)], IA
        raise AssertionError(kind)


def _send(call, frames: list[bytes]) -> str:
    """"OK", "OK discarded", "OK duplicate" or the status code name the Contribute call ended with."""
    try:
        reply = call(iter(frames), timeout=5)
    except grpc.RpcError as e:
        return e.code().name
    return "OK discarded" if reply.discarded else "OK duplicate" if reply.duplicate else "OK"


def _health(port: int) -> int:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status


def test_malformed_contribution_streams_are_refused_and_change_nothing(local_server):
    c, coordinator, service, port = local_server
    address = f"localhost:{port}"
    fragment = coordinator.fragments[0]
    start = coordinator.checksum
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    a.join("a", fingerprint_fields(c), start)
    rng = random.Random(SEED)
    # the frames mutated: a contribution other than the one island a sends at the end, so that a merge of any of
    # them would show in the update
    fuzzed = codec.encode({"w": np.random.default_rng(SEED).standard_normal(ELEMENTS).astype(np.float32)}, "none", 256)
    cases = _Cases(rng, a.layouts[0], a.plans[0], fuzzed, service.receive_limit())
    assert len(cases.chunks) == 7 and len(fuzzed) == 400_000
    kinds = [kind for kind, n in MIX.items() for _ in range(n)]
    assert len(kinds) == 200
    rng.shuffle(kinds)
    call = a.channels[0].stream_unary(CONTRIBUTE, request_serializer=bytes,
                                      response_deserializer=pb.ContributeReply.FromString)
    seen = collections.defaultdict(collections.Counter)
    failures, held_since, merged_at = [], None, None
    for n, kind in enumerate(kinds):
        kind, frames, names, expected = cases.make(kind)
        outcome = _send(call, frames)
        seen[kind][outcome] += 1
        with service.session.lock:
            held = fragment.pending.get("a")
            held = held is not None and held.complete(len(fragment.plan))
            merged = coordinator.round != 0 or fragment.history != []
        wrong = []
        if outcome.startswith("OK") and outcome != "OK discarded":
            wrong.append("answered OK")
        elif expected is not None and outcome != expected:  # round 0 never closes here: no case is discarded
            wrong.append(f"expected {expected}")
        if held and held_since is None:
            held_since = n
            wrong.append("the coordinator now holds a complete contribution of island a from this refused stream")
        if merged and merged_at is None:
            merged_at = n
            wrong.append("the coordinator merged a round")
        if wrong:
            failures.append(f"case {n} {kind}: {outcome} ({'; '.join(wrong)}); frames: {' '.join(names)}")
        if outcome == "DEADLINE_EXCEEDED" and sum(s["DEADLINE_EXCEEDED"] for s in seen.values()) >= 3:
            failures.append("the service stopped answering (3 calls ran past their deadline)")
            break
    distribution = {k: dict(v) for k, v in sorted(seen.items())}
    assert not failures, f"{len(failures)} cases went wrong:\n" + "\n".join(failures[:12]) + f"\nall: {distribution}"

    # Every kind was sent as often as MIX says, and each kind of damage has its status codes.
    assert {k: sum(sum(v.values()) for s, v in seen.items() if s.split("/")[0] == k) for k in MIX} == MIX
    for kind, outcomes in seen.items():
        assert set(outcomes) <= CODES[kind.split("/")[0] if kind.startswith("index_") else kind], (kind, distribution)
    assert seen["bitflip/chunk_data"][DL] >= 10 and seen["unknown_fragment"][IA] == MIX["unknown_fragment"]

    # The coordinator is as it was: round 0, nothing merged, the same view.
    assert coordinator.round == 0 and fragment.history == [] and coordinator.checksum == start

    # Random bytes straight to the TCP port: the connection is dropped, the service answers on.
    with socket.create_connection(("localhost", port), timeout=5) as raw, contextlib.suppress(ConnectionError):
        raw.sendall(rng.randbytes(4096))
    assert _health(port) == health_pb2.HealthCheckResponse.SERVING

    # And a valid round still merges: island a's contribution, then b's.
    b = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    b.join("b", fingerprint_fields(c), start)
    pg = {"a": np.full(ELEMENTS, 3.0, np.float32), "b": np.full(ELEMENTS, 1.0, np.float32)}
    for name, t in (("a", a), ("b", b)):
        assert t.contribute(ContributionHeader(0, name, 10, start), codec.encode({"w": pg[name]}, "none", 256)) == "accepted"
    update = codec.decode(a.fetch_update(0, "a"), coordinator.view, "none", 256)["w"]
    np.testing.assert_array_equal(update, np.full(ELEMENTS, -2.0, np.float32))  # -(3 + 1) / 2: only these two merged
    assert coordinator.round == 1 and [r.contributors for r in fragment.history] == [["a", "b"]]
    for t in (a, b):
        t.close()
