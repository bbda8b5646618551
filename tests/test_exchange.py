"""The gRPC exchange: large payloads across processes, CRC32 refusals, handshake, health."""

import os
import subprocess
import sys

import exchange_server
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import exchange_pb2_grpc as pb_grpc
from island_jax.comm import wire
from island_jax.comm.client import GrpcTransport
from island_jax.comm.server import serve
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import Coordinator, HandshakeError
from island_jax.outer import codec
from island_jax.params import checksum

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def server_process():
    """The 5 MB coordinator of tests/exchange_server.py in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "exchange_server.py")], stdout=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    yield proc, f"localhost:{int(line.split()[1])}"
    proc.kill()
    proc.wait()


def test_health_service_reports_serving(server_process):
    _, address = server_process
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "island_jax.exchange.Exchange"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


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
        assert t.join(n, fingerprint_fields(c), start) == dict(round=0, checksum=start)
    # Island a through the raw stub, to read the coordinator's own count and CRC32.
    header = pb.PayloadHeader(round=0, island="a", tokens=100, layout=transports["a"].layout)
    parts = list(wire.payload_parts(header, payloads["a"], c.comm.chunk_bytes))
    assert len(parts) == 1 + 5  # header + ceil(5,000,000 / 1 MiB) chunks
    reply = pb_grpc.ExchangeStub(transports["a"].channel).Contribute(iter(parts), timeout=60)
    assert reply.bytes_received == 5_000_000
    assert reply.crc32 == wire.crc32(payloads["a"])
    transports["b"].contribute(0, "b", 100, payloads["b"], start)
    # SGD lr 1 on the token-weighted mean: the update is -(pg_a + pg_b) / 2, exactly.
    expected = -(pg["a"]["w"] + pg["b"]["w"]) / np.float32(2)
    for n, t in transports.items():
        update = t.fetch_update(0, n)
        assert len(update) == 5_000_000
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
    parts = list(wire.payload_parts(pb.PayloadHeader(round=0, island="a", tokens=10, layout=a.layout), good, 64 * 1024))
    data = bytearray(parts[3].chunk.data)
    data[1000] ^= 0x01  # one flipped bit after the sender computed the chunk's CRC32
    parts[3].chunk.data = bytes(data)
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ExchangeStub(a.channel).Contribute(iter(parts), timeout=30)
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert "CRC32 mismatch in the chunk at offset 131072" in refused.value.details()
    assert coordinator._pending == {} and coordinator.round == 0
    # The same island then sends the intact payload, and only it is merged.
    a.contribute(0, "a", 10, good, start)
    b.contribute(0, "b", 10, codec.encode(pg_b, "none", 256), start)
    update = codec.decode(a.fetch_update(0, "a"), coordinator.master, "none", 256)["w"]
    np.testing.assert_array_equal(update, np.full(100_000, -2.0, np.float32))


def test_payload_of_the_wrong_size_is_refused(local_server):
    c, coordinator, address = local_server
    a = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30)
    a.join("a", fingerprint_fields(c), coordinator.checksum)
    parts = wire.payload_parts(pb.PayloadHeader(round=0, island="a", tokens=10, layout=a.layout), b"\0" * 400_004, 65536)
    with pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ExchangeStub(a.channel).Contribute(parts, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload of 400004 bytes from island 'a', round 0, but this round expects 400000 bytes" in refused.value.details()
    assert coordinator._pending == {}


def test_handshake_names_the_field_that_differs(local_server):
    c, coordinator, address = local_server
    other = _small_config()
    other.codec.block_size = 128
    t = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30)
    with pytest.raises(HandshakeError, match=r"codec.block_size \(theirs 128, here 256\)"):
        t.join("a", fingerprint_fields(other), coordinator.checksum)
    assert coordinator.joined == set()


def test_reassembler_refuses_out_of_order_and_short_streams():
    payload = bytes(range(256)) * 40
    parts = list(wire.payload_parts(pb.PayloadHeader(round=0, island="a"), payload, 1024))
    with pytest.raises(wire.WireError, match="chunk at offset 2048 arrived where offset 1024 was due"):
        wire.Reassembler(len(payload), 1024).extend([parts[0], parts[1], parts[3]])
    with pytest.raises(wire.WireError, match="ended after 3072 of 10240 bytes") as short:
        wire.Reassembler(len(payload), 1024).extend(parts[:4]).finish()
    assert short.value.code == "DATA_LOSS"
    with pytest.raises(wire.WireError, match="exceeds comm.chunk_bytes=512"):
        wire.Reassembler(len(payload), 512).extend(parts[:2])
    header, again = wire.Reassembler(len(payload), 1024).extend(parts).finish()
    assert again == payload and header.total_bytes == 10240 and header.crc32 == wire.crc32(payload)


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
    round, payload = a.fetch_view("a")
    assert round == 0 and len(payload) == a.view_bytes == 400_000  # 100,000 float32 in 7 chunks of at most 64 KiB
    assert checksum(codec.decode_view(payload, coordinator.view)) == coordinator.checksum
