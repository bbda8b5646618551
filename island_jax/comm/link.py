"""An emulated WAN link between one island and the coordinator: bandwidth, one-way latency, per-connection window.

Each direction ("up": island -> coordinator, "down") is a FIFO link serialising `bandwidth_gbps * 1e9 / 8`
bytes/s, shared by the island's connections; data arrives `latency_ms / 1000` s after its last byte is
serialised. Each connection (its own TCP connection) may have at most `window_bytes` unacknowledged (0: no
window), cut into segments of a sixteenth of the window, each acknowledged one round trip after it was
serialised; a connection waiting for its window leaves the link to the others. So one connection is capped
near window / RTT and N connections carry about N times that, up to the bandwidth (`steady_gbps`,
`one_connection_gbps`, `connections_needed`). Times are seconds on the emulator's clock, sizes bytes.
Thread-safe: the bookkeeping runs under a lock and `transfer`'s sleeping outside it. The whole model, and
why it lives here rather than in the kernel: docs/wan.md.
"""

from __future__ import annotations

import bisect
import collections
import math
import operator
import threading
import time
from collections.abc import Callable

DIRECTIONS = ("up", "down")
SEGMENTS_PER_WINDOW = 16  # a window is sent, and acknowledged, in this many segments
_TOLERANCE_S = 1e-9  # seconds: idle stretches of the link shorter than this are no gaps (rounding, see `_place`)


def segment_bytes(window_bytes: int) -> int:
    """Bytes of one segment with a window of `window_bytes` (> 0): a sixteenth of it, at least 1."""
    return max(1, window_bytes // SEGMENTS_PER_WINDOW)


def steady_gbps(bandwidth_gbps: float, rtt_s: float, window_bytes: int, connections: int) -> float:
    """Highest steady rate, Gbit/s, of `connections` connections that always have data, in this model.

    A connection sends one window every RTT + segment / rate seconds (each
    segment is acknowledged one round trip after it is serialised, and the next
    window's segment follows it), so one carries
    `window * 8 / (rtt_s + segment_bytes(window) * 8 / (bandwidth_gbps * 1e9)) / 1e9`
    Gbit/s: about window / RTT. `connections` of them carry that many times as
    much, never more than `bandwidth_gbps`. Without a window (`window_bytes`
    0) or without a round trip the rate is `bandwidth_gbps` (`math.inf` stays
    `math.inf`).

    Args:
      bandwidth_gbps: the link's rate each way, Gbit/s (> 0; may be `math.inf`).
      rtt_s: round trip, seconds (>= 0).
      window_bytes: bytes in flight per connection (0: no window).
      connections: parallel connections (at least 1 counts).
    """
    if window_bytes == 0 or rtt_s == 0:  # no window, or nothing in flight for one to hold back
        return bandwidth_gbps
    bits = window_bytes * 8
    one = bits / (rtt_s + segment_bytes(window_bytes) * 8 / (bandwidth_gbps * 1e9)) / 1e9
    return min(bandwidth_gbps, max(1, connections) * one)


class LinkEmulator:
    """A shared, windowed WAN link in each direction (see the module docstring).

    Args:
      bandwidth_gbps: serialisation rate of each direction, Gbit/s (1e9 bits/s).
      latency_ms: one-way latency, milliseconds (the round trip is twice this).
      window_bytes: bytes in flight per connection, like a TCP window; 0 for no
        window.
      clock: returns the current time in seconds; every time the emulator takes
        or returns is on this clock.
      sleep: sleeps for a number of seconds; used by `transfer`.

    Raises:
      ValueError: bandwidth_gbps is not a finite number > 0, latency_ms is
        negative or not finite, or window_bytes is negative.
    """

    def __init__(
        self,
        bandwidth_gbps: float,
        latency_ms: float = 0.0,
        window_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        bandwidth_gbps = float(bandwidth_gbps)
        latency_ms = float(latency_ms)
        window_bytes = operator.index(window_bytes)
        if not (bandwidth_gbps > 0 and math.isfinite(bandwidth_gbps)):
            raise ValueError(
                f"bandwidth_gbps is {bandwidth_gbps}; use a finite rate > 0 Gbit/s "
                "(with config.comm.link.bandwidth_gbps == 0, from_config returns None: no emulated link)"
            )
        if not (latency_ms >= 0 and math.isfinite(latency_ms)):
            raise ValueError(f"latency_ms is {latency_ms}; use a finite one-way latency >= 0 ms")
        if window_bytes < 0:
            raise ValueError(f"window_bytes is {window_bytes}; use 0 (no window) or a window > 0 bytes")
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_ms = latency_ms
        self.window_bytes = window_bytes
        self.bytes_per_second = bandwidth_gbps * 1e9 / 8
        self.latency_s = latency_ms / 1000.0
        self.rtt_s = 2.0 * self.latency_s
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._origin: float | None = None  # clock time of the first call; the books count seconds from it
        # Per direction: the clock time at which the link finishes serialising every byte reserved so far; its busy
        # stretches as [start, end] in order (those over before a call's `now` are dropped); and no segment
        # starts before `_floor`, the end of the latest stretch dropped.
        self._link_free = dict.fromkeys(DIRECTIONS, -math.inf)
        self._busy: dict[str, list[list[float]]] = {d: [] for d in DIRECTIONS}
        self._floor = dict.fromkeys(DIRECTIONS, -math.inf)
        # Per (direction, connection): when its latest segment is serialised (a connection sends in order).
        self._sent: dict[tuple[str, int], float] = {}
        # Per (direction, connection): unacknowledged segments as (ack time s, bytes), oldest first, and their total.
        self._unacked: dict[tuple[str, int], collections.deque[tuple[float, int]]] = {}
        self._in_flight: dict[tuple[str, int], int] = {}

    @classmethod
    def from_config(
        cls,
        config,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> LinkEmulator | None:
        """The emulator described by `config.comm.link`, or None when it emulates nothing.

        Args:
          config: a run's ConfigDict (island_jax/config/schema.py); reads
            `comm.link.bandwidth_gbps` (Gbit/s), `comm.link.latency_ms` (ms,
            one way) and `comm.link.window_bytes` (bytes).
          clock, sleep: as for the constructor.

        Returns:
          None when `config.comm.link.bandwidth_gbps == 0`, else a `LinkEmulator`.

        Raises:
          ValueError: as the constructor, e.g. for a negative bandwidth.
        """
        link = config.comm.link
        if link.bandwidth_gbps == 0:
            return None
        return cls(link.bandwidth_gbps, link.latency_ms, link.window_bytes, clock=clock, sleep=sleep)

    def arrival(self, direction: str, connection: int, nbytes: int, now: float | None = None) -> float:
        """Reserves the link for `nbytes` and returns when their last byte arrives.

        Args:
          direction: "up" (island -> coordinator) or "down" (coordinator -> island).
          connection: index >= 0 of the connection (gRPC channel) that carries the
            bytes; the window applies per connection.
          nbytes: bytes to send, >= 0.
          now: clock time, seconds, at which the bytes are ready to send;
            defaults to `clock()`.

        Returns:
          The clock time, seconds, at which the last of the bytes arrives at the
          far end. The link time and the connection's window are reserved, so a
          later call queues behind this one.

        Raises:
          ValueError: unknown direction, negative connection or negative nbytes.
        """
        self._check(direction, connection, nbytes)
        connection = operator.index(connection)
        nbytes = operator.index(nbytes)
        with self._lock:
            if now is None:
                now = self.clock()
            if self._origin is None:
                self._origin = float(now)
            now = float(now) - self._origin  # the books keep times since the first call, so they stay exact
            if nbytes == 0:
                # Nothing to serialise, but it still follows every byte reserved before it on the link.
                return max(now, self._link_free[direction]) + self.latency_s + self._origin
            end = now
            remaining = nbytes
            step = segment_bytes(self.window_bytes) if self.window_bytes else nbytes
            while remaining > 0:
                segment = min(remaining, step)
                end = self._reserve(direction, connection, segment, now)
                remaining -= segment
            return end + self.latency_s + self._origin

    def sleep_until(self, t: float) -> float:
        """Sleeps until clock time `t` (seconds; at once if it has passed), e.g. an `arrival`; returns the
        seconds slept. A sender that waits for each chunk's arrival before the next sends at most one chunk
        per (chunk time + one-way latency) on its connection."""
        wait = max(0.0, t - self.clock())
        self.sleep(wait)
        return wait

    def one_connection_gbps(self) -> float:
        """Highest steady rate of one connection, Gbit/s: `steady_gbps` with one connection, about window /
        RTT when the window is much smaller than the bandwidth-delay product; `math.inf` without a window."""
        return math.inf if self.window_bytes == 0 else steady_gbps(self.bandwidth_gbps, self.rtt_s, self.window_bytes, 1)

    def rate_gbps(self, connections: int) -> float:
        """Highest steady rate of `connections` connections streaming at once, Gbit/s (`steady_gbps`)."""
        return steady_gbps(self.bandwidth_gbps, self.rtt_s, self.window_bytes, connections)

    def connections_needed(self) -> int:
        """Fewest connections that, all streaming, keep the link busy; 1 without a window.

        Equals ceil(bandwidth-delay product / window + 1/16) in this model (a
        window takes one RTT and one segment's serialisation); 1 without a
        window or without latency.
        """
        if self.window_bytes == 0:
            return 1
        ratio = self.bandwidth_gbps / self.one_connection_gbps()
        return max(1, math.ceil(ratio - 1e-9))

    def _check(self, direction: str, connection: int, nbytes: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(
                f"direction is {direction!r}; use 'up' (island -> coordinator) or 'down' (coordinator -> island)"
            )
        if operator.index(connection) < 0:
            raise ValueError(f"connection is {connection}; use a connection index >= 0")
        if operator.index(nbytes) < 0:
            raise ValueError(f"nbytes is {nbytes}; use a size >= 0 bytes")

    def _place(self, direction: str, ready: float, duration: float, now: float) -> float:
        """Marks the first idle stretch of the link at or after `ready` that holds `duration` seconds busy; returns
        its start. Called with the lock held."""
        busy = self._busy[direction]
        while busy and busy[0][1] <= now:  # over before this call: no later segment may start in them
            self._floor[direction] = max(self._floor[direction], busy.pop(0)[1])
        start = max(ready, self._floor[direction])
        # Times are sums of durations: a segment that fits a gap exactly may miss it by a few units in the last
        # place (they grow with the time's value, hence the books' origin). Gaps within `tol` count as closed.
        tol = min(max(_TOLERANCE_S, 16 * math.ulp(start)), duration / 2)  # never a whole segment's length
        i = bisect.bisect_right([stretch[1] for stretch in busy], start)  # the first stretch still busy then
        while i < len(busy) and busy[i][0] - start < duration - tol:
            start = max(start, busy[i][1])
            i += 1
        end = start + duration
        if i > 0 and busy[i - 1][1] >= start - tol:  # joins the stretch before
            busy[i - 1][1] = end
        else:
            busy.insert(i, [start, end])
            i += 1
        if i < len(busy) and busy[i][0] <= end + tol:  # and the one after
            busy[i - 1][1] = busy.pop(i)[1]
        return start

    def _reserve(self, direction: str, connection: int, segment: int, now: float) -> float:
        """Books one segment (bytes <= window) on the link; returns when its last byte is serialised.

        Called with the lock held.
        """
        key = (direction, connection)
        start = max(now, self._sent.get(key, -math.inf))
        if self.window_bytes:
            unacked = self._unacked.setdefault(key, collections.deque())
            in_flight = self._in_flight.get(key, 0)
            # Wait for the oldest segments' acknowledgements until this one fits. Acknowledgements on one
            # connection come in send order, and every later segment starts after this one, so the ones
            # popped here are acknowledged for good.
            while unacked and in_flight + segment > self.window_bytes:
                ack, size = unacked.popleft()
                start = max(start, ack)
                in_flight -= size
        duration = segment / self.bytes_per_second
        start = self._place(direction, start, duration, now)
        if self.window_bytes:
            # Forget what is already acknowledged when this segment starts.
            while unacked and unacked[0][0] <= start:
                in_flight -= unacked.popleft()[1]
        end = start + duration
        self._sent[key] = end
        self._link_free[direction] = max(self._link_free[direction], end)
        if self.window_bytes:
            unacked.append((end + self.rtt_s, segment))
            self._in_flight[key] = in_flight + segment
        return end
