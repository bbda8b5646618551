"""The gRPC exchange: large payloads across processes, CRC32 refusals, handshake, health."""

import os
import subprocess
import sys
import time

import exchange_server
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.comm.proxy import FaultProxy
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator, HandshakeError
from island_jax.mesh import without_forced_device_count
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.protocol import ExchangeError

HERE = os.path.dirname(os.path.abspath(__file__))


def _contribute_raw(transport: GrpcTransport, frames) -> pb.ContributeReply:
    """One Contribute stream of hand-made frames on the transport's first connection."""
    call = transport.channels[0].stream_unary(
        "/island_jax.exchange.Exchange/Contribute", request_serializer=bytes, response_deserializer=pb.ContributeReply.FromString
    )
    return call(iter(frames), timeout=60)


def _frames(transport: GrpcTransport, island: str, payload: bytes, tokens: int = 10) -> list[bytes]:
    header = pb.PayloadHeader(round=0, island=island, tokens=tokens, layout=transport.layouts[0], total_bytes=len(payload), streams=1)
    return [wire.header_frame(header)] + [frame for _, frame in wire.chunk_frames(payload, transport.plans[0])]


@pytest.fixture
def server_process():
    """The 5 MB coordinator of tests/exchange_server.py in a process of its own, one per test: the process ends
    once both islands fetched the update, so a test that runs after that one (the suite orders tests by their
    last durations) needs its own."""
    env = without_forced_device_count(os.environ)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "exchange_server.py")], stdout=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    yield proc, f"localhost:{int(line.split()[1])}"
    proc.kill()
    proc.wait()


@pytest.mark.slow  # starts the coordinator's process
def test_health_service_reports_serving(server_process):
    _, address = server_process
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "island_jax.exchange.Exchange"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow  # starts the coordinator's process
def test_five_megabyte_payload_crosses_processes_intact(server_process):
    proc, address = server_process
    c = exchange_server.config()
    start = checksum(exchange_server.params())
    rng = np.random.default_rng(0)
    pg = {n: {"w": rng.standard_normal(exchange_server.NUM_ELEMENTS).astype(np.float32)} for n in ("a", "b")}
    payloads = {n: codec.encode(pg[n], "none", 256) for n in pg}
    assert len(payloads["a"]) == 5_000_000  # above gRPC's default 4 MiB message limit
    transports = {n: GrpcTransport(address, c.comm.chunk_bytes, join_timeout=60, round_timeout=60) for n in pg}
    for n, t in transports.items():
        assert t.join(n, fingerprint_fields(c), start) == dict(round=0, checksum=start, rejoin=False)
    # Island a through a raw stream, to read the coordinator's own count and CRC32.
    frames = _frames(transports["a"], "a", payloads["a"], tokens=100)
    assert len(frames) == 1 + 5  # header + ceil(5,000,000 / 1 MiB) chunks
    assert max(len(f) for f in frames[1:]) == wire.FRAMING_BYTES + (1 << 20)
    reply = _contribute_raw(transports["a"], frames)
    assert reply.bytes_received == 5_000_000
    view = memoryview(payloads["a"])
    assert reply.crc32 == wire.fold_crc32(wire.crc32(view[k.offset : k.offset + k.nbytes]) for k in transports["a"].plans[0])
    transports["b"].contribute(ContributionHeader(0, "b", 100, start), payloads["b"])
    # SGD lr 1 on the token-weighted mean: the update is -(pg_a + pg_b) / 2, exactly.
    expected = -(pg["a"]["w"] + pg["b"]["w"]) / np.float32(2)
    for n, t in transports.items():
        update = t.fetch_update(0, n)
        assert len(update) == 5_000_000
        # 5 chunk frames of 17 framing bytes each, and a trailer of under 100 bytes.
        assert 5_000_085 < t.last_stats.bytes_received < 5_000_185
        np.testing.assert_array_equal(codec.decode(update, exchange_server.params(), "none", 256)["w"], expected)
        t.close()
    assert proc.wait(timeout=60) == 0  # the server saw both islands fetch the whole update


def _small_config(kind="none"):
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = kind
    c.comm.chunk_bytes = 64 * 1024
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    return c


@pytest.fixture
def local_server():
    c = _small_config()
    coordinator = Coordinator(c, {"w": np.zeros(100_000, np.float32)}, ["a", "b"])
    server, service, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    yield c, coordinator, f"localhost:{port}"
    server.stop(grace=0)


def test_chunk_with_flipped_byte_is_refused_and_never_merged(local_server):
    c, coordinator, address = local_server
    start = coordinator.checksum
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    b = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    a.join("a", fingerprint_fields(c), start)
    b.join("b", fingerprint_fields(c), start)
    pg_a = {"w": np.full(100_000, 3.0, np.float32)}
    pg_b = {"w": np.full(100_000, 1.0, np.float32)}
    good = codec.encode(pg_a, "none", 256)
    frames = _frames(a, "a", good)
    assert len(frames) == 1 + 7  # 400,000 bytes in chunks of 64 KiB
    flipped = bytearray(frames[4])
    flipped[wire.FRAMING_BYTES + 1000] ^= 0x01  # one flipped bit after the sender computed the chunk's CRC32
    frames[4] = bytes(flipped)
    with pytest.raises(grpc.RpcError) as refused:
        _contribute_raw(a, frames)
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert "CRC-32C mismatch in chunk 3 (offset 196608, 65536 bytes)" in refused.value.details()
    assert coordinator.fragments[0].pending == {} and coordinator.round == 0
    # The same island then sends the intact payload, and only it is merged.
    a.contribute(ContributionHeader(0, "a", 10, start), good)
    b.contribute(ContributionHeader(0, "b", 10, start), codec.encode(pg_b, "none", 256))
    update = codec.decode(a.fetch_update(0, "a"), coordinator.view, "none", 256)["w"]
    np.testing.assert_array_equal(update, np.full(100_000, -2.0, np.float32))


def test_payload_of_the_wrong_size_is_refused(local_server):
    c, coordinator, address = local_server
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    a.join("a", fingerprint_fields(c), coordinator.checksum)
    with pytest.raises(grpc.RpcError) as refused:
        _contribute_raw(a, _frames(a, "a", b"\0" * 400_004))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload of 400004 bytes from island 'a', round 0, fragment 0, but it should be 400000 bytes" in refused.value.details()
    assert coordinator.fragments[0].pending == {}


def test_handshake_names_the_field_that_differs(local_server):
    c, coordinator, address = local_server
    other = _small_config()
    other.codec.block_size = 128
    t = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30)
    with pytest.raises(HandshakeError, match=r"codec.block_size \(theirs 128, here 256\)"):
        t.join("a", fingerprint_fields(other), coordinator.checksum)
    assert coordinator.fragments[0].joined == set()


def test_islands_with_another_corpus_fail_at_join_naming_both(local_server, tmp_path):
    """Island b's copy of the corpus differs from a's in one byte of one file (another Python's standard library,
    a changed copy): b is refused at join, the message naming both islands and both content hashes."""
    from island_jax import data
    from island_jax.coordinator.handshake import CORPUS

    c, coordinator, address = local_server
    corpora = {}
    for name, last in (("a", b"x"), ("b", b"y")):
        folder = tmp_path / name
        folder.mkdir()
        for i in range(30):
            (folder / f"m{i}.py").write_bytes(b"print(%d)\n" % i + (last if i == 29 else b""))
        corpora[name] = data.load_corpus(str(folder / "*.py"), 0.2, ["a", "b"]).fingerprint
    a_hash, b_hash = corpora["a"]["content_sha256"], corpora["b"]["content_sha256"]
    assert a_hash != b_hash and corpora["a"]["sha256"] == corpora["b"]["sha256"]  # the same paths, other bytes
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30)
    b = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30)
    a.join("a", {**fingerprint_fields(c), CORPUS: corpora["a"]}, coordinator.checksum)
    with pytest.raises(HandshakeError, match=rf"island 'b' trains on another corpus than island 'a': content_sha256 "
                                             rf"\(a: '{a_hash}', b: '{b_hash}'\); give every island the same files"):
        b.join("b", {**fingerprint_fields(c), CORPUS: corpora["b"]}, coordinator.checksum)
    assert coordinator.fragments[0].joined == {"a"}
    b.join("b", {**fingerprint_fields(c), CORPUS: corpora["a"]}, coordinator.checksum)  # the same corpus: admitted
    assert coordinator.fragments[0].joined == {"a", "b"}
    # island a joins again (a restart) from a host whose copy is b's first one: refused against b
    with pytest.raises(HandshakeError, match=rf"island 'a' trains on another corpus than island 'b': content_sha256 "
                                             rf"\(b: '{a_hash}', a: '{b_hash}'\)"):
        GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30).join(
            "a", {**fingerprint_fields(c), CORPUS: corpora["b"]}, coordinator.checksum)


def test_four_connections_reassemble_byte_exact_in_any_order():
    """A transfer split over 4 connections (chunk k on k % 4), its chunks arriving in any order."""
    like = {"w": np.zeros(70_000, np.float32), "b": np.zeros(3, np.float32)}
    payload = np.random.default_rng(0).bytes(codec.payload_bytes(like, "none", 256))
    plan = codec.chunk_plan(like, "none", 256, 65536)
    # "b" (12 bytes) alone, then "w" in pieces of 16,384 float32: 4 x 65,536 bytes and 17,856 bytes.
    assert [k.nbytes for k in plan] == [12, 65536, 65536, 65536, 65536, 17856]
    streams = [list(wire.chunk_frames(payload, plan, connection, 4)) for connection in range(4)]
    assert [[k for k, _ in s] for s in streams] == [[0, 4], [1, 5], [2], [3]]
    frames = [frame for s in streams for _, frame in s]
    rng = np.random.default_rng(1)
    for _ in range(10):
        assembler = wire.ChunkAssembler(plan)
        for i in rng.permutation(len(frames)):
            kind, value = wire.parse(frames[i])
            assert kind == wire.CHUNK
            assembler.add(*value)
        crc = wire.fold_crc32(wire.crc32(payload[k.offset : k.offset + k.nbytes]) for k in plan)
        assert assembler.finish(pb.PayloadHeader(total_bytes=len(payload), crc32=crc)) == payload


def test_assembler_refuses_repeated_misplaced_corrupt_and_missing_chunks():
    like = {"w": np.zeros(40_000, np.float32)}
    payload = np.random.default_rng(0).bytes(codec.payload_bytes(like, "none", 256))
    plan = codec.chunk_plan(like, "none", 256, 65536)
    assert [k.nbytes for k in plan] == [65536, 65536, 28928]
    frames = [wire.parse(f)[1] for _, f in wire.chunk_frames(payload, plan)]
    assembler = wire.ChunkAssembler(plan)
    assembler.add(*frames[0])
    with pytest.raises(wire.WireError, match="chunk 0 arrived twice"):
        assembler.add(*frames[0])
    index, offset, crc, data = frames[1]
    with pytest.raises(wire.WireError, match="chunk 1 came at offset 1024 with 65536 bytes, but the plan puts it at offset 65536"):
        assembler.add(index, 1024, crc, data)
    with pytest.raises(wire.WireError, match="CRC-32C mismatch in chunk 1") as corrupt:
        assembler.add(index, offset, crc ^ 1, data)
    assert corrupt.value.code == "DATA_LOSS"
    with pytest.raises(wire.WireError, match=r"ended with 2 of 3 chunks missing \(first: \[1, 2\]\)") as short:
        assembler.finish(pb.PayloadHeader(total_bytes=len(payload)))
    assert short.value.code == "DATA_LOSS"
    with pytest.raises(wire.WireError, match="unknown kind b'X'"):
        wire.parse(b"X123")


def test_the_wire_is_unchanged_for_the_same_payload():
    """The chunk frames of one payload, pinned: kind 'C', index u32, offset u64 and CRC-32C u32 (little-endian),
    then the chunk, whichever connection carries it; the CRCs are CRC-32C (RFC 3720's check value)."""
    assert wire.crc32(b"123456789") == 0xE3069283
    values = {"w": np.arange(100_000, dtype=np.float32) * 0.001 - 7.0}
    payload = codec.encode(values, "none", 256)
    plan = codec.chunk_plan(values, "none", 256, 64 << 10)
    for connections in (1, 4, 16):
        frames = dict(f for k in range(connections) for f in wire.chunk_frames(payload, plan, k, connections))
        assert sorted(frames) == list(range(7)) and sum(map(len, frames.values())) == 400_000 + 7 * 17
        assert frames[1][:17] == bytes.fromhex("43" "01000000" "0000010000000000" "d8bf1183")
        assert frames[1][17:] == payload[65536 : 2 * 65536]
        crcs = [wire.parse(frames[k])[1][2] for k in range(7)]
        assert crcs == [0x0CC8ED2B, 0x8311BFD8, 0x2E054496, 0xCCFF310B, 0xFE33A51A, 0x7B74BA82, 0x0594550D]
        assert wire.fold_crc32(crcs) == 0xB08209CD


def test_committed_stubs_are_what_the_proto_generates(tmp_path):
    from island_jax.comm import generate_stubs

    assert generate_stubs.generate(str(tmp_path)) == 0
    for name in ("exchange_pb2.py", "exchange_pb2.pyi", "exchange_pb2_grpc.py"):
        generated = (tmp_path / "island_jax" / "comm" / name).read_text()
        assert generated == open(os.path.join(HERE, "..", "island_jax", "comm", name)).read(), name


def test_view_is_served_whole_over_grpc(local_server):
    c, coordinator, address = local_server
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    a.join("a", fingerprint_fields(c), coordinator.checksum)
    rounds, payload = a.fetch_view("a")
    assert rounds == [0] and len(payload) == a.view_bytes == 400_000  # 100,000 float32 in 7 chunks of at most 64 KiB
    assert checksum(codec.decode_view(payload, coordinator.view)) == coordinator.checksum


@pytest.mark.parametrize("values, connections, reset_after", [(100_000, 1, 200_000), (600_000, 16, 1_000_000)])
def test_a_contribution_retried_after_a_dropped_connection_counts_once(values, connections, reset_after):
    """A reset mid-stream (through a proxy) and a resend of a whole contribution: the round merges one
    contribution per island, with the weights and merged value of a run without faults. With 16 connections the
    600,000 values (2.4 MB, 37 chunks of 64 KiB) travel on 16 streams, and the reset drops every one of them
    after about 1 MB in all: some streams have ended by then, some are cut mid-chunk, some have not started."""
    c = _small_config()
    coordinator = Coordinator(c, {"w": np.zeros(values, np.float32)}, ["a", "b"])
    server, _, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    address = f"localhost:{port}"
    start = coordinator.checksum
    pg = {"a": {"w": np.full(values, 3.0, np.float32)}, "b": {"w": np.full(values, 1.0, np.float32)}}
    payloads = {n: codec.encode(pg[n], "none", 256) for n in pg}
    with FaultProxy(address) as proxy:
        a = GrpcTransport(proxy.address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30, reconnect_seconds=30,
                          connections=connections)
        b = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30, connections=connections)
        a.join("a", fingerprint_fields(c), start)
        b.join("b", fingerprint_fields(c), start)
        assert a._streams() == connections
        proxy.reset_after(reset_after)  # part way through a's payload of 4 x values bytes
        assert a.contribute(ContributionHeader(0, "a", 3000, start), payloads["a"]) == "accepted"
        assert proxy.wait_fired(timeout=0) and proxy.resets == 1
        # the reply was lost, say: the same contribution once more, whole
        assert a.contribute(ContributionHeader(0, "a", 3000, start), payloads["a"]) == "accepted"
        assert b.contribute(ContributionHeader(0, "b", 1000, start), payloads["b"]) == "accepted"
        update = a.fetch_update(0, "a")
        assert b.fetch_update(0, "b") == update
    record = coordinator.fragments[0].history[0]
    assert record.contributors == ["a", "b"] and record.weights == {"a": 0.75, "b": 0.25}
    reference = Coordinator(c, {"w": np.zeros(values, np.float32)}, ["a", "b"])
    for name, tokens in (("a", 3000), ("b", 1000)):
        reference.join(name, fingerprint_fields(c), start)
        reference.contribute(ContributionHeader(0, name, tokens, start), payloads[name])
    assert update == reference.fetch_update(0, "a")
    assert coordinator.checksum == reference.checksum
    for t in (a, b):
        t.close()
    server.stop(grace=0)


class _Unavailable(grpc.RpcError):
    """What a call to a coordinator that is down fails with."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


@pytest.mark.parametrize("cap, pauses", [(8.0, [0.5, 1.0, 2.0, 0.5]), (1.0, [0.5, 1.0, 1.0, 1.0, 0.5])])
def test_reconnect_attempts_double_from_half_a_second_up_to_the_backoff_cap(monkeypatch, cap, pauses):
    """`comm.reconnect_backoff_cap_seconds`: the pauses between attempts double from 0.5 s up to the cap, and the
    last one ends at `comm.reconnect_seconds` (4 s here), when the call fails naming it."""
    from types import SimpleNamespace

    from island_jax.comm import reconnect

    slept = []
    monkeypatch.setattr(reconnect, "time", SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    t = GrpcTransport("localhost:1", 1 << 20, reconnect_seconds=4.0, backoff_cap_seconds=cap, clock=lambda: sum(slept))
    t._probe = lambda: (_ for _ in ()).throw(_Unavailable())  # the coordinator still down at every attempt

    def call(incarnation):
        raise _Unavailable()

    with pytest.raises(ExchangeError, match=r"unreachable for 4 s \(comm.reconnect_seconds=4; last: UNAVAILABLE"):
        t._retrying("fetching the update", call)
    assert slept == pauses
    t.close()
    assert default_config().comm.reconnect_backoff_cap_seconds == 8.0


def test_a_join_or_ready_lost_in_flight_is_made_again_until_the_coordinator_answers(monkeypatch, caplog):
    """The coordinator died with an island's Join in flight (after it admitted the island, before the reply), and
    again with its ready call (each ends UNAVAILABLE): the island makes each again, with the reconnect backoff, and
    the coordinator that answers admits it."""
    from island_jax.comm.service import ExchangeService

    real, lost = ExchangeService.Join, []

    async def dies_once_each(self, request, context):  # the first join (once admitted), and the first ready
        if request.ready not in lost:
            lost.append(request.ready)
            if not request.ready:
                await real(self, request, context)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return await real(self, request, context)

    monkeypatch.setattr(ExchangeService, "Join", dies_once_each)  # before the server binds its handlers
    c = _small_config()
    del c.islands["b"]
    coordinator = Coordinator(c, {"w": np.zeros(1000, np.float32)}, ["a"])
    server, service, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    address = f"localhost:{port}"
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, backoff_cap_seconds=1.0)
    try:
        with caplog.at_level("WARNING"):
            reply = a.join("a", fingerprint_fields(c), coordinator.checksum)
            a.start_together("a", fingerprint_fields(c), coordinator.checksum)
    finally:
        a.close()
        server.stop(grace=0)
    assert lost == [False, True] and reply == dict(round=0, checksum=coordinator.checksum, rejoin=False)
    assert coordinator.fragments[0].joined == {"a"} and service.session.ready == {"a"}
    assert [r.getMessage() for r in caplog.records if "was lost" in r.getMessage()] == [
        f"island a: its {what} to the coordinator at {address} was lost (Socket closed); again in 0.5 s (up to "
        "comm.join_timeout_seconds=30)" for what in ("join", "ready")]
