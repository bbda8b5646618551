"""The emulated WAN link: serialisation, latency, per-connection windows, sharing and errors."""

import math
import threading
import time

import pytest

from island_jax.comm.link import LinkEmulator
from island_jax.config import default_config
from island_jax.coordinator import ContributionHeader

MIB = 1 << 20


class FakeClock:
    """A clock that only moves when `sleep` is called; records every sleep."""

    def __init__(self, t: float = 0.0):
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def _link(bandwidth_gbps, latency_ms=0.0, window_bytes=0, start=0.0):
    clock = FakeClock(start)
    return LinkEmulator(bandwidth_gbps, latency_ms, window_bytes, clock=clock, sleep=clock.sleep), clock


def test_no_window_is_latency_plus_serialisation():
    link, _ = _link(0.1, latency_ms=50)  # 100 Mbit/s
    nbytes = 8 * MIB
    t = link.arrival("up", 0, nbytes, now=0.0)
    assert t == pytest.approx(0.05 + 0.671089, rel=0.01)
    assert t == pytest.approx(0.05 + nbytes * 8 / 1e8, rel=1e-9)


def test_request_after_idle_link_starts_at_now():
    link, _ = _link(1.0, latency_ms=10)
    link.arrival("up", 0, MIB, now=0.0)
    t = link.arrival("up", 1, MIB, now=5.0)
    assert t == pytest.approx(5.0 + MIB * 8 / 1e9 + 0.01, rel=1e-12)


def test_zero_bytes_follow_queued_bytes():
    link, _ = _link(1.0, latency_ms=10)
    first = link.arrival("up", 0, MIB, now=0.0)
    assert link.arrival("up", 3, 0, now=0.0) == pytest.approx(first, rel=1e-12)
    assert link.arrival("up", 3, 0, now=0.0) == pytest.approx(first, rel=1e-12)  # reserved nothing


def _stream(link, chunks, connections, chunk_bytes=MIB):
    """Arrival times of `chunks` chunks requested at time 0, round-robin over `connections` connections."""
    return [link.arrival("up", i % connections, chunk_bytes, now=0.0) for i in range(chunks)]


def test_one_connection_is_capped_by_window_over_rtt():
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)  # 100 ms RTT
    serialise = MIB * 8 / 1e10
    period = 0.1 + serialise / 16  # one window per RTT plus one segment's serialisation (a sixteenth of it)
    arrivals = _stream(link, 64, 1)
    # Chunk k starts when chunk k-1 is acknowledged.
    for k, t in enumerate(arrivals):
        assert t == pytest.approx(k * period + serialise + 0.05, rel=1e-9)
    steady_bps = 63 * MIB * 8 / (arrivals[-1] - arrivals[0])
    assert steady_bps == pytest.approx(MIB * 8 / period, rel=1e-9)
    assert steady_bps == pytest.approx(MIB * 8 / (0.1 + MIB / 16 * 8 / 1e10), rel=0.01)
    assert steady_bps == pytest.approx(84e6, rel=0.02)
    overall_bps = 64 * MIB * 8 / (arrivals[-1] - 0.0)  # including the first chunk's latency
    assert overall_bps == pytest.approx(84e6, rel=0.02)
    assert link.one_connection_gbps() * 1e9 == pytest.approx(MIB * 8 / period, rel=1e-12)


def test_four_connections_carry_four_times_as_much():
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)
    serialise = MIB * 8 / 1e10
    period = 0.1 + serialise / 16
    arrivals = _stream(link, 64, 4)
    # Chunk k on connection k % 4 waits for chunk k-4 on the same connection to be acknowledged.
    for k in range(4, 64):
        assert arrivals[k] - arrivals[k - 4] == pytest.approx(period, rel=1e-9)
    steady_bps = 60 * MIB * 8 / (arrivals[-1] - arrivals[3])
    assert steady_bps == pytest.approx(4 * MIB * 8 / period, rel=1e-9)
    assert steady_bps == pytest.approx(4 * 83.9e6, rel=0.02)
    assert steady_bps / 1e6 == pytest.approx(335, rel=0.02)


def test_enough_connections_fill_the_link():
    # 1 Gbit/s, 10 ms RTT: the bandwidth-delay product is 1.25 MB, 10 windows of 125 kB, plus one.
    link, _ = _link(1.0, latency_ms=5, window_bytes=125_000)
    assert link.connections_needed() == 11
    arrivals = _stream(link, 220, 11, chunk_bytes=125_000)
    serialise = 125_000 * 8 / 1e9
    # The link never idles: every chunk arrives one serialisation time after the previous one.
    for k in range(1, 220):
        assert arrivals[k] - arrivals[k - 1] == pytest.approx(serialise, rel=1e-6)
    # Ten connections fall just short: each carries one window per RTT + one segment (7,812 bytes), 99.4 Mbit/s.
    fewer, _ = _link(1.0, latency_ms=5, window_bytes=125_000)
    arrivals = _stream(fewer, 200, 10, chunk_bytes=125_000)
    carried = 199 * 125_000 * 8 / (arrivals[-1] - arrivals[0])
    assert carried == pytest.approx(10 * 125_000 * 8 / (0.01 + 7_812 * 8 / 1e9), rel=1e-3) and carried < 1e9


def test_transfer_larger_than_window_is_cut_into_segments():
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)
    serialise = MIB * 8 / 1e10
    t = link.arrival("down", 2, 4 * MIB, now=1.0)
    assert t == pytest.approx(1.0 + 3 * (0.1 + serialise / 16) + serialise + 0.05, rel=1e-12)
    assert link._in_flight[("down", 2)] == MIB  # only the last window's 16 unacknowledged segments are kept
    assert len(link._unacked[("down", 2)]) == 16


def test_history_stays_bounded():
    link, _ = _link(10.0, latency_ms=50, window_bytes=4 * MIB)
    for _ in range(1000):
        link.arrival("up", 0, 256 * 1024, now=0.0)
    assert link._in_flight[("up", 0)] <= 4 * MIB
    assert len(link._unacked[("up", 0)]) <= 16


def test_windows_are_per_connection():
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)
    serialise = MIB * 8 / 1e10
    link.arrival("up", 0, MIB, now=0.0)
    # Connection 0's window is full until its first segment is acknowledged, connection 1's is not.
    assert link.arrival("up", 1, MIB, now=0.0) == pytest.approx(2 * serialise + 0.05, rel=1e-12)
    assert link.arrival("up", 0, MIB, now=0.0) == pytest.approx(0.1 + serialise / 16 + serialise + 0.05, rel=1e-12)


def test_directions_are_independent():
    link, _ = _link(1.0, latency_ms=20, window_bytes=MIB)
    up = link.arrival("up", 0, 64 * MIB, now=0.0)
    down = link.arrival("down", 0, MIB, now=0.0)
    assert down == pytest.approx(MIB * 8 / 1e9 + 0.02, rel=1e-12)
    assert up > 1.0
    # ... and so are their windows: connection 0 "down" sent one window, "up" is still waiting.
    assert link.arrival("down", 0, MIB, now=0.0) == pytest.approx(0.04 + 17 / 16 * MIB * 8 / 1e9 + 0.02, rel=1e-12)


def test_connections_share_the_link():
    link, _ = _link(1.0, latency_ms=10)
    first = link.arrival("up", 0, MIB, now=0.0)
    second = link.arrival("up", 1, MIB, now=0.0)
    assert first == pytest.approx(MIB * 8 / 1e9 + 0.01, rel=1e-12)
    assert second == pytest.approx(2 * MIB * 8 / 1e9 + 0.01, rel=1e-12)


def test_concurrent_callers_lose_no_reservation():
    link, _ = _link(1.0, latency_ms=10)

    def send(connection):
        for _ in range(200):
            link.arrival("up", connection, 1000, now=0.0)

    threads = [threading.Thread(target=send, args=(c,)) for c in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert link.arrival("up", 0, 0, now=0.0) == pytest.approx(8 * 200 * 1000 * 8 / 1e9 + 0.01, rel=1e-9)


def test_sleep_until_arrival():
    link, clock = _link(1.0, latency_ms=25, start=100.0)
    t = link.arrival("up", 0, MIB)
    assert link.sleep_until(t) == pytest.approx(t - 100.0, rel=1e-12)
    expected = 100.0 + MIB * 8 / 1e9 + 0.025
    assert t == pytest.approx(expected, rel=1e-12)
    assert len(clock.sleeps) == 1
    assert clock.sleeps[0] == pytest.approx(expected - 100.0, rel=1e-12)
    assert clock() == pytest.approx(t, rel=1e-12)
    # An arrival time that has already passed does not sleep backwards.
    clock.t = 200.0
    t = link.arrival("up", 0, 0, now=150.0)
    assert t == pytest.approx(150.025, rel=1e-12)
    assert link.sleep_until(t) == 0.0 and clock.sleeps[-1] == 0.0


def test_sleep_until_on_the_real_clock():
    link = LinkEmulator(100.0, latency_ms=5)
    start = time.monotonic()
    t = link.arrival("down", 0, 1000)
    link.sleep_until(t)
    assert time.monotonic() >= t >= start + 0.005


def test_from_config():
    config = default_config()
    assert config.comm.link.bandwidth_gbps == 0
    assert LinkEmulator.from_config(config) is None
    config.comm.link.bandwidth_gbps = 1.0
    config.comm.link.latency_ms = 30.0
    config.comm.link.window_bytes = 2 * MIB
    clock = FakeClock()
    link = LinkEmulator.from_config(config, clock=clock, sleep=clock.sleep)
    assert isinstance(link, LinkEmulator)
    assert (link.bandwidth_gbps, link.latency_ms, link.window_bytes) == (1.0, 30.0, 2 * MIB)
    assert link.clock is clock
    link.sleep_until(link.arrival("up", 0, 1000))
    assert clock.sleeps == [pytest.approx(1000 * 8 / 1e9 + 0.03, rel=1e-12)]


def test_connection_figures():
    no_window, _ = _link(10.0, latency_ms=50)
    assert no_window.one_connection_gbps() == math.inf
    assert no_window.connections_needed() == 1
    no_latency, _ = _link(10.0, window_bytes=MIB)
    assert no_latency.one_connection_gbps() == pytest.approx(10.0, rel=1e-12)
    assert no_latency.connections_needed() == 1
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)
    assert link.one_connection_gbps() == pytest.approx(MIB * 8 / (0.1 + MIB / 16 * 8 / 1e10) / 1e9, rel=1e-12)
    assert link.one_connection_gbps() == pytest.approx(0.0839, rel=0.01)
    assert link.connections_needed() == math.ceil(1e10 * 0.1 / (MIB * 8) + 1 / 16) == 120


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bandwidth_gbps": 0.0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": -1.0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": math.inf}, "bandwidth_gbps"),
        ({"bandwidth_gbps": 1.0, "latency_ms": -1.0}, "latency_ms"),
        ({"bandwidth_gbps": 1.0, "window_bytes": -1}, "window_bytes"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinkEmulator(**kwargs)


def test_call_errors():
    link, _ = _link(1.0)
    with pytest.raises(ValueError, match="direction is 'sideways'; use 'up'"):
        link.arrival("sideways", 0, 10)
    with pytest.raises(ValueError, match="connection is -1"):
        link.arrival("up", -1, 10)
    with pytest.raises(ValueError, match="nbytes is -5"):
        link.arrival("down", 0, -5)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        config = default_config()
        config.comm.link.bandwidth_gbps = -1.0
        LinkEmulator.from_config(config)


def test_the_in_process_transport_carries_payloads_over_the_emulated_link():
    import numpy as np

    from island_jax.comm.inprocess import InProcessExchange, InProcessTransport
    from island_jax.config import default_config, fingerprint_fields, island
    from island_jax.coordinator import Coordinator
    from island_jax.outer import codec

    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    params = {"w": np.zeros(250_000, np.float32)}  # 1,000,000 bytes per payload
    clock = FakeClock()
    link = LinkEmulator(0.1, latency_ms=50.0, clock=clock, sleep=clock.sleep)
    coordinator = Coordinator(c, params, ["a"])
    transport = InProcessTransport(InProcessExchange().serve(coordinator), link, connections=4)
    transport.join("a", fingerprint_fields(c), coordinator.checksum)
    transport.contribute(ContributionHeader(0, "a", 10), codec.encode(params, "none", 256))
    assert clock.t == pytest.approx(0.05 + 1_000_000 * 8 / 1e8, rel=1e-9)  # 1 MB at 100 Mbit/s, 50 ms one way
    transport.fetch_update(0, "a")
    assert clock.t == pytest.approx(2 * (0.05 + 1_000_000 * 8 / 1e8), rel=1e-9)


def test_an_update_taken_before_the_coordinator_stops_still_arrives_over_the_link():
    """The coordinator stops serving once every island took the last update; an island whose update is still on
    its way down the emulated link receives it (it once raised RunAborted when the stop came first)."""
    import numpy as np

    from island_jax.comm.inprocess import InProcessExchange, InProcessTransport
    from island_jax.config import default_config, fingerprint_fields, island
    from island_jax.coordinator import Coordinator
    from island_jax.outer import codec

    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    params = {"w": np.zeros(1000, np.float32)}
    clock = FakeClock()
    link = LinkEmulator(0.1, latency_ms=50.0, clock=clock, sleep=clock.sleep)
    coordinator = Coordinator(c, params, ["a"])
    exchange = InProcessExchange().serve(coordinator)
    transport = InProcessTransport(exchange, link, connections=1)
    transport.join("a", fingerprint_fields(c), coordinator.checksum)
    pseudo_gradient = {"w": np.full(1000, 0.5, np.float32)}
    transport.contribute(ContributionHeader(0, "a", 10), codec.encode(pseudo_gradient, "none", 256))
    notify = exchange.notify

    def stop_once_taken():  # as run_coordinator does, woken by the island's fetch
        notify()
        if exchange.fetched.get((0, 0)) == {"a"}:
            exchange.stop()

    exchange.notify = stop_once_taken
    update = transport.fetch_update(0, "a")
    assert exchange.stopped_at == 1
    assert update == codec.encode({"w": np.full(1000, -0.5, np.float32)}, "none", 256)


def test_a_connection_waiting_for_its_window_leaves_the_link_to_the_others():
    # Connection 0 offers two windows; its second waits for acknowledgements until about 0.1 s. Connection 1's
    # window, offered after it, takes the idle link at once rather than queueing behind it.
    link, _ = _link(10.0, latency_ms=50, window_bytes=MIB)
    serialise = MIB * 8 / 1e10
    assert link.arrival("up", 0, 2 * MIB, now=0.0) == pytest.approx(0.1 + serialise / 16 + serialise + 0.05, rel=1e-12)
    assert link.arrival("up", 1, MIB, now=0.0) == pytest.approx(2 * serialise + 0.05, rel=1e-12)


@pytest.mark.parametrize("start", [1470.070485707, 1e6, 1e9])
def test_the_booking_does_not_depend_on_what_the_clock_reads(start):
    # 256 framed chunks of 1 MiB on 16 connections at 5 Gbit/s (benchmarks/transport.py's emulated transfer). A
    # segment that fits an idle stretch exactly must take it whatever the clock reads: on a clock of minutes or
    # years of uptime, rounding once lost stretches and left 0.885 of the link's rate instead of 0.937.
    arrivals = {}
    for t0 in (0.0, start):
        link, _ = _link(5.0, latency_ms=50, window_bytes=4 * MIB, start=t0)
        arrivals[t0] = [link.arrival("up", p % 16, MIB + 17, now=t0) - t0 for p in range(256)]
    assert arrivals[start] == pytest.approx(arrivals[0.0], abs=1e-6)
    assert 256 * MIB * 8 / (max(arrivals[start]) - 0.05) / 5e9 == pytest.approx(0.937148, abs=1e-6)


def test_a_segment_shorter_than_the_tolerance_still_waits_for_the_link():
    # At 100 Gbit/s 10 bytes take 0.8 ns, less than the nanosecond within which gaps count as closed: they still
    # queue behind the 10 MB booked before them at the same moment, as any segment does.
    link, _ = _link(100.0, window_bytes=0, start=1000.0)
    first = link.arrival("up", 0, 10_000_000, now=1000.0)
    assert link.arrival("up", 1, 10, now=1000.0) == pytest.approx(first + 10 * 8 / 1e11, abs=1e-12)
