"""Streaming DiLoCo for one island (`StreamingSync`): fragments exchanged on background threads while inner
steps run (Douillard et al., arXiv 2501.18512, Algorithm 1 with its overlap, Section 2.3).

Fragment p of F (`outer/fragments.py`) is contributed after inner step o_p = (p + 1) x H // F of every round
(`outer.sync = "steps"`), or once (p + 1) / F of `outer.round_seconds` has passed (`"time"`): its
pseudo-gradient anchor - params, with the tokens trained since its last one. The exchange (encode, send, wait
for the merge, receive, decode) runs on a background thread, and the update is applied at the end of inner
step t + tau (tau = `outer.overlap_steps`; "auto" from the link and the measured exchanges): the fragment's
anchor becomes the global value and its parameters alpha x local + (1 - alpha) x global (alpha =
`outer.mix_alpha`). tau = 0 takes the global values at once; with F = 1 as well this is DiLoCo (arXiv
2311.08105), by the same code (docs/streaming.md).

What the loop needs of an island is `OuterLoopIsland`; how it accounts for the island's seconds is in
`accounting.py`.
"""

from __future__ import annotations

import collections
import contextlib
import time
from concurrent import futures
from typing import Callable, Protocol, runtime_checkable

from absl import logging

from island_jax.island.accounting import BetweenRounds, EventLog, RoundAccounting, RoundProgress, StepTimes
from island_jax.island.replay import ReplayPlan, ReplayTransport
from island_jax.island.round_state import Flight, RoundClock, Schedule, Settings
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib
from island_jax.protocol import ContributionHeader, CoordinatorRestarted, ExchangeError, StaleRoundError, Transport


@runtime_checkable
class OuterLoopIsland(Protocol):
    """What `StreamingSync` needs of an island. `island.Island` implements it; so may a test's stand-in.

    Attributes:
      name: the island's key in `config.islands`.
      step: inner steps taken over the run (also the data position).
      inner_steps: H, inner steps per round.
      tokens_per_step: tokens one inner step trains on (batch size x sequence length).
      partition: per fragment, its leaf indices in `jax.tree.leaves` order.
      fragment_plans: per fragment, its payload's `codec.Chunk`s (their `nbytes` sum to the payload's bytes).
      update_plans: per fragment, its update's chunks (the same elements, in the update's codec: `codec.update_kind`).
      last_step_compiled: the last inner step compiled, so its seconds say nothing of the step time.
      multi_process: the island spans several processes: each exchanges the chunks it owns of every payload,
        and the update's chunks that other processes hold elements of are passed on (`gather_update`) and
        applied on the training thread, where the processes' collectives run in the same order.
    """

    name: str
    multi_process: bool
    step: int
    inner_steps: int
    tokens_per_step: int
    partition: list[list[int]]
    fragment_plans: list[list[codec.Chunk]]
    update_plans: list[list[codec.Chunk]]
    last_step_compiled: bool

    def train_round(
        self, num_steps: int | None = None, after_step: Callable[[int, float, float], None] | None = None,
        seconds: float | None = None,
    ) -> dict:
        """One round of inner steps; calls `after_step(steps_done, elapsed_seconds, step_seconds)` after each.
        Returns at least `steps` and `step_times` (s, one per step)."""

    def set_inner_steps(self, inner_steps: int, rounds_left: int) -> None:
        """A new H for the rounds left."""

    def warm_up(self) -> None:
        """Compiles the island's programs without changing its state."""

    def fragment_pseudo_gradient(self, fragment: int):
        """anchor - params over the fragment's leaves (float32), ready before the next inner step, in whatever form
        `encode_fragment` takes (training thread)."""

    def encode_fragment(self, fragment: int, pseudo_gradient) -> codec.ChunkEncoder:
        """This process's chunks of the fragment's pseudo-gradient for the wire (called on an exchange thread)."""

    def fragment_checksum(self, fragment: int) -> str:
        """`model.init.checksum` of the fragment's global leaves (an exchange thread with one process; the
        training thread with several, where it is a collective)."""

    def agree(self, value) -> list:
        """Every process's `value`, in process order ([value] with one process; training thread)."""

    def gather_update(self, fragment: int, payload: bytes):
        """What `decode_fragment` needs of the update, from this process's fetched chunks and those the other
        processes pass on (several processes; training thread)."""

    def decode_fragment(self, fragment: int, update) -> list:
        """The fragment's new global leaves (this process's part) from the update: the fetched payload with one
        process (on an exchange thread), `gather_update`'s result with several."""

    def place_fragment(self, fragment: int, global_leaves: list, copies: int) -> list:
        """`copies` device placements of the new global leaves (called on an exchange thread)."""

    def apply_fragment(
        self, fragment: int, global_leaves: list, mix_alpha: float | None = None, placed=None
    ) -> None:
        """The new global leaves become the fragment's anchor; its parameters mix with them (or take them)."""

    def view_chunks(self, plan: list[codec.Chunk]) -> list[codec.Chunk]:
        """The chunks of the view's plan (a float32 "none" payload) that this process holds elements of."""

    def load_view(self, payload: bytes) -> None:
        """Replaces every global parameter with the coordinator's view (a float32 "none" payload; only the chunks
        `view_chunks` names need be there)."""


_FAILURES = ("restarted", "stale", "error")  # how an exchange can fail, the one every process follows first


def _outcome_of(error: BaseException) -> list:
    """[kind, round, message] of a failed exchange, as the processes of an island share it (JSON)."""
    if isinstance(error, CoordinatorRestarted):
        return ["restarted", error.round, str(error)]
    if isinstance(error, StaleRoundError):
        return ["stale", 0, str(error)]
    return ["error", 0, f"{type(error).__name__}: {error}"]


def log_view_taken(island: OuterLoopIsland, transport) -> None:
    """Of an island of several processes: logs how many of the view's chunks this process took (its own)."""
    if island.multi_process:
        plan = getattr(transport, "view_plan", None) or []
        logging.info("island %s, process %d: took %d of the view's %d chunks, those of its own shards", island.name,
                     island.part, len(island.view_chunks(plan)), len(plan))


class StreamingSync:
    """Drives one island's rounds with fragments, overlap and accounting (Streaming DiLoCo, arXiv 2501.18512,
    Algorithm 1; see the module docstring).

    Args:
      island: the island (`OuterLoopIsland`: in the runs, an `island.Island`).
      transport: the island's `protocol.Transport` (in process or gRPC; a link emulator under it), or
        None: no outer loop (the data-parallel baseline trains its rounds and exchanges nothing).
      config: the run's config (`outer.fragments`, `overlap_steps`, `mix_alpha`,
        `sync`, `round_seconds`, `rounds`; `comm.connections`; `metrics.progress_seconds`).
      first_round: the round the island trains next (0, or a resumed checkpoint's).
      link: the island's emulated link (`comm.link.LinkEmulator`), for tau = "auto" before the first exchange.
      events: where spans go (default: an in-memory `EventLog`).
      fragment_rounds: each fragment's next round when they differ (an island that took a view of a run whose
        fragments were at different rounds: in round `first_round` it skips the fragments already past it).

    Attributes:
      inflight: {fragment: its exchange in flight}; empty when every update is applied.
      rejoined_round: set when a stale round made the island rejoin from the coordinator's view (the
        view's round); the caller resets it to None once it has taken note.
      events: the `EventLog`.
      progress: the `accounting.RoundProgress` that logs a line every `metrics.progress_seconds` of a round's
        inner steps (process 0 of an island of several).

    Raises (from `run_round`, `drain`): the exchange's errors (ContributionError,
    ExchangeError, CodecError), on the training thread when the update is applied.
    """

    def __init__(
        self, island: OuterLoopIsland, transport: Transport | None, config, first_round: int = 0, link=None,
        events: EventLog | None = None, fragment_rounds: list[int] | None = None,
    ):
        self.island, self.transport, self.link = island, transport, link
        self.settings = settings = Settings.from_config(config, len(island.partition))
        self.events = events if events is not None else EventLog(island=island.name)
        self.schedule = Schedule(
            next_round=list(fragment_rounds or [first_round] * settings.fragments),
            steps_at_contribution=fragments_lib.last_contributions(
                island.step, island.inner_steps, settings.fragments, first_round, settings.round_seconds is not None),
            exchange_seconds=collections.deque(maxlen=settings.fragments),
            last_tau=settings.tau,
        )
        self.clock = RoundClock(round=first_round, first_round=first_round)
        self.step_times = StepTimes()
        self.accounting = RoundAccounting()
        # an island of several processes: process 0's lines say it for all of them
        every = settings.progress_seconds if getattr(island, "part", 0) == 0 else 0.0
        self.progress = RoundProgress(island.name, settings.rounds, every, island.tokens_per_step)
        self.inflight: dict[int, Flight] = {}
        self.rejoined_round: int | None = None
        self.rejoin_reason: str | None = None  # why a replay ended in a view (`island.replay`), with rejoined_round
        self.replay_start = 0  # with rejoin_reason: the round that replay started from
        self.replay: ReplayPlan | None = None  # the rounds being replayed (`replay_from`)
        self._between = BetweenRounds()  # seconds since the last round ended
        self._exchange_running = False  # an exchange was running when the step now running started
        self._synced_at: int | None = None  # the first step after the last applied update of the round's last fragment
        if first_round == 0 or settings.round_seconds is not None:  # counts from where the tokens do
            self._reset_routed_counts()  # (`fragments.last_contributions`)
        self._pool = futures.ThreadPoolExecutor(max_workers=settings.fragments, thread_name_prefix="fragment-exchange")

    # -- the schedule ----------------------------------------------------------------------------------

    def clean_step_seconds(self) -> float:
        """Median inner-step time (seconds, sleep included) of the recent steps run with no exchange in
        flight (`accounting.StepTimes.clean_step_seconds`)."""
        return self.step_times.clean_step_seconds(self.island.step)

    def current_tau(self, fragment: int) -> int:
        """tau (inner steps) for a contribution of `fragment` now: `outer.overlap_steps`, or the "auto" choice,
        at most one less than the steps in a round (at least 1)."""
        s, round = self.settings, self.schedule.next_round[fragment]
        recorded = self.replay.tau(round, fragment) if self.replay is not None and self.replay.has(round, fragment) else None
        if recorded is not None:  # chosen by measurement the first time: as recorded
            return recorded
        if not s.auto:
            return s.tau
        step = self.clean_step_seconds()
        if s.round_seconds is None:
            cap = self.island.inner_steps - 1
        else:
            cap = int(s.round_seconds / step) - 1 if step > 0 else 1
        exchanges = self.schedule.exchange_seconds
        exchange = max(exchanges) if exchanges else self._link_estimate(fragment)
        return fragments_lib.auto_overlap_steps(exchange, step, max(cap, 1))

    def _link_estimate(self, fragment: int) -> float:
        """Seconds to move the fragment's payload up and the update down over the emulated link (0: none)."""
        link = self.link
        if link is None:
            return 0.0
        up = sum(c.nbytes for c in self.island.fragment_plans[fragment])
        down = sum(c.nbytes for c in self.island.update_plans[fragment])
        rate = link.rate_gbps(self.settings.connections) * 1e9
        return 2 * link.latency_ms / 1e3 + (up + down) * 8 / rate

    def _due_fragments(self, steps_done: int) -> list[int]:
        """The fragments to contribute now, `steps_done` inner steps into the round."""
        s = self.settings
        if self._replaying_round():
            return self.replay.due(self.clock.round, self.island.step, self.schedule.steps_at_contribution,
                                   self.schedule.contributed)
        if s.round_seconds is None:
            return fragments_lib.due_fragments(steps_done, self.island.inner_steps, s.fragments)
        elapsed = time.perf_counter() - self.clock.start
        return [
            p for p in range(s.fragments)
            if p not in self.schedule.contributed and elapsed >= (p + 1) * s.round_seconds / s.fragments
        ]

    # -- one round -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def between_rounds(self, kind: str):
        """Times work done between rounds that is not training: `kind` "eval" (an evaluation) or
        "checkpoint" (a save). Its seconds are reported as the next round's `eval_seconds` or
        `checkpoint_seconds`, left out of that round's `wall_seconds` (and so of its compute utilization,
        which measures training against the exchange), and drawn as a span of `kind` in the events.

        Raises:
          ValueError: `kind` is not one of `accounting.BETWEEN_ROUNDS` (before the work runs).
        """
        BetweenRounds.check(kind)
        start, wall_start = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self._between.add(kind, time.perf_counter() - start)
            self.events.add(kind, wall_start, time.time(), round=self.clock.round + 1)

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
          `island.train_round`'s result, plus the round's `accounting.ACCOUNTING_FIELDS`
          (`accounting.RoundAccounting.report`). `wall_seconds` runs from the end of the
          previous round, less the work timed by `between_rounds` since then.

        Raises:
          The exchange's errors (ContributionError, ExchangeError, CodecError), when an update is applied.
        """
        # Wall time runs from the end of the previous round: what the caller did in between is this
        # round's idle time, except evaluation and checkpoint saves timed by `between_rounds`.
        clock, timed = self.clock, self.settings.round_seconds is not None
        start = clock.last_end if clock.last_end is not None else time.perf_counter()
        self._take_planned_inner_steps(round)
        self.schedule.contributed = set()
        self.accounting = RoundAccounting()
        self._exchange_running = self._exchanging()
        seconds = clock.begin(round, self.settings.round_seconds)
        budget = {} if seconds is None else dict(seconds=seconds)
        replaying = self._replaying_round()
        if replaying:  # a kept round: its steps as recorded, whatever the clock says now
            budget = dict(num_steps=self.replay.round_steps(round, self.island.step, self.schedule.steps_at_contribution))
            timed = False
        if timed:
            self.progress.begin(round, seconds=self.settings.round_seconds if seconds is None else seconds)
        else:
            self.progress.begin(round, steps=self.island.inner_steps)
        result = self.island.train_round(after_step=self._after_step, **budget)
        if timed and self.transport is not None:  # sync = time: a fragment whose moment passed in the last step
            for p in range(self.settings.fragments):
                if p not in self.schedule.contributed:
                    self._contribute(p)
        if drain or (timed and round == clock.first_round and not replaying):
            self.drain()
            clock.epoch = (time.perf_counter(), round + 1)
        clock.last_end = time.perf_counter()
        between = self._between.take()
        wall = clock.last_end - start - sum(between.values())
        out = dict(result)
        out.update(self.accounting.report(result, wall, between, self.clean_step_seconds(), self.schedule.last_tau))
        return out

    def replay_from(self, plan: ReplayPlan) -> None:
        """Replays the kept rounds of `plan` (`island.replay`): their contributions are checked, not sent, and
        their updates are the kept ones."""
        self.replay, self.transport = plan, ReplayTransport(self.transport, plan)

    def end_replay(self) -> None:
        """Back to the live exchange (the replay reached the run's round, or ended in a view)."""
        if self.replay is not None:
            self.replay, self.transport = None, self.transport.transport

    def _replaying_round(self) -> bool:
        """Whether the round being trained is kept whole and its steps and moments come from the records: with one
        fragment, or under `outer.sync = "time"` (by steps, F > 1, the schedule is the first time's already)."""
        return (self.replay is not None and self.replay.whole_round(self.clock.round)
                and (self.settings.fragments == 1 or self.settings.round_seconds is not None))

    def _take_planned_inner_steps(self, round: int) -> None:
        """Adopts the coordinator's plan of H (`outer.auto_from = measured`) from `round` on, when it changed."""
        planned = self.schedule.planned_inner_steps
        if planned and planned != self.island.inner_steps:
            logging.info("island %s: %d inner steps per round from round %d on", self.island.name, planned, round + 1)
            self.island.set_inner_steps(planned, self.settings.rounds - round)
            self.island.warm_up()  # the rebuilt step compiles here, not in a timed step

    def _after_step(self, steps_done: int, elapsed: float, step_seconds: float) -> None:
        now = time.time()
        self.events.add("compute", now - step_seconds, now, round=self.clock.round + 1)
        if not self.island.last_step_compiled:
            self.step_times.add(self.island.step, step_seconds, clean=not self._exchange_running)
        self.progress.after_step(steps_done, elapsed, self.island.step)
        if self.transport is None:  # no outer loop (the data-parallel baseline): nothing is exchanged
            return
        for p in self._due_fragments(steps_done):
            self._contribute(p)
        self._apply_due(self.island.step)
        self._exchange_running = self._exchanging()

    def _exchanging(self) -> bool:
        """Whether an exchange is still running (its update not yet received, decoded and placed). An update
        that arrived and waits for its due step no longer takes CPU from the steps."""
        return any(not flight.future.done() for flight in self.inflight.values())

    # -- the exchange ----------------------------------------------------------------------------------

    def _contribute(self, fragment: int) -> None:
        island, schedule = self.island, self.schedule
        if schedule.next_round[fragment] > self.clock.round:  # a view's fragment already past this round
            schedule.contributed.add(fragment)
            return
        if fragment in self.inflight:  # its last update has not been applied yet: it must be first
            self._apply(fragment)
        round = schedule.next_round[fragment]
        steps = island.step - schedule.steps_at_contribution[fragment]
        schedule.steps_at_contribution[fragment] = island.step
        pseudo_gradient = island.fragment_pseudo_gradient(fragment)
        tau = self.current_tau(fragment)
        checksum = None  # of one process: computed on the exchange thread
        if island.multi_process:  # every process applies the update at the same step: process 0's tau
            tau = island.agree(tau)[0]
            checksum = island.fragment_checksum(fragment)  # a collective: here, on the training thread
        schedule.last_tau = tau
        step_seconds = self.clean_step_seconds()
        tokens = max(steps, 1) * island.tokens_per_step
        diagnostics = self._diagnostics(fragment, tokens)
        future = self._pool.submit(self._exchange, fragment, round, tokens, pseudo_gradient, step_seconds, tau, checksum,
                                   self.transport, diagnostics)  # a replay's, for a kept round, whenever the thread runs
        self.inflight[fragment] = Flight(fragment, round, island.step + tau, tau, future)
        schedule.next_round[fragment] = round + 1
        schedule.contributed.add(fragment)
        if tau == 0:
            self._apply(fragment)

    def _diagnostics(self, fragment: int, tokens: int) -> dict:
        """What the fragment's contribution header carries for the routing diagnostics (`coordinator/routing.py`):
        its routed counts (`Island.take_routed_counts`) and, on the round's last fragment, the island's top-k
        choices on the probe (`Island.route_probe`) and the loss change over the first step after the previous
        update (`post_sync_loss_change`). An island without them (a test's stand-in) sends none."""
        island = self.island
        take = getattr(island, "take_routed_counts", None)
        out = dict(take(fragment, tokens)) if take is not None else {}
        if fragment == self.settings.fragments - 1 and take is not None:
            out["routing_probe"] = island.route_probe()
            losses, after = island.step_losses, self._synced_at
            if after is not None and after in losses and after - 1 in losses:
                out["post_sync_loss_change"] = losses[after] - losses[after - 1]
                self._synced_at = None
        return out

    def _exchange(
        self, fragment: int, round: int, tokens: int, pseudo_gradient, step_seconds: float, tau: int,
        checksum: str | None = None, transport: Transport | None = None, diagnostics: dict | None = None,
    ) -> dict:
        """On a background thread: encode, contribute, fetch the update, decode it and place it on the
        island's devices (over `transport`, default the sync's)."""
        island, transport = self.island, transport or self.transport
        t0 = time.time()
        encoder = island.encode_fragment(fragment, pseudo_gradient)
        checksum = checksum or island.fragment_checksum(fragment)
        header = ContributionHeader(round, island.name, tokens, checksum, step_seconds, fragment,
                                    overlap_steps=tau if self.settings.auto else None,  # kept for a replay
                                    **(diagnostics or {}))
        status = transport.contribute(header, encoder)
        t1 = time.time()
        self.events.add("send", t0, t1, round=round + 1, fragment=fragment)
        update = transport.fetch_update(round, island.name, fragment=fragment)
        if island.multi_process:  # this process's share: put together on the training thread (`_apply`)
            new_leaves, placed = update, None
        else:
            new_leaves = island.decode_fragment(fragment, update)
            placed = island.place_fragment(fragment, new_leaves, 2 if tau == 0 else 1)
        t2 = time.time()
        self.events.add("receive", t1, t2, round=round + 1, fragment=fragment)
        stats = transport.stats(round, fragment)
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
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            seconds_transferring=stats.seconds_transferring,
            codec_relative_error=encoder.relative_error,
        )

    def _apply(self, fragment: int) -> None:
        flight = self.inflight.pop(fragment)
        if not flight.future.done():
            t0 = time.time()
            futures.wait([flight.future])
            t1 = time.time()
            self.accounting.seconds_blocked += t1 - t0
            self.accounting.waits += 1
            self.events.add("wait", t0, t1, round=flight.round + 1, fragment=fragment)
        try:
            done = self._outcome(flight)
        except StaleRoundError as e:
            self._rejoin(e)
            return
        self.schedule.exchange_seconds.append(done["seconds"])
        mix = None if flight.tau == 0 else self.settings.mix_alpha
        self.island.apply_fragment(fragment, done.pop("new_leaves"), mix, placed=done.pop("placed"))
        if fragment == self.settings.fragments - 1:  # the round's update is in: the next step is the first after it
            self._synced_at = self.island.step
        self.accounting.exchanges.append(done)
        if done["planned"]:
            self.schedule.planned_inner_steps = done["planned"]

    def _outcome(self, flight: Flight) -> dict:
        """The finished exchange's result. Of an island of several processes, every process's outcome is
        shared first, so that all of them go on the same way (apply, rejoin from the view, or fail), and the
        update is put together from their shares and decoded here.

        Raises:
          The exchange's error, or that of another process of the island (StaleRoundError on any: all rejoin).
        """
        island = self.island
        if not island.multi_process:
            return flight.future.result()
        error = flight.future.exception()
        outcomes = island.agree(None if error is None else _outcome_of(error))
        failed = [(p, o) for p, o in enumerate(outcomes) if o is not None]
        if failed:  # every process fails the same way: a coordinator restart first, then a rejoin, then errors
            p, (kind, round, message) = min(failed, key=lambda f: (_FAILURES.index(f[1][0]), f[0]))
            if error is not None and _outcome_of(error)[0] == kind:
                raise error
            if kind == "restarted":
                raise CoordinatorRestarted(round, f"process {p} of the island: {message}")
            if kind == "stale":
                raise StaleRoundError(f"process {p} of the island: {message}")
            raise ExchangeError(f"island {island.name}: process {p}'s exchange of round {flight.round + 1} failed "
                                f"({message})")
        done = flight.future.result()
        payload = island.gather_update(flight.fragment, done["new_leaves"])
        done["new_leaves"] = island.decode_fragment(flight.fragment, payload)
        return done

    def _apply_due(self, step: int | None = None) -> None:
        """Applies the updates due by inner step `step` (every one when None), in the order they are due."""
        for flight in sorted(self.inflight.values(), key=lambda f: f.due_step):
            if flight.fragment in self.inflight and (step is None or flight.due_step <= step):
                self._apply(flight.fragment)

    def _rejoin(self, why: StaleRoundError) -> None:
        """More than a round behind, or a replay that ended (`why`): every fragment restarts from the
        coordinator's view, sent whole."""
        if self.replay is not None:
            self.rejoin_reason, self.replay_start = str(why), self.replay.start
            logging.warning("island %s stops replaying: %s; it takes the coordinator's view", self.island.name, why)
            self.end_replay()
        self.forget_inflight()
        rounds, view = self.transport.fetch_view(self.island.name, needed=self.island.view_chunks)
        self.island.load_view(view)
        if self.rejoin_reason is None:
            logging.warning("island %s fell behind; rejoined from the view at rounds %s", self.island.name, rounds)
        else:
            logging.warning("island %s rejoined the run at round %d from the view, its replay ended (%s)",
                            self.island.name, min(rounds) + 1, self.rejoin_reason)
        log_view_taken(self.island, self.transport)
        self._start_schedule(rounds)
        self.rejoined_round = min(rounds)

    def resumed_after_update(self, loss_before: float | None) -> None:
        """A resume from a checkpoint (taken with every update applied): the island's next step is the first after
        an update, and `loss_before` the loss of the step before it (from the run's record; None: unknown), so the
        first round's post-sync loss change is measured as in a run never stopped."""
        if self.island.multi_process:  # process 0's record: every share's header says the same
            loss_before = self.island.agree(loss_before)[0]
        if loss_before is not None:
            self.island.step_losses[self.island.step - 1] = float(loss_before)
            self._synced_at = self.island.step

    def _start_schedule(self, rounds: list[int]) -> None:
        """Every fragment's next round (`rounds`) and last contribution now: its tokens and routed counts count
        from the island's current step."""
        self.schedule.start_at(rounds, self.island.step)
        self._reset_routed_counts()

    def _reset_routed_counts(self) -> None:
        """The island's routed counts start from zero (`Island.reset_routed_counts`; a stand-in may have none)."""
        reset = getattr(self.island, "reset_routed_counts", None)
        if reset is not None:
            reset()

    def forget_inflight(self, timeout: float | None = None) -> None:
        """Waits (up to `timeout` seconds) for the exchanges in flight to end and forgets them, errors and all."""
        futures.wait([flight.future for flight in self.inflight.values()], timeout=timeout)
        self.inflight.clear()

    def restart(self, first_round: int, fragment_rounds: list[int] | None = None, timeout: float | None = None) -> None:
        """Starts over at `first_round` after the island's state was replaced (a rollback to its checkpoint, or
        the coordinator's view after a coordinator restart): the exchanges in flight are forgotten (waiting up
        to `timeout` seconds for their threads), the schedule and the round clock start afresh."""
        self.forget_inflight(timeout)
        fragments = self.settings.fragments
        self._start_schedule(fragment_rounds or [first_round] * fragments)
        self.schedule.contributed = set()
        self.clock = RoundClock(round=first_round, first_round=first_round)
        self.rejoined_round = self.rejoin_reason = None
        self.end_replay()

    def drain(self) -> None:
        """Waits for every exchange in flight and applies its update (in the order they are due)."""
        self._apply_due()

    def close(self) -> None:
        """Stops the exchange threads (after `drain`) and flushes the events."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.events.flush()
