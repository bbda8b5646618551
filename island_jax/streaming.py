"""Streaming DiLoCo for one island: fragments exchanged on background threads while inner steps run.

Douillard et al., "Streaming DiLoCo with overlapping communication" (arXiv
2501.18512), Algorithm 1 with its overlap (Section 2.3):

  * The parameters are split into F fragments (`outer/fragments.py`). Under
    `outer.sync = "steps"` fragment p is contributed after inner step
    o_p = (p + 1) x H // F of every round; under `"time"` once (p + 1) / F of
    the round's `outer.round_seconds` has passed. A contribution is the
    fragment's pseudo-gradient, anchor - params, with the tokens trained
    since its last one.
  * The exchange (encode, send, wait for the merge, receive, decode) runs on a
    background thread while the jitted inner steps go on. The update is
    applied at the end of inner step t + tau (tau = `outer.overlap_steps`): the
    fragment's anchor becomes the global value and its parameters
    alpha x local + (1 - alpha) x global (alpha = `outer.mix_alpha`). With
    tau = 0 the island waits for the update at once and takes the global
    values exactly; with F = 1 as well this is DiLoCo (arXiv 2311.08105), by
    the same code.
  * tau = "auto" is ceil(exchange seconds / step seconds) + 1 (clipped below a
    fragment's next contribution): before the first exchange from the emulated
    link (bytes both ways at its rate, plus a round trip), then from the
    slowest of the last F measured exchanges, so the exchange hides behind
    compute.

Every second of the island is accounted for per round: compute (inner steps,
simulated-speed sleep included), blocked (waiting for an update that is due),
idle (the rest: the exchange's bookkeeping on the training thread, logging),
and, between rounds, evaluation and checkpoint saves (`between_rounds`), which
the run schedules whatever the exchange does. Compute utilization is inner
steps x the median step time measured with no exchange in flight (none of
the island's exchanges running when the step started; an update that has
arrived and waits for its due step takes no CPU and does not count), over the
round's wall seconds (compute + blocked + idle; evaluation and saves are
reported beside it, not in it). `EventLog` keeps the spans for
`plots.plot_timeline`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import threading
import time
from concurrent import futures
from typing import Any

import numpy as np
from absl import logging

from island_jax.coordinator import StaleRoundError
from island_jax.outer import fragments as fragments_lib

# What `StreamingSync.run_round` adds to a round's result, as the roles log it.
ACCOUNTING_FIELDS = (
    "compute_seconds", "seconds_blocked", "idle_seconds", "wall_seconds", "clean_step_seconds", "ideal_compute_seconds",
    "compute_utilization", "overlap_steps", "waits", "exchanges", "bytes_sent", "bytes_received", "payload_bytes",
    "seconds_transferring", "exchange_seconds", "codec_relative_error", "eval_seconds", "checkpoint_seconds",
)
BETWEEN_ROUNDS = ("eval", "checkpoint")  # work between rounds that is not training: `StreamingSync.between_rounds`
CLEAN_HORIZON = 128  # inner steps: older steps with no exchange in flight no longer describe the step time


class EventLog:
    """Spans of what an island did (wall clock, `time.time()` seconds), as JSON lines.

    Kinds: "compute" (inner steps; consecutive steps merge into one span),
    "send" (a contribution leaving), "receive" (waiting for, receiving and
    decoding its update), "wait" (training stopped for a due update), "eval"
    and "checkpoint" (between rounds).

    Args:
      path: a JSON-lines file to append to (None: kept in memory only).
      island: the island's name, written into every event.
    """

    def __init__(self, path: str | None = None, island: str = ""):
        self.path, self.island = path, island
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._compute: dict | None = None  # the compute span being extended
        self._file = open(path, "a", encoding="utf-8") if path else None

    def add(self, kind: str, start: float, end: float, **fields: Any) -> None:
        """Records a span [start, end] (seconds since the epoch) of `kind`, with extra fields (round, fragment)."""
        event = dict(island=self.island, kind=kind, start=float(start), end=float(end), **fields)
        with self._lock:
            if kind == "compute":
                if self._compute is not None and start - self._compute["end"] < 2e-3:
                    self._compute["end"] = float(end)
                    return
                self._write(self._compute)
                self._compute = event
                return
            self._write(event)

    def _write(self, event: dict | None) -> None:
        if event is None:
            return
        self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")

    def flush(self) -> None:
        """Writes the open compute span and flushes the file."""
        with self._lock:
            self._write(self._compute)
            self._compute = None
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclasses.dataclass
class _Flight:
    """One fragment's exchange in flight."""

    fragment: int
    round: int
    due_step: int  # apply at the end of this inner step (island.step, counted over the run)
    tau: int
    future: futures.Future


def _median(values) -> float:
    return float(np.median(np.asarray(list(values), np.float64))) if len(values) else 0.0


class StreamingSync:
    """Drives one island's rounds with fragments, overlap and accounting (see the module docstring).

    Args:
      island: an `island.Island` (or an object with its fragment methods:
        `name`, `step`, `inner_steps`, `tokens_per_step`, `partition`,
        `fragment_plans`, `train_round(after_step=...)`,
        `fragment_pseudo_gradient`, `encode_fragment`, `fragment_checksum`,
        `decode_fragment`, `apply_fragment(fragment, leaves, mix_alpha, placed)`, `set_inner_steps`,
        `load_view`).
      transport: the island's `Transport` (in process or gRPC; a link emulator under it).
      config: the run's config (`outer.fragments`, `overlap_steps`, `mix_alpha`,
        `sync`, `round_seconds`, `rounds`; `comm.connections`).
      first_round: the round the island trains next (0, or a resumed checkpoint's).
      link: the island's emulated link, for tau = "auto" before the first exchange.
      events: where spans go (default: an in-memory `EventLog`).

    Raises (from `run_round`, `drain`): the exchange's errors (ContributionError,
    ExchangeError, CodecError), on the training thread when the update is applied.
    """

    def __init__(self, island, transport, config, first_round: int = 0, link=None, events: EventLog | None = None):
        o = config.outer
        self.island, self.transport, self.config, self.link = island, transport, config, link
        self.num_fragments = len(island.partition)
        self.alpha = float(o.mix_alpha)
        self.auto = o.overlap_steps == "auto"
        self.tau = 0 if self.auto else int(o.overlap_steps)
        self.budget = float(o.round_seconds) if o.sync == "time" else None
        self.total_rounds = int(o.rounds)
        self.connections = int(config.comm.connections)
        self.events = events if events is not None else EventLog(island=island.name)
        self.next_round = [first_round] * self.num_fragments  # per fragment: the round of its next contribution
        self._steps_at_contribution = [island.step] * self.num_fragments
        self.inflight: dict[int, _Flight] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=self.num_fragments, thread_name_prefix="fragment-exchange")
        # (island step, seconds) of recent steps with no exchange in flight, and seconds of the last
        # steps (compiling steps left out): the step time follows what else runs on the machine, so
        # only recent steps describe a round.
        self.clean_steps: collections.deque = collections.deque(maxlen=32)
        self.recent_steps: collections.deque = collections.deque(maxlen=32)
        self.exchange_seconds: collections.deque = collections.deque(maxlen=self.num_fragments)
        self.rejoined_round: int | None = None  # set when a stale round made the island rejoin from the view
        self._planned: int | None = None
        self._exchange_running = False  # an exchange was running when the step now running started
        self._round = first_round
        self._first_round = first_round
        self._epoch: tuple[float, int] | None = None  # (perf_counter, round): when a drain realigned the islands
        self._round_start = 0.0
        self._last_end: float | None = None
        self._contributed: set[int] = set()
        self._last_tau = self.tau
        self._between = dict.fromkeys(BETWEEN_ROUNDS, 0.0)  # seconds since the last round ended
        self._reset_round()

    def _reset_round(self) -> None:
        self._blocked = 0.0
        self._waits = 0
        self._finished: list[dict] = []

    # -- the schedule ----------------------------------------------------------------------------------

    def clean_step_seconds(self) -> float:
        """Median inner-step time (seconds, sleep included) of the last 32 steps run with no exchange in
        flight, among the last `CLEAN_HORIZON` steps; when fewer than 8 of those ran with nothing in flight
        (an island whose exchanges always overlap), the median of its last 32 steps."""
        recent = [sec for step, sec in self.clean_steps if step > self.island.step - CLEAN_HORIZON]
        return _median(recent) if len(recent) >= 8 else _median(self.recent_steps)

    def current_tau(self, fragment: int) -> int:
        """tau for a contribution of `fragment` now: `outer.overlap_steps`, or the "auto" choice."""
        if not self.auto:
            return self.tau
        step = self.clean_step_seconds()
        if self.budget is None:
            cap = self.island.inner_steps - 1
        else:
            cap = int(self.budget / step) - 1 if step > 0 else 1
        if self.exchange_seconds:
            exchange = max(self.exchange_seconds)
        else:
            exchange = self._link_estimate(fragment)
        return fragments_lib.auto_overlap_steps(exchange, step, max(cap, 1))

    def _link_estimate(self, fragment: int) -> float:
        """Seconds to move the fragment's payload up and the update down over the emulated link (0: none)."""
        link = self.link
        if link is None:
            return 0.0
        nbytes = sum(c.nbytes for c in self.island.fragment_plans[fragment])
        rate = min(link.bandwidth_gbps, max(1, self.connections) * link.one_connection_gbps()) * 1e9
        return 2 * (link.latency_ms / 1e3 + nbytes * 8 / rate)

    # -- one round -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def between_rounds(self, kind: str):
        """Times work done between rounds that is not training: `kind` "eval" (an evaluation) or
        "checkpoint" (a save). Its seconds are reported as the next round's `eval_seconds` or
        `checkpoint_seconds`, left out of that round's `wall_seconds` (and so of its compute utilization,
        which measures training against the exchange), and drawn as a span of `kind` in the events.

        Raises:
          ValueError: `kind` is not one of `BETWEEN_ROUNDS`.
        """
        if kind not in self._between:
            raise ValueError(f"between_rounds kind {kind!r} is unknown; use one of {BETWEEN_ROUNDS}")
        start, wall_start = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self._between[kind] += time.perf_counter() - start
            self.events.add(kind, wall_start, time.time(), round=self._round + 1)

    def run_round(self, round: int, drain: bool = False) -> dict:
        """Trains round `round` (0-based): its inner steps, with the fragments contributed and applied as due.

        Args:
          round: the round being trained.
          drain: wait for and apply every update in flight at the end (before a
            checkpoint, and after the last round).

        Under `outer.sync = "time"` the first round of a process always drains:
        every island leaves it when the same last update arrives, and round r
        after a drain ends at the drain's end + (r - drained round) x
        `round_seconds`, so the islands contribute each fragment at the same
        moment whatever their step times (a step that runs over shortens the
        next round).

        Returns:
          `island.train_round`'s result, plus `compute_seconds` (steps, sleep
          included), `seconds_blocked`, `wall_seconds` (since the previous
          round ended, less `eval_seconds` and `checkpoint_seconds`: the work
          timed by `between_rounds` since then), `idle_seconds` (wall -
          compute - blocked), `clean_step_seconds` (median of the last 32 steps
          run with no exchange in flight), `ideal_compute_seconds` (steps x
          that), `compute_utilization` (ideal compute / wall),
          `overlap_steps` (tau of the last contribution), `waits` (updates the
          island stopped for), and over the exchanges applied this round:
          `exchanges`, `bytes_sent`, `bytes_received`, `payload_bytes`,
          `seconds_transferring`, `exchange_seconds` (mean), `codec_relative_error` (mean).
        """
        # Wall time runs from the end of the previous round: what the caller did in between is this
        # round's idle time, except evaluation and checkpoint saves timed by `between_rounds`.
        start = self._last_end if self._last_end is not None else time.perf_counter()
        if self._planned and self._planned != self.island.inner_steps:  # outer.auto_from = measured
            logging.info("island %s: %d inner steps per round from round %d on", self.island.name, self._planned, round + 1)
            self.island.set_inner_steps(self._planned, self.total_rounds - round)
            if hasattr(self.island, "warm_up"):
                self.island.warm_up()  # the rebuilt step compiles here, not in a timed step
        self._round, self._contributed = round, set()
        self._reset_round()
        self._exchange_running = self._exchanging()
        seconds = None
        self._round_start = now = time.perf_counter()
        if self.budget is not None and self._epoch is not None:
            self._round_start = self._epoch[0] + (round - self._epoch[1]) * self.budget
            seconds = max(self._round_start + self.budget - now, 0.0)
        result = self.island.train_round(after_step=self._after_step, **({} if seconds is None else dict(seconds=seconds)))
        if self.budget is not None:  # sync = time: a fragment whose moment passed while the last step ran
            for p in range(self.num_fragments):
                if p not in self._contributed:
                    self._contribute(p)
        if drain or (self.budget is not None and round == self._first_round):
            self.drain()
            self._epoch = (time.perf_counter(), round + 1)
        self._last_end = time.perf_counter()
        between, self._between = self._between, dict.fromkeys(BETWEEN_ROUNDS, 0.0)
        wall = self._last_end - start - sum(between.values())
        compute = float(sum(result["step_times"]))
        clean = self.clean_step_seconds()
        done = self._finished
        out = dict(result)
        out.update(
            compute_seconds=compute,
            seconds_blocked=self._blocked,
            wall_seconds=wall,
            idle_seconds=max(0.0, wall - compute - self._blocked),
            clean_step_seconds=clean,
            ideal_compute_seconds=result["steps"] * clean,
            compute_utilization=result["steps"] * clean / wall if wall > 0 else 0.0,
            overlap_steps=self._last_tau,
            waits=self._waits,
            exchanges=len(done),
            bytes_sent=sum(d["bytes_sent"] for d in done),
            bytes_received=sum(d["bytes_received"] for d in done),
            payload_bytes=sum(d["payload_bytes"] for d in done),
            seconds_transferring=sum(d["seconds_transferring"] for d in done),
            exchange_seconds=float(np.mean([d["seconds"] for d in done])) if done else 0.0,
            codec_relative_error=float(np.mean([d["codec_relative_error"] for d in done])) if done else 0.0,
            **{f"{kind}_seconds": seconds for kind, seconds in between.items()},
        )
        return out

    def _after_step(self, steps_done: int, elapsed: float, step_seconds: float) -> None:
        now = time.time()
        self.events.add("compute", now - step_seconds, now, round=self._round + 1)
        if not getattr(self.island, "last_step_compiled", False):
            self.recent_steps.append(step_seconds)
            if not self._exchange_running:
                self.clean_steps.append((self.island.step, step_seconds))
        if self.budget is None:
            due = fragments_lib.due_fragments(steps_done, self.island.inner_steps, self.num_fragments)
        else:
            elapsed = time.perf_counter() - self._round_start
            due = [
                p for p in range(self.num_fragments)
                if p not in self._contributed and elapsed >= (p + 1) * self.budget / self.num_fragments
            ]
        for p in due:
            self._contribute(p)
        for flight in sorted(self.inflight.values(), key=lambda f: f.due_step):
            if flight.due_step <= self.island.step:
                self._apply(flight.fragment)
        self._exchange_running = self._exchanging()

    def _exchanging(self) -> bool:
        """Whether an exchange is still running (its update not yet received, decoded and placed). An update
        that arrived and waits for its due step no longer takes CPU from the steps."""
        return any(not flight.future.done() for flight in self.inflight.values())

    def _contribute(self, fragment: int) -> None:
        if fragment in self.inflight:  # its last update has not been applied yet: it must be first
            self._apply(fragment)
        island = self.island
        round = self.next_round[fragment]
        steps = island.step - self._steps_at_contribution[fragment]
        self._steps_at_contribution[fragment] = island.step
        pseudo_gradient = island.fragment_pseudo_gradient(fragment)
        tau = self.current_tau(fragment)
        self._last_tau = tau
        step_seconds = self.clean_step_seconds()
        future = self._pool.submit(
            self._exchange, fragment, round, max(steps, 1) * island.tokens_per_step, pseudo_gradient, step_seconds,
            tau,
        )
        self.inflight[fragment] = _Flight(fragment, round, island.step + tau, tau, future)
        self.next_round[fragment] = round + 1
        self._contributed.add(fragment)
        if tau == 0:
            self._apply(fragment)

    def _exchange(
        self, fragment: int, round: int, tokens: int, pseudo_gradient, step_seconds: float, tau: int
    ) -> dict:
        """On a background thread: encode, contribute, fetch the update, decode it and place it on the
        island's devices."""
        island, transport = self.island, self.transport
        t0 = time.time()
        encoder = island.encode_fragment(fragment, pseudo_gradient)
        status = transport.contribute(
            round, island.name, tokens, encoder, island.fragment_checksum(fragment), step_seconds, fragment=fragment
        )
        t1 = time.time()
        self.events.add("send", t0, t1, round=round + 1, fragment=fragment)
        update = transport.fetch_update(round, island.name, fragment=fragment)
        new_leaves = island.decode_fragment(fragment, update)
        placed = None
        if hasattr(island, "place_fragment"):
            placed = island.place_fragment(fragment, new_leaves, 2 if tau == 0 else 1)
        t2 = time.time()
        self.events.add("receive", t1, t2, round=round + 1, fragment=fragment)
        stats = transport.stats(round, fragment) if hasattr(transport, "stats") else None
        planned = transport.planned_inner_steps(island.name)
        return dict(
            fragment=fragment,
            round=round,
            status=status,
            new_leaves=new_leaves,
            placed=placed,
            planned=planned,
            seconds=t2 - t0,
            payload_bytes=encoder.nbytes,
            bytes_sent=stats.bytes_sent if stats is not None else encoder.nbytes,
            bytes_received=stats.bytes_received if stats is not None else len(update),
            seconds_transferring=stats.seconds_transferring if stats is not None else 0.0,
            codec_relative_error=encoder.relative_error,
        )

    def _apply(self, fragment: int) -> None:
        flight = self.inflight.pop(fragment)
        if not flight.future.done():
            t0 = time.time()
            futures.wait([flight.future])
            t1 = time.time()
            self._blocked += t1 - t0
            self._waits += 1
            self.events.add("wait", t0, t1, round=flight.round + 1, fragment=fragment)
        try:
            done = flight.future.result()
        except StaleRoundError:
            self._rejoin()
            return
        self.exchange_seconds.append(done["seconds"])
        mix = None if flight.tau == 0 else self.alpha
        self.island.apply_fragment(fragment, done.pop("new_leaves"), mix, placed=done.pop("placed"))
        self._finished.append(done)
        if done["planned"]:
            self._planned = done["planned"]

    def _rejoin(self) -> None:
        """More than a round behind: every fragment restarts from the coordinator's view, sent whole."""
        for flight in list(self.inflight.values()):
            futures.wait([flight.future])
        self.inflight.clear()
        view_round, view = self.transport.fetch_view(self.island.name)
        self.island.load_view(view)
        logging.warning("island %s fell behind; rejoined from the view at round %d", self.island.name, view_round)
        self.next_round = [view_round] * self.num_fragments
        self.rejoined_round = view_round

    def drain(self) -> None:
        """Waits for every exchange in flight and applies its update (in the order they are due)."""
        for flight in sorted(self.inflight.values(), key=lambda f: f.due_step):
            if flight.fragment in self.inflight:
                self._apply(flight.fragment)

    def close(self) -> None:
        """Stops the exchange threads (after `drain`) and flushes the events."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.events.flush()
