"""A TCP proxy that breaks the link between islands and the coordinator on demand (fault drills).

Islands dial `proxy.address`; the proxy dials the coordinator (`target`) once for every connection it
accepts and copies bytes both ways, unchanged, until a fault is injected: `reset()` resets every live
connection now (SO_LINGER 0: both ends see a TCP RST, not an orderly EOF); `reset_after(n)` does so once
exactly `n` more bytes have gone upstream (island -> coordinator, over all connections); `corrupt_after(n)`
flips one bit of the upstream byte at offset `n` from now (TCP's checksum does not see it). Armed faults are
one-shot; `wait_fired(timeout)` blocks until every armed fault has happened, and the proxy keeps accepting
connections after any fault. Sizes are bytes, timeouts seconds, addresses "HOST:PORT" ("[::1]:PORT").

One daemon thread runs a `selectors` loop over non-blocking sockets and owns every socket; the public methods,
callable from any thread, hand work to it (and for `reset` and `close` wait until it is done). Each direction
forwards through a buffer of `bufsize` bytes and stops reading while it is full, so a slow reader slows its
writer as TCP would. Resets and errors pass on as RSTs, an orderly EOF as an EOF (docs/faults.md).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import selectors
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable

DEFAULT_BUFSIZE = 1 << 20  # bytes per direction and connection
_DRAIN_POLL = 0.001  # seconds between looks at that send buffer


def split_address(address: str) -> tuple[str, int]:
    """("HOST", PORT) from "HOST:PORT" or "[V6HOST]:PORT"; ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(address: str, flags: int = 0) -> tuple[int, tuple]:
    host, port = split_address(address)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)[0]
    return family, sockaddr


def _unsent(sock: socket.socket) -> int:
    """Bytes in the kernel's send queue of `sock` not yet acknowledged by the peer (Linux SIOCOUTQ); 0 where unknown."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return struct.unpack("i", raw)[0]


def _abort(sock: socket.socket) -> None:
    """Close `sock` so that the peer sees a TCP RST (SO_LINGER on, 0 seconds)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Pipe:
    """One direction of a connection: bytes read from `src` wait in `buf[start:end]` until `dst` takes them."""

    __slots__ = ("src", "dst", "up", "buf", "view", "start", "end", "eof")

    def __init__(self, src: socket.socket, dst: socket.socket, up: bool, bufsize: int):
        self.src, self.dst, self.up = src, dst, up
        self.buf = bytearray(bufsize)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.eof = False  # src reached EOF; dst's writing half is shut

    @property
    def pending(self) -> int:
        return self.end - self.start


class _Conn:
    __slots__ = ("client", "server", "up", "down", "connected", "events", "closed")

    def __init__(self, client: socket.socket, server: socket.socket, bufsize: int):
        self.client, self.server = client, server
        self.up = _Pipe(client, server, True, bufsize)
        self.down = _Pipe(server, client, False, bufsize)
        self.connected = False  # the connection to the target is established
        self.events = {client: 0, server: 0}  # selector interest currently registered per socket
        self.closed = False


class FaultProxy:
    """Forward TCP connections from `listen` to `target`, with faults injected on demand.

    Args:
      target: "HOST:PORT" of the server to forward to (resolved once, here;
        socket.gaierror if it does not resolve, ValueError if malformed).
      listen: "HOST:PORT" to listen on; port 0 picks a free port.
      bufsize: bytes buffered per direction of each connection (at least 256 KiB
        is sensible for multi-MB payloads; ValueError below 1).
      drain_timeout: seconds a fired `reset_after` waits, at most, for its last
        bytes to be acknowledged by the target before it resets anyway.

    Attributes (read from any thread; they are updated by the proxy's thread):
      address: "HOST:PORT" the proxy listens on, the address clients dial.
      connections: connections live now (accepted and not yet closed or reset).
      accepted: connections accepted since the start.
      bytes_up / bytes_down: bytes forwarded client -> target / target -> client
        since the start (handed to the receiving socket's kernel buffer).
      resets: times every live connection was reset (`reset()` or a fired `reset_after`).
      corruptions: bits flipped by fired `corrupt_after` faults.

    Usable as a context manager; `close()` on exit. Methods other than the
    attributes' reads raise RuntimeError once the proxy is closed.
    """

    def __init__(self, target: str, listen: str = "127.0.0.1:0", *, bufsize: int = DEFAULT_BUFSIZE,
                 drain_timeout: float = 5.0):
        if bufsize < 1:
            raise ValueError(f"bufsize must be positive, got {bufsize}")
        self._drain_timeout = drain_timeout
        self.target = target
        self._target_family, self._target_addr = _resolve(target)
        self._bufsize = bufsize

        family, sockaddr = _resolve(listen, socket.AI_PASSIVE)
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        host, port = self._listener.getsockname()[:2]
        self.address = _join_address(host, port)

        self.accepted = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.resets = 0
        self.corruptions = 0
        self._conns: dict[_Conn, None] = {}  # insertion-ordered set

        # Armed faults, under _lock: bytes still to pass before each fires (None: not armed).
        self._lock = threading.Lock()
        self._reset_left: int | None = None
        self._corrupt_left: int | None = None
        self._corrupt_mask = 0
        self._idle = threading.Event()  # set while no armed fault is waiting to fire
        self._idle.set()
        # reset_after's last bytes are out of the buffer of this pipe; reset once its socket drained.
        self._reset_due: _Pipe | None = None
        self._reset_deadline = 0.0

        self._commands: collections.deque[tuple[Callable[[], None], threading.Event]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, self._on_accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._running = True
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"FaultProxy {self.address}->{target}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- public API

    @property
    def connections(self) -> int:
        """Connections live now."""
        return len(self._conns)

    @property
    def armed(self) -> bool:
        """True while a `reset_after` or `corrupt_after` fault is armed and has not fired."""
        return not self._idle.is_set()

    def reset(self, timeout: float = 10.0) -> int:
        """Reset every live connection now (both ends see a TCP RST); keep accepting new ones.

        Blocks until the proxy's thread has closed the sockets (at most
        `timeout` seconds; TimeoutError beyond). Returns the number of
        connections reset. Does not disarm faults armed with `*_after`.
        """
        result: list[int] = []
        self._call(lambda: result.append(self._reset_all()), timeout)
        return result[0]

    def reset_after(self, nbytes: int) -> None:
        """Arm a one-shot reset: once `nbytes` more bytes went upstream in total, reset every live connection.

        The target receives exactly `nbytes` more bytes (over all connections,
        in the order the proxy reads them); the rest of the chunk that reaches
        the count is dropped and every live connection is reset as by
        `reset()`. Before resetting, the proxy waits (up to `drain_timeout`) for
        those last bytes to be acknowledged by the target's kernel, so the RST
        does not discard them; meanwhile it reads nothing more upstream.
        `nbytes == 0` resets at once. Returns immediately; re-arming replaces
        a pending reset. ValueError if `nbytes < 0`.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._check_open()
        if nbytes == 0:
            with self._lock:
                self._reset_left = None
                self._update_idle()
            self.reset()
            return
        with self._lock:
            self._reset_left = nbytes
            self._update_idle()

    def corrupt_after(self, nbytes: int, bit: int = 0) -> None:
        """Arm a one-shot corruption: flip bit `bit` (0 = least significant) of the upstream byte at offset `nbytes`.

        Offsets count upstream bytes from now over all connections: `nbytes`
        bytes pass unchanged, the next one has `1 << bit` XORed in, and
        forwarding goes on normally. Returns immediately; re-arming replaces a
        pending corruption. ValueError if `nbytes < 0` or `bit` not in 0..7.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if not 0 <= bit <= 7:
            raise ValueError(f"bit must be in 0..7, got {bit}")
        self._check_open()
        with self._lock:
            self._corrupt_left = nbytes
            self._corrupt_mask = 1 << bit
            self._update_idle()

    def wait_fired(self, timeout: float | None = None) -> bool:
        """Block until no armed fault is waiting to fire; True if so, False after `timeout` seconds.

        A fired reset has been carried out (RSTs sent) when this returns True.
        True at once when nothing is armed.
        """
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, reset every live connection, and join the proxy's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._commands.append((self._stop, threading.Event()))
            self._wake()
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the proxy's thread did not stop within {timeout} s")
        self._wake_w.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy({self.address} -> {self.target}, connections={self.connections})"

    # ------------------------------------------------------------- the loop thread

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the proxy is closed")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or the loop is gone

    def _call(self, fn: Callable[[], None], timeout: float) -> None:
        """Run `fn` on the proxy's thread and wait for it."""
        self._check_open()
        if threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()
        self._commands.append((fn, done))
        self._wake()
        if not done.wait(timeout):
            raise TimeoutError(f"the proxy's thread did not answer within {timeout} s")

    def _update_idle(self) -> None:  # under _lock
        if self._reset_left is None and self._corrupt_left is None and self._reset_due is None:
            self._idle.set()
        else:
            self._idle.clear()

    def _stop(self) -> None:
        self._running = False

    def _loop(self) -> None:
        try:
            while self._running:
                timeout = _DRAIN_POLL if self._reset_due is not None else None
                for key, mask in self._selector.select(timeout):
                    key.data(key.fileobj, mask)
                while self._commands:
                    fn, done = self._commands.popleft()
                    try:
                        fn()
                    finally:
                        done.set()
                if self._reset_due is not None:
                    self._check_reset_due()
        finally:
            self._reset_all(count=False)
            for sock in (self._listener, self._wake_r):
                self._selector.unregister(sock)
                sock.close()
            self._selector.close()
            while self._commands:  # callers waiting on a command that will not run
                self._commands.popleft()[1].set()
            with self._lock:
                self._reset_left = self._corrupt_left = None
                self._reset_due = None
                self._update_idle()

    def _on_wake(self, sock: socket.socket, mask: int) -> None:
        try:
            while sock.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _on_accept(self, listener: socket.socket, mask: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE, ECONNABORTED: try again on the next event
                return
            self.accepted += 1
            client.setblocking(False)
            server = socket.socket(self._target_family, socket.SOCK_STREAM)
            server.setblocking(False)
            for sock in (client, server):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            conn = _Conn(client, server, self._bufsize)
            self._conns[conn] = None
            err = server.connect_ex(self._target_addr)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                self._abort_conn(conn)
                continue
            if err == 0:
                conn.connected = True
            self._update_interest(conn)

    def _handler(self, conn: _Conn) -> Callable[[socket.socket, int], None]:
        def handle(sock: socket.socket, mask: int) -> None:
            if conn.closed:
                return
            if sock is conn.server and not conn.connected:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._abort_conn(conn)
                    return
                conn.connected = True
            else:
                src_pipe = conn.up if sock is conn.client else conn.down
                dst_pipe = conn.down if sock is conn.client else conn.up
                if mask & selectors.EVENT_WRITE:
                    self._flush(conn, dst_pipe)
                if mask & selectors.EVENT_READ and not conn.closed:
                    self._read(conn, src_pipe)
            if not conn.closed:
                self._update_interest(conn)
        return handle

    def _wants_read(self, conn: _Conn, pipe: _Pipe) -> bool:
        return conn.connected and not pipe.eof and pipe.pending == 0 and not (pipe.up and self._reset_due is not None)

    def _update_interest(self, conn: _Conn) -> None:
        want = {
            conn.client: (selectors.EVENT_READ if self._wants_read(conn, conn.up) else 0)
            | (selectors.EVENT_WRITE if conn.down.pending else 0),
            conn.server: (selectors.EVENT_READ if self._wants_read(conn, conn.down) else 0)
            | (selectors.EVENT_WRITE if conn.up.pending or not conn.connected else 0),
        }
        for sock, events in want.items():
            old = conn.events[sock]
            if events == old:
                continue
            if not old:
                self._selector.register(sock, events, self._handler(conn))
            elif not events:
                self._selector.unregister(sock)
            else:
                self._selector.modify(sock, events, self._selector.get_key(sock).data)
            conn.events[sock] = events

    def _read(self, conn: _Conn, pipe: _Pipe) -> None:
        try:
            n = pipe.src.recv_into(pipe.buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort_conn(conn)
            return
        if n == 0:
            pipe.eof = True
            try:
                pipe.dst.shutdown(socket.SHUT_WR)
            except OSError:
                self._abort_conn(conn)
                return
            if conn.up.eof and conn.down.eof:
                self._close_conn(conn)
            return
        pipe.start, pipe.end = 0, n
        if pipe.up:
            pipe.end = self._filter_up(pipe, n)
        self._flush(conn, pipe)

    def _filter_up(self, pipe: _Pipe, n: int) -> int:
        """Apply the armed faults to the `n` upstream bytes just read into `pipe.buf`; how many to forward."""
        with self._lock:
            if self._reset_left is None and self._corrupt_left is None:
                return n
            take = n
            if self._reset_left is not None:
                take = min(n, self._reset_left)
                self._reset_left -= take
                if self._reset_left == 0:
                    self._reset_left = None
                    self._reset_due = pipe
                    self._reset_deadline = time.monotonic() + self._drain_timeout
            if self._corrupt_left is not None:
                if self._corrupt_left < take:
                    pipe.buf[self._corrupt_left] ^= self._corrupt_mask
                    self._corrupt_left = None
                    self.corruptions += 1
                else:
                    self._corrupt_left -= take
            self._update_idle()
        if self._reset_due is pipe:  # stop reading upstream everywhere until the reset
            for conn in list(self._conns):
                self._update_interest(conn)
        return take

    def _flush(self, conn: _Conn, pipe: _Pipe) -> None:
        while pipe.pending:
            try:
                sent = pipe.dst.send(pipe.view[pipe.start:pipe.end])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._abort_conn(conn)
                return
            pipe.start += sent
            if pipe.up:
                self.bytes_up += sent
            else:
                self.bytes_down += sent
        pipe.start = pipe.end = 0

    def _check_reset_due(self) -> None:
        pipe = self._reset_due
        assert pipe is not None
        drained = pipe.dst.fileno() == -1 or (pipe.pending == 0 and _unsent(pipe.dst) == 0)
        if drained or time.monotonic() >= self._reset_deadline:
            self._reset_all()

    def _reset_all(self, count: bool = True) -> int:
        conns = list(self._conns)
        for conn in conns:
            self._abort_conn(conn)
        if count:
            self.resets += 1
        if self._reset_due is not None:
            with self._lock:
                self._reset_due = None
                self._update_idle()
        return len(conns)

    def _release(self, conn: _Conn, close: Callable[[socket.socket], None]) -> None:
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.client, conn.server):
            if conn.events[sock]:
                self._selector.unregister(sock)
                conn.events[sock] = 0
            close(sock)
        self._conns.pop(conn, None)

    def _abort_conn(self, conn: _Conn) -> None:
        self._release(conn, _abort)

    def _close_conn(self, conn: _Conn) -> None:
        self._release(conn, socket.socket.close)
