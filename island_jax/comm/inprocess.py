"""The in-process transport: islands and the coordinator of one process, on threads, with no wire.

`InProcessExchange` is the coordinator's end (the `session.ExchangeSession` that `run_coordinator` serves, as
it serves gRPC on an address); `InProcessTransport` is one island's end, with the calls of
`protocol.Transport`, like the gRPC client. So a notebook or a test runs the same island, codec, merge, outer
step, session and role drivers as a multi-process launch; only the transport differs.

Payloads pass as immutable bytes. Byte counts are those of the frames the gRPC transport would put on the
wire for the same payloads (`wire.contribution_frame_bytes`, `wire.update_frame_bytes`). With an emulated
link, each payload's chunks are booked on it (chunk k on connection k % `connections`) and the call returns
when the last one would have arrived; `seconds_transferring` is that time (0 without a link).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from island_jax.comm import wire
from island_jax.comm.link import LinkEmulator
from island_jax.comm.session import ExchangeSession, RunAborted, log_barrier_wait
from island_jax.protocol import ContributionHeader, SyncStats, UpdateNotReady

if TYPE_CHECKING:
    from island_jax.coordinator import Coordinator


class InProcessExchange(ExchangeSession):
    """The coordinator's end of the in-process transport: the `ExchangeSession` itself, served to the islands'
    threads, with no wire between.

    Islands may call before the coordinator is served (`serve`): their `join` waits for it. Every call into
    the coordinator runs under `lock`.

    Attributes:
      stopped_at: the coordinator's round when it stopped serving (None while it serves).
      where: "in process", for the coordinator's log line.
    """

    def __init__(self):
        super().__init__()
        self.stopped_at: int | None = None
        self.where = "in process"

    def stop(self, grace: float | None = None) -> None:
        """Stops serving: later calls raise at once (`grace` is the gRPC server's; nothing is in flight here)."""
        del grace
        with self.lock:
            if self.coordinator is not None:
                self.stopped_at = self.coordinator.round
            self.coordinator = None
            self.lock.notify_all()

    def served(self, timeout: float) -> Coordinator:
        """The coordinator, waiting up to `timeout` seconds for `serve`; call it holding `lock`.

        Raises:
          RunAborted: the exchange was aborted, or the coordinator already stopped (the run ended).
          TimeoutError: no coordinator was served in time.
        """
        stopped = lambda: self.stopped_at is not None  # noqa: E731
        self.lock.wait_for(lambda: self.coordinator is not None or self.aborted is not None or stopped(), timeout)
        self.check()
        if stopped():
            raise RunAborted(
                f"the coordinator finished the run at round {self.stopped_at} and stopped serving; an island that "
                "was left out of the last rounds has nothing left to fetch"
            )
        if self.coordinator is None:
            raise TimeoutError(
                f"no coordinator was served within {timeout:.0f} s (comm.join_timeout_seconds); "
                "start run_coordinator on this exchange"
            )
        return self.coordinator


class InProcessTransport:
    """One island's end of an `InProcessExchange`, with the calls of `protocol.Transport`.

    Args:
      exchange: the run's `InProcessExchange` (served by `run_coordinator`, or by hand with `serve`).
      link: this island's emulated link (None: none).
      connections: `comm.connections` (how chunks are spread over the link's connections, and how
        many streams the gRPC frames would use).
      timeout: seconds `fetch_update` waits for a merge before raising `UpdateNotReady`
        (`comm.round_timeout_seconds`).
      join_timeout: seconds `join` and `start_together` wait (`comm.join_timeout_seconds`).
      shard: (k, K): the exchange serves coordinator shard k of K; the island sends it only its range's chunks
        (`codec.chunk_ranges`), named by a share bitmap. None: one coordinator.
    """

    def __init__(
        self,
        exchange: InProcessExchange,
        link: LinkEmulator | None = None,
        connections: int = 1,
        timeout: float = 3600.0,
        join_timeout: float = 600.0,
        shard: tuple[int, int] | None = None,
    ):
        self.exchange, self.link, self.connections, self.shard = exchange, link, connections, shard
        self.timeout, self.join_timeout = timeout, join_timeout
        self.pipelined = False  # the update's chunks are booked on the link after the contribution's
        self._stats: dict[tuple[int, int], SyncStats] = {}  # (fragment, round) -> its exchange; under the lock
        self._planned: dict[str, int] = {}

    def _carry(self, direction: str, fragment: int, plan=None) -> float:
        """Books a payload of `fragment` (its chunk `plan`, or the served coordinator's) on the link and sleeps
        until its last chunk arrives; seconds slept."""
        link = self.link
        if link is None:
            return 0.0
        now = link.clock()
        if plan is None:
            with self.exchange.lock:
                plan = self.exchange.served(self.join_timeout).fragments[fragment].plan
        last = max((link.arrival(direction, c.index % self.connections, c.nbytes, now=now) for c in plan), default=now)
        return link.sleep_until(last)

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """The handshake (`Coordinator.join`: {"round", "checksum", "rejoin"}); waits up to
        `join_timeout` s for the coordinator.

        Raises:
          HandshakeError: the coordinator refused. TimeoutError: none was served. RunAborted.
        """
        ex = self.exchange
        with ex.lock:
            return ex.served(self.join_timeout).join(island, dict(config_fingerprint), params_checksum, round)

    def replaying(self, island: str, round: int) -> None:
        """Tells the coordinator the island is replaying `round` (`Coordinator.note_replay`)."""
        ex = self.exchange
        with ex.lock:
            ex.served(self.join_timeout).note_replay(island, round)

    def start_together(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> None:
        """Says the island is ready and waits (up to `join_timeout` s) for every island of the run; after
        that it starts anyway, with a warning, as over gRPC.

        Raises:
          RunAborted: the run was aborted. TimeoutError: no coordinator was served.
        """
        del config_fingerprint, params_checksum, round
        ex = self.exchange
        began = time.monotonic()
        with ex.lock:
            ex.served(self.join_timeout)
            waits = ex.wait_at_barrier(island, self.join_timeout)
        log_barrier_wait(island, waits, time.monotonic() - began, self.join_timeout)

    def contribute(self, header: ContributionHeader, payload) -> str:
        """Hands one encoded pseudo-gradient (bytes or a `codec.ChunkEncoder`) to the coordinator as one attempt
        of the session (`ExchangeSession.contribute`); returns "accepted" (also for a contribution already in)
        or "discarded". Raises what the coordinator raises (ContributionError), WireError for a payload of
        another size than the fragment's, or RunAborted."""
        round, fragment = header.round, header.fragment
        sending = self._carry("up", fragment)
        payload = bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else payload.tobytes()
        ex = self.exchange
        with ex.lock:
            ex.check()
            c = ex.served(self.join_timeout)
            plan, bitmap = self._share(c, fragment)
            n = wire.stream_count(self.connections, plan)
            frames = wire.payload_header(header, ex.layouts[fragment], n, len(payload), wire.new_attempt(), c.incarnation,
                                         share=bitmap)
            sent = wire.contribution_frame_bytes(frames, plan, n)
            try:
                status = ex.contribute(frames, payload, sent)
            finally:
                ex.notify()
            self._stats[(fragment, round)] = SyncStats(bytes_sent=sent, seconds_sending=sending)
            for key in [k for k in self._stats if k[0] == fragment and k[1] < round - 1]:  # keep the last few
                del self._stats[key]
        return "accepted" if status == "duplicate" else status

    def _share(self, c, fragment: int) -> tuple[list, bytes]:
        """The chunks of `fragment`'s plan this island sends the served coordinator, and their share bitmap
        (b"" for all of them: one coordinator process)."""
        plan = c.fragments[fragment].plan
        owned = wire.owned_ranges([plan], self.shard)
        if owned is None:
            return plan, b""
        share = [plan[k] for k in owned[0]]
        return share, wire.share_bitmap(share, plan)

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """The update of `round` of `fragment`: the fragment's `codec` payload (`payload_bytes` of that
        fragment's coordinator) of `view - previous view`; waits up to `timeout` seconds for the merge.

        Raises:
          UpdateNotReady: not merged in time. StaleRoundError: an older round than the latest (fetch the view).
          RunAborted: the exchange was aborted.
        """
        ex = self.exchange
        deadline = time.monotonic() + self.timeout
        with ex.lock:
            while True:
                ex.check()
                c = ex.served(self.join_timeout)
                try:
                    update = bytes(c.fetch_update(round, island, fragment))
                    break
                except UpdateNotReady:
                    if time.monotonic() >= deadline:
                        raise
                    if c.poll():  # a quorum's grace window closes the round only when polled
                        ex.notify()
                    else:
                        ex.lock.wait(timeout=0.5)
            share, bitmap = self._share(c, fragment)
            plan = [c.fragments[fragment].update_plan[k.index] for k in share]
            trailer = ex.update_trailer(fragment, round, island, bitmap=bitmap)
            if trailer.inner_steps:  # the plan travels with the update, as in the gRPC trailer
                self._planned[island] = trailer.inner_steps
            received = wire.update_frame_bytes(trailer, plan, wire.stream_count(self.connections, plan))
            ex.fetched_stream(fragment, round, island, received)
        # the update is the island's once taken: its way down needs no coordinator (which may stop meanwhile,
        # the last round fetched)
        receiving = self._carry("down", fragment, plan)
        with ex.lock:
            stats = self._stats.setdefault((fragment, round), SyncStats())
            stats.bytes_received = received
            stats.seconds_transferring = stats.seconds_sending + receiving
        return update

    def fetch_view(self, island: str, min_round: int = 0, needed=None) -> tuple[list[int], bytes]:
        """(each fragment's round, the island view as a float32 "none" payload) for an island that rejoins or
        fell behind, once every fragment completed `min_round` rounds (waiting up to `timeout` seconds).
        `needed` is not used: an island in process is one process, and gets the whole view.

        Raises:
          RunAborted: the run was aborted or ended. TimeoutError: no coordinator was served, or the round was
            not reached in time.
        """
        ex = self.exchange
        with ex.lock:
            c = ex.served(self.join_timeout)
            if not ex.lock.wait_for(lambda: ex.aborted is not None or c.view_ready(min_round), self.timeout):
                raise TimeoutError(f"the coordinator did not reach round {min_round} within {self.timeout:.0f} s")
            ex.check()
            rounds, payload = c.fetch_view(island)
        return rounds, bytes(payload)

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round as planned by the coordinator when its last update was fetched
        (None: no plan)."""
        return self._planned.get(island)

    def stats(self, round: int, fragment: int = 0) -> SyncStats:
        """The exchange of `round` of `fragment` (after its `fetch_update` returned; empty before)."""
        with self.exchange.lock:
            return self._stats.get((fragment, round), SyncStats())

    def close(self) -> None:
        """Nothing to release: there is no connection."""
