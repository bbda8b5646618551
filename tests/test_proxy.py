"""FaultProxy: forwards bytes unchanged, resets and corrupts exactly where it is told, and keeps accepting.

Every test talks to servers on 127.0.0.1 through the proxy. On Linux a socket
that received a TCP RST fails its next recv with ECONNRESET, which Python
raises as ConnectionResetError, at both ends; bytes the peer had received
before the RST are still read first, so the exact byte counts can be checked.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm.proxy import FaultProxy, split_address

TIMEOUT = 10.0  # seconds; generous upper bound for anything that should take milliseconds


def _wait_until(predicate, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.001)


class _Server:
    """A TCP server on 127.0.0.1: records what each connection received and how it ended; echoes if asked."""

    def __init__(self, echo: bool, pace: float = 0.0):
        self.echo = echo
        self.pace = pace  # seconds to sleep after each read; a slow reader reads 64 KiB at a time
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[bytearray] = []  # one per accepted connection, in accept order
        self.ended: list[type[BaseException] | None] = []  # None: orderly EOF; else the exception class
        self.done: list[threading.Event] = []
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            i = len(self.received)
            self.received.append(bytearray())
            self.ended.append(None)
            self.done.append(threading.Event())
            t = threading.Thread(target=self._serve, args=(conn, i), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, i: int) -> None:
        buf = bytearray(1 << 16 if self.pace else 1 << 20)
        try:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                time.sleep(self.pace)
                self.received[i] += buf[:n]
                if self.echo:
                    conn.sendall(buf[:n])
        except OSError as e:
            self.ended[i] = type(e)
        finally:
            conn.close()
            self.done[i].set()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        except OSError:
            pass
        self.sock.close()
        self._accepter.join(TIMEOUT)
        for t in self._threads:
            t.join(TIMEOUT)


@pytest.fixture
def echo_server():
    server = _Server(echo=True)
    yield server
    server.close()


@pytest.fixture
def sink_server():
    server = _Server(echo=False)
    yield server
    server.close()


def _dial(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(split_address(proxy.address), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _roundtrip(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` to an echo server while reading the echo (so neither side's buffers fill)."""
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    echoed = _recv_exactly(sock, len(data))
    sender.join(TIMEOUT)
    return echoed


def _first_error(sock: socket.socket, data: bytes, piece: int) -> type[BaseException] | None:
    """Send `data` in `piece`-byte sendalls, then recv(1); the class of the first OSError raised, or None.

    After a RST the first call on the socket fails with ECONNRESET (the error is
    then consumed: a later recv returns b"", a later send fails with EPIPE), so
    the first error is what the client application would see.
    """
    try:
        for start in range(0, len(data), piece):
            sock.sendall(data[start:start + piece])
        sock.recv(1)
    except OSError as e:
        return type(e)
    return None


def test_split_address():
    assert split_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_address("[::1]:0") == ("::1", 0)
    for bad in ("127.0.0.1", ":80", "host:", "host:x", "host:70000"):
        with pytest.raises(ValueError):
            split_address(bad)


def test_forwards_bytes_unchanged_both_ways(echo_server):
    data = random.Random(0).randbytes(5 * (1 << 20) + 3)  # more than the 1 MiB buffer, not a multiple of it
    with FaultProxy(echo_server.address) as proxy:
        host, port = split_address(proxy.address)
        assert host == "127.0.0.1" and port > 0
        with _dial(proxy) as sock:
            assert _roundtrip(sock, data) == data
            assert proxy.connections == 1 and proxy.accepted == 1
            assert echo_server.received[0] == data
            sock.shutdown(socket.SHUT_WR)  # an EOF is passed on as an EOF: the server ends cleanly
            assert sock.recv(1) == b""
        assert echo_server.done[0].wait(TIMEOUT) and echo_server.ended[0] is None
        _wait_until(lambda: proxy.connections == 0)
        assert proxy.bytes_up == proxy.bytes_down == len(data)
        assert proxy.resets == proxy.corruptions == 0


def test_reset_both_ends_see_connection_reset(echo_server):
    with FaultProxy(echo_server.address) as proxy:
        with _dial(proxy) as sock:
            assert _roundtrip(sock, b"ping") == b"ping"
            assert proxy.reset() == 1  # returns once the RSTs are sent
            assert proxy.connections == 0 and proxy.resets == 1
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
        assert echo_server.done[0].wait(TIMEOUT)
        assert echo_server.ended[0] is ConnectionResetError
        assert echo_server.received[0] == b"ping"


def test_new_connections_work_after_reset(echo_server):
    with FaultProxy(echo_server.address) as proxy:
        socks = [_dial(proxy) for _ in range(3)]
        for i, sock in enumerate(socks):
            assert _roundtrip(sock, b"x%d" % i) == b"x%d" % i
        assert proxy.reset() == 3
        for sock in socks:
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
            sock.close()
        assert proxy.reset() == 0 and proxy.resets == 2
        with _dial(proxy) as sock:
            assert _roundtrip(sock, b"after") == b"after"
            assert proxy.connections == 1 and proxy.accepted == 4


@pytest.mark.parametrize(
    "nbytes, piece",
    [
        (1, 4096),  # the first byte only
        (2500, 1000),  # falls in the third of several small sends
        (3 * (1 << 20) + 5, 8 << 20),  # several of the proxy's buffers into one large send
    ],
)
def test_reset_after_exactly_n_upstream_bytes(sink_server, nbytes, piece):
    data = random.Random(nbytes).randbytes(nbytes + 2 * piece)
    with FaultProxy(sink_server.address) as proxy:
        with _dial(proxy) as sock:
            _wait_until(lambda: len(sink_server.received) == 1)  # the server accepted the proxy's connection
            proxy.reset_after(nbytes)
            assert proxy.armed and not proxy.wait_fired(0)
            assert _first_error(sock, data, piece) is ConnectionResetError
            assert proxy.wait_fired(TIMEOUT) and not proxy.armed
        assert sink_server.done[0].wait(TIMEOUT)
        assert sink_server.ended[0] is ConnectionResetError
        assert len(sink_server.received[0]) == nbytes
        assert sink_server.received[0] == data[:nbytes]
        assert proxy.bytes_up == nbytes and proxy.resets == 1 and proxy.connections == 0


def test_reset_after_waits_for_a_slow_target_to_take_its_bytes():
    # The target reads 64 KiB every 2 ms: when the count is reached, megabytes still sit in the proxy's
    # send buffer, and a RST at once would discard them. The proxy resets once they are acknowledged.
    server = _Server(echo=False, pace=0.002)
    nbytes = 4 * (1 << 20) + 1
    data = random.Random(1).randbytes(nbytes + (1 << 20))
    try:
        with FaultProxy(server.address) as proxy, _dial(proxy) as sock:
            _wait_until(lambda: len(server.received) == 1)
            proxy.reset_after(nbytes)
            assert _first_error(sock, data, len(data)) is ConnectionResetError
            assert proxy.wait_fired(TIMEOUT)
        assert server.done[0].wait(TIMEOUT) and server.ended[0] is ConnectionResetError
        assert server.received[0] == data[:nbytes]
    finally:
        server.close()


def test_reset_after_counts_bytes_over_all_connections(sink_server):
    with FaultProxy(sink_server.address) as proxy:
        a, b = _dial(proxy), _dial(proxy)
        a.sendall(b"a" * 1000)  # before arming: not counted
        _wait_until(lambda: len(sink_server.received) == 2 and len(sink_server.received[0]) == 1000)
        proxy.reset_after(1500)
        a.sendall(b"A" * 1000)
        _wait_until(lambda: len(sink_server.received[0]) == 2000)
        assert proxy.armed
        # 500 of these reach the server, then both connections are reset.
        assert _first_error(b, b"B" * 1000, 1000) is ConnectionResetError
        assert proxy.wait_fired(TIMEOUT)
        with pytest.raises(ConnectionResetError):
            a.recv(1)
        a.close()
        b.close()
        for i in range(2):
            assert sink_server.done[i].wait(TIMEOUT) and sink_server.ended[i] is ConnectionResetError
        assert sink_server.received[0] == b"a" * 1000 + b"A" * 1000
        assert sink_server.received[1] == b"B" * 500


def test_reset_after_zero_resets_now(echo_server):
    with FaultProxy(echo_server.address) as proxy:
        with _dial(proxy) as sock:
            assert _roundtrip(sock, b"hi") == b"hi"
            proxy.reset_after(0)
            assert proxy.wait_fired(0) and proxy.resets == 1
            with pytest.raises(ConnectionResetError):
                sock.recv(1)


@pytest.mark.parametrize("nbytes, bit", [(0, 0), (1234, 7), ((1 << 20) + 17, 3)])
def test_corrupt_after_flips_exactly_one_bit(echo_server, nbytes, bit):
    data = random.Random(nbytes).randbytes(2 * (1 << 20) + 100)
    with FaultProxy(echo_server.address) as proxy:
        with _dial(proxy) as sock:
            assert _roundtrip(sock, b"warm-up") == b"warm-up"  # before arming: not counted
            proxy.corrupt_after(nbytes, bit=bit)
            assert not proxy.wait_fired(0)
            echoed = _roundtrip(sock, data)
            assert proxy.wait_fired(TIMEOUT) and proxy.corruptions == 1
            expected = bytearray(data)
            expected[nbytes] ^= 1 << bit
            assert echoed == expected  # the echo carries the flipped bit back; downstream is not touched
            diff = int.from_bytes(echoed, "big") ^ int.from_bytes(data, "big")
            assert diff == 1 << (8 * (len(data) - 1 - nbytes) + bit)  # one bit, at that byte, nothing else
            assert _roundtrip(sock, data) == data  # one-shot: the next pass is clean
        assert proxy.corruptions == 1 and proxy.resets == 0


def test_unreachable_target_resets_the_client():
    free = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()  # nothing listens there now: the proxy's connect is refused
    with FaultProxy(address) as proxy:
        # The RST can beat the client's connect() to its return (a busy machine): then connect raises it.
        with pytest.raises(ConnectionResetError):
            with _dial(proxy) as sock:
                sock.recv(1)
        assert proxy.accepted == 1
        _wait_until(lambda: proxy.connections == 0)


def test_arguments_and_close():
    with pytest.raises(ValueError):
        FaultProxy("no-port")
    proxy = FaultProxy("127.0.0.1:9")
    thread = proxy._thread
    assert thread.daemon and thread.is_alive()
    for bad in (lambda: proxy.reset_after(-1), lambda: proxy.corrupt_after(-1), lambda: proxy.corrupt_after(0, 8)):
        with pytest.raises(ValueError):
            bad()
    proxy.close()
    proxy.close()  # idempotent
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("FaultProxy")]
    with pytest.raises(RuntimeError):
        proxy.reset()
    with pytest.raises(RuntimeError):
        proxy.reset_after(1)
    with pytest.raises(ConnectionRefusedError):  # the listening socket is closed
        socket.create_connection(split_address(proxy.address), timeout=TIMEOUT).close()


def test_grpc_health_through_proxy_survives_reset():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        with FaultProxy(f"127.0.0.1:{port}") as proxy, grpc.insecure_channel(proxy.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            assert stub.Check(request, timeout=TIMEOUT).status == serving
            watch = stub.Watch(request, timeout=TIMEOUT)  # a stream that stays open on the connection
            assert next(watch).status == serving
            assert proxy.connections == 1 and proxy.accepted == 1

            assert proxy.reset() == 1
            # A call in flight when the link breaks fails with UNAVAILABLE.
            with pytest.raises(grpc.RpcError) as failed:
                next(watch)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            # A call started after the reset waits for the channel to reconnect through the proxy, and succeeds.
            # Until the channel has seen its transport break (the watch's failure can come first), a call may
            # still go out on the broken one and fail with UNAVAILABLE: such calls are made again, to a deadline.
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    reply = stub.Check(request, timeout=TIMEOUT, wait_for_ready=True)
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
            assert reply.status == serving
            assert proxy.connections == 1 and proxy.accepted == 2 and proxy.resets == 1
            assert proxy.bytes_up > 0 and proxy.bytes_down > 0
    finally:
        server.stop(None).wait(TIMEOUT)
