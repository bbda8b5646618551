"""Both transports run one exchange session (comm/session.py): one scripted sequence of joins, the start barrier,
an attempt cut off mid-payload and sent again, a duplicate, a late contribution and fetches leaves the same
session state in process and over gRPC (a server on localhost in this process), to the byte."""

import threading
import time

import grpc
import numpy as np
import pytest

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.comm.inprocess import InProcessExchange, InProcessTransport
from island_jax.comm.options import SERVICE_NAME
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import Coordinator
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.protocol import ContributionHeader

ISLANDS = ("a", "b", "c")
VALUES = 100_000  # one float32 leaf: 400,000 bytes in 7 chunks of at most 64 KiB
CONNECTIONS = 2
TOKENS = {"a": 3000, "b": 1000, "c": 1000}
HEADER_FRAME = 96  # bytes of a contribution's header frame (kind, CRC-32C, PayloadHeader with an 8-byte attempt)
TRAILER_FRAME = 35  # bytes of an update's trailer frame
CONTRIBUTION = CONNECTIONS * HEADER_FRAME + 400_000 + 7 * wire.FRAMING_BYTES  # frame bytes of one attempt
UPDATE = 400_000 + 7 * wire.FRAMING_BYTES + CONNECTIONS * TRAILER_FRAME  # frame bytes of one island's update


def _config():
    """Islands a, b and c; a round closes once two are in (no grace window), so c's contribution comes late."""
    c = default_config()
    for name in ISLANDS:
        c.islands[name] = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.comm.update(chunk_bytes=64 * 1024, connections=CONNECTIONS)
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False, min_islands=2, grace_seconds=0.0)
    return c


def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class _InProcess:
    """The session served in process; a cut attempt is what the session hears of a dropped stream."""

    def __init__(self, config, coordinator):
        self.session = InProcessExchange().serve(coordinator)
        self.transports = {n: InProcessTransport(self.session, connections=CONNECTIONS, timeout=30, join_timeout=30)
                           for n in ISLANDS}

    def cut_off(self, fields: pb.PayloadHeader, payload: bytes, plan, chunks: int) -> None:
        s, view = self.session, memoryview(payload)
        with s.lock:
            s.begin(fields)
            s.add_chunks(fields, [(k.index, view[k.offset : k.offset + k.nbytes]) for k in plan[:chunks]])
            assert sorted(s.fragment(fields).pending["a"].chunks) == list(range(chunks))
            s.abandon(fields, "its connection dropped")
            s.notify()

    def close(self) -> None:
        pass


class _Grpc:
    """The session behind the gRPC service; a cut attempt is a stream cancelled after some of its chunks."""

    def __init__(self, config, coordinator):
        self.server, service, port = serve(coordinator, "localhost:0", config.comm.chunk_bytes)
        self.session = service.session
        self.transports = {n: GrpcTransport(f"localhost:{port}", config.comm.chunk_bytes, join_timeout=30,
                                            round_timeout=30, connections=CONNECTIONS) for n in ISLANDS}

    def cut_off(self, fields: pb.PayloadHeader, payload: bytes, plan, chunks: int) -> None:
        hold = threading.Event()

        def frames():
            yield wire.header_frame(fields)
            for _, frame in list(wire.chunk_frames(payload, plan))[:chunks]:
                yield frame
            hold.wait(60)  # the stream stays open until it is cut

        contribute = self.transports["a"].channels[0].stream_unary(
            f"/{SERVICE_NAME}/Contribute", request_serializer=bytes, response_deserializer=pb.ContributeReply.FromString)
        call = contribute.future(frames(), timeout=60)
        fragment = self.session.coordinator.fragments[0]

        def taken(n):
            with self.session.lock:
                return len(fragment.pending["a"].chunks) == n if "a" in fragment.pending else n is None

        _until(lambda: taken(chunks), f"{chunks} chunks of a's attempt")
        call.cancel()  # the connection drops mid-payload
        try:  # the request stream stays open meanwhile: had it ended, the attempt would wait for its other streams
            _until(lambda: taken(None), "the cut attempt to be forgotten")
        finally:
            hold.set()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        self.server.stop(grace=0)


def _script(kind) -> dict:
    """Runs the sequence through one transport; returns the session state it leaves."""
    config = _config()
    coordinator = Coordinator(config, {"w": np.zeros(VALUES, np.float32)}, list(ISLANDS))
    start, fields_of = coordinator.checksum, fingerprint_fields(config)
    pg = {"a": 3.0, "b": 1.0, "c": 5.0}
    payloads = {n: codec.encode({"w": np.full(VALUES, v, np.float32)}, "none", 256) for n, v in pg.items()}
    headers = {n: ContributionHeader(0, n, TOKENS[n], start) for n in ISLANDS}
    exchange = kind(config, coordinator)
    t, s = exchange.transports, exchange.session
    state = {}
    try:
        state["joins"] = [t[n].join(n, fields_of, start) for n in ISLANDS]
        threads = [threading.Thread(target=t[n].start_together, args=(n, fields_of, start)) for n in ISLANDS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        state["ready"] = set(s.ready)
        # a's first attempt is cut after 3 of its 7 chunks: nothing of it stays, nothing is counted
        plan = coordinator.fragments[0].plan
        fields = wire.payload_header(headers["a"], s.layouts[0], 1, len(payloads["a"]), wire.new_attempt(),
                                     coordinator.incarnation)
        exchange.cut_off(fields, payloads["a"], plan, 3)
        state["after_cut"] = (coordinator.fragments[0].is_open(0, "a"), s.wire_bytes["a"]["received"])
        answers = [t["a"].contribute(headers["a"], payloads["a"])]  # sent again
        answers.append(t["a"].contribute(headers["a"], payloads["a"]))  # a duplicate: counted once
        answers.append(t["b"].contribute(headers["b"], payloads["b"]))  # the quorum: round 0 closes without c
        answers.append(t["c"].contribute(headers["c"], payloads["c"]))  # after its round closed
        state["answers"] = answers
        updates = {n: t[n].fetch_update(0, n) for n in ISLANDS}
        assert s.wait_until_fetched(0, timeout=30)
        state["updates_equal"] = len({bytes(u) for u in updates.values()}) == 1
        state["update"] = codec.decode(updates["a"], {"w": np.zeros(VALUES, np.float32)}, "none", 256)["w"]
        state["fetched"] = s.fetched_by(0, 0)
        state["wire_bytes"] = {n: dict(v) for n, v in s.wire_bytes.items()}
        record = coordinator.fragments[0].history[0]
        state["round"], state["contributors"], state["weights"] = coordinator.round, record.contributors, record.weights
        state["checksum"] = coordinator.checksum
    finally:
        exchange.close()
    return state


@pytest.mark.parametrize("kind", [_InProcess, _Grpc], ids=["in_process", "grpc"])
def test_both_transports_leave_the_same_session_state(kind):
    config = _config()
    start = Coordinator(config, {"w": np.zeros(VALUES, np.float32)}, list(ISLANDS)).checksum
    state = _script(kind)
    assert state["joins"] == [dict(round=0, checksum=start, rejoin=False)] * 3
    assert state["ready"] == set(ISLANDS)
    assert state["after_cut"] == (False, 0)
    assert state["answers"] == ["accepted", "accepted", "accepted", "discarded"]
    # Round 0 merged a once and b (weights 3000 : 1000), without c: -(0.75 * 3 + 0.25 * 1) = -2.5, exactly.
    assert state["round"] == 1 and state["contributors"] == ["a", "b"] and state["weights"] == {"a": 0.75, "b": 0.25}
    assert state["updates_equal"]
    np.testing.assert_array_equal(state["update"], np.full(VALUES, -2.5, np.float32))
    assert state["checksum"] == checksum({"w": np.full(VALUES, -2.5, np.float32)})
    assert state["fetched"] == set(ISLANDS)
    # frame bytes: a's retry and its duplicate, b's and c's one attempt each; one update to each island
    assert CONTRIBUTION == 400_311 and UPDATE == 400_189
    assert state["wire_bytes"] == {"a": {"received": 2 * CONTRIBUTION, "sent": UPDATE},
                                   "b": {"received": CONTRIBUTION, "sent": UPDATE},
                                   "c": {"received": CONTRIBUTION, "sent": UPDATE}}


def test_the_frame_sizes_the_counts_rest_on():
    """A contribution's header frame and an update's trailer frame, for island names of one letter."""
    header = wire.payload_header(ContributionHeader(0, "a", 3000, "0123456789abcdef"), codec.layout(
        {"w": np.zeros(VALUES, np.float32)}, codec.Codec("none")), CONNECTIONS, 400_000, wire.new_attempt(), "f" * 32)
    assert len(wire.header_frame(header)) == HEADER_FRAME
    assert len(wire.trailer_frame(pb.PayloadHeader(round=0, island="a", layout=header.layout, total_bytes=400_000,
                                                   crc32=0xFFFFFFFF, fragment=0))) == TRAILER_FRAME
