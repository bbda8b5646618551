"""Where an island's seconds go, round by round, and the spans it records for the timeline.

Every second of an island is accounted for per round: compute (inner steps,
simulated-speed sleep included), blocked (waiting for an update that is due),
idle (the rest: the exchange's bookkeeping on the training thread, logging),
and, between rounds, evaluation and checkpoint saves (`BetweenRounds`), which
the run schedules whatever the exchange does. Compute utilization is inner
steps x the median step time measured with no exchange in flight (none of
the island's exchanges running when the step started; an update that has
arrived and waits for its due step takes no CPU and does not count), over the
round's wall seconds (compute + blocked + idle; evaluation and saves are
reported beside it, not in it). `EventLog` keeps the spans for
`plots.plot_timeline`; `RoundProgress` logs how a long round's inner steps go.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time
from typing import Any, Callable

import numpy as np
from absl import logging

from island_jax.metrics import duration

# What `StreamingSync.run_round` adds to a round's result, as the roles log it.
ACCOUNTING_FIELDS = (
    "compute_seconds", "seconds_blocked", "idle_seconds", "wall_seconds", "clean_step_seconds", "ideal_compute_seconds",
    "compute_utilization", "overlap_steps", "waits", "exchanges", "bytes_sent", "bytes_received", "payload_bytes",
    "seconds_transferring", "exchange_seconds", "codec_relative_error", "eval_seconds", "checkpoint_seconds",
)
BETWEEN_ROUNDS = ("eval", "checkpoint")  # work between rounds that is not training: `StreamingSync.between_rounds`
CLEAN_HORIZON = 128  # inner steps: older steps with no exchange in flight no longer describe the step time
RECENT_STEPS = 32  # steps kept for the step time: it follows what else runs on the machine
MIN_CLEAN_STEPS = 8  # fewer clean steps than this in the horizon: fall back to all recent steps
SPAN_GAP = 2e-3  # seconds: compute spans closer than this merge into one


class EventLog:
    """Spans of what an island did (wall clock, `time.time()` seconds), as JSON lines.

    Kinds: "compute" (inner steps; consecutive steps, less than 2 ms apart,
    merge into one span), "send" (a contribution leaving), "receive" (waiting
    for, receiving and decoding its update), "wait" (training stopped for a
    due update), "eval" and "checkpoint" (between rounds). Each event is
    `{"island", "kind", "start", "end", ...fields}`. Safe to call from several
    threads. A log with a file begins with a "started" event of no length
    (with the process's `pid`): each process that appends to the file (a
    resumed island) marks where its spans begin.

    Args:
      path: a JSON-lines file to append to (None: kept in memory only).
      island: the island's name, written into every event.

    Raises:
      OSError: `path` cannot be opened for appending.
    """

    def __init__(self, path: str | None = None, island: str = ""):
        self.path, self.island = path, island
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._compute: dict | None = None  # the compute span being extended
        self._file = open(path, "a", encoding="utf-8") if path else None
        if self._file is not None:  # where this process's spans begin: the timeline marks a restart there
            now = time.time()
            self._write(dict(island=island, kind="started", start=now, end=now, pid=os.getpid()))

    def add(self, kind: str, start: float, end: float, **fields: Any) -> None:
        """Records a span [start, end] (seconds since the epoch) of `kind`, with extra fields (round, fragment)."""
        event = dict(island=self.island, kind=kind, start=float(start), end=float(end), **fields)
        with self._lock:
            if kind == "compute":
                if self._compute is not None and start - self._compute["end"] < SPAN_GAP:
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
        """Flushes, then closes the file (the in-memory `events` stay)."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def median(values) -> float:
    """Median of a sequence of seconds (float64), 0.0 when it is empty."""
    return float(np.median(np.asarray(list(values), np.float64))) if len(values) else 0.0


@dataclasses.dataclass
class StepTimes:
    """Seconds (sleep included) of an island's recent inner steps, compiling steps left out.

    The step time follows what else runs on the machine, so only recent steps
    describe a round: the last `RECENT_STEPS` steps, and among them the ones
    that started with no exchange of the island running ("clean" steps).
    """

    clean: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))

    def add(self, step: int, seconds: float, clean: bool) -> None:
        """Records the step that brought the island to inner step `step` (counted over the run)."""
        self.recent.append(seconds)
        if clean:
            self.clean.append((step, seconds))

    def clean_step_seconds(self, step: int) -> float:
        """Median seconds of the clean steps among the last `CLEAN_HORIZON` before inner step `step`; when
        fewer than `MIN_CLEAN_STEPS` of those are clean (an island whose exchanges always overlap), the
        median of the recent steps. 0.0 before any step."""
        clean = [sec for s, sec in self.clean if s > step - CLEAN_HORIZON]
        return median(clean) if len(clean) >= MIN_CLEAN_STEPS else median(self.recent)


class BetweenRounds:
    """Seconds of work between rounds that is not training (`BETWEEN_ROUNDS` kinds), since the last round ended."""

    def __init__(self):
        self.seconds = dict.fromkeys(BETWEEN_ROUNDS, 0.0)

    @staticmethod
    def check(kind: str) -> None:
        """Raises ValueError when `kind` is not one of `BETWEEN_ROUNDS`."""
        if kind not in BETWEEN_ROUNDS:
            raise ValueError(f"between_rounds kind {kind!r} is unknown; use one of {BETWEEN_ROUNDS}")

    def add(self, kind: str, seconds: float) -> None:
        """Adds `seconds` of `kind`.

        Raises:
          ValueError: `kind` is not one of `BETWEEN_ROUNDS`.
        """
        self.check(kind)
        self.seconds[kind] += seconds

    def take(self) -> dict[str, float]:
        """The seconds per kind so far, which start again from zero."""
        seconds, self.seconds = self.seconds, dict.fromkeys(BETWEEN_ROUNDS, 0.0)
        return seconds


@dataclasses.dataclass
class RoundAccounting:
    """What one round spent beside its inner steps; a new one starts every round.

    Attributes:
      seconds_blocked: training stopped for updates that were due, s.
      waits: how many updates training stopped for.
      exchanges: one record per exchange whose update was applied this round
        (`bytes_sent`, `bytes_received`, `payload_bytes` in bytes;
        `seconds_transferring` and `seconds` (encode to placed) in s;
        `codec_relative_error`).
    """

    seconds_blocked: float = 0.0
    waits: int = 0
    exchanges: list[dict] = dataclasses.field(default_factory=list)

    def report(
        self, result: dict, wall: float, between: dict[str, float], clean_step: float, overlap_steps: int
    ) -> dict:
        """The ACCOUNTING_FIELDS of a round (seconds are wall-clock s, bytes are bytes).

        `compute_seconds` (steps, sleep included), `seconds_blocked`,
        `wall_seconds` (`wall`), `idle_seconds` (wall - compute - blocked),
        `clean_step_seconds` (`clean_step`), `ideal_compute_seconds` (steps x
        clean step), `compute_utilization` (ideal compute / wall; 0 when wall is
        0), `overlap_steps`, `waits`, over the exchanges applied this round:
        `exchanges`, `bytes_sent`, `bytes_received` (frame bytes),
        `payload_bytes`, `seconds_transferring`, `exchange_seconds` (mean),
        `codec_relative_error` (mean); and `eval_seconds`, `checkpoint_seconds`
        (`between`).

        Args:
          result: `Island.train_round`'s result (`steps`, `step_times` in s).
          wall: the round's wall seconds, evaluation and saves left out.
          between: `BetweenRounds.take()`, seconds per kind.
          clean_step: `StepTimes.clean_step_seconds()`, s.
          overlap_steps: tau of the round's last contribution.
        """
        compute = float(sum(result["step_times"]))
        done = self.exchanges
        ideal = result["steps"] * clean_step
        return dict(
            compute_seconds=compute,
            seconds_blocked=self.seconds_blocked,
            wall_seconds=wall,
            idle_seconds=max(0.0, wall - compute - self.seconds_blocked),
            clean_step_seconds=clean_step,
            ideal_compute_seconds=ideal,
            compute_utilization=ideal / wall if wall > 0 else 0.0,
            overlap_steps=overlap_steps,
            waits=self.waits,
            exchanges=len(done),
            bytes_sent=sum(d["bytes_sent"] for d in done),
            bytes_received=sum(d["bytes_received"] for d in done),
            payload_bytes=sum(d["payload_bytes"] for d in done),
            seconds_transferring=sum(d["seconds_transferring"] for d in done),
            exchange_seconds=float(np.mean([d["seconds"] for d in done])) if done else 0.0,
            codec_relative_error=float(np.mean([d["codec_relative_error"] for d in done])) if done else 0.0,
            **{f"{kind}_seconds": seconds for kind, seconds in between.items()},
        )


class RoundProgress:
    """A log line every `every_seconds` of a round's inner steps, so that a round of minutes is not silent.

    The first line comes `every_seconds` into the round (a shorter round logs
    none), then one each `every_seconds` after the last, e.g.

      island a round 3/10: inner step 120/400 (step 1620), 0.512 s/step, 64000 tokens/s, 61s in, ~2m23s left

    The step time is the mean over the steps since the last line (compiling
    steps, sleeps and the exchange's work on the training thread included);
    the time left is the round's steps left at that step time, or under
    `outer.sync = "time"` what remains of its budget.

    Args:
      island: the island's name.
      rounds: rounds in the run (`outer.rounds`).
      every_seconds: `metrics.progress_seconds`, s; 0 (or less) logs nothing.
      tokens_per_step: tokens one inner step trains on.
      log: where lines go (default `absl.logging.info`; a test may collect them).
    """

    def __init__(self, island: str, rounds: int, every_seconds: float, tokens_per_step: int,
                 log: Callable[[str], None] | None = None):
        self.island, self.rounds, self.every_seconds = island, rounds, float(every_seconds)
        self.tokens_per_step = tokens_per_step
        self.log = log or (lambda line: logging.info("%s", line))
        self._round, self._steps, self._budget = 0, None, None
        self._last = (0, 0.0)  # (steps done, seconds into the round) at the last line, or the round's start

    def begin(self, round: int, steps: int | None = None, seconds: float | None = None) -> None:
        """Starts round `round` (0-based) of `steps` inner steps, or of a budget of `seconds` (s)."""
        self._round, self._steps, self._budget, self._last = round, steps, seconds, (0, 0.0)

    def after_step(self, steps_done: int, elapsed: float, step: int) -> str | None:
        """Logs and returns the line when one is due, `steps_done` steps and `elapsed` seconds into the round
        (`step`: the island's inner steps over the run); else None."""
        steps_before, seconds_before = self._last
        if self.every_seconds <= 0 or elapsed - seconds_before < self.every_seconds or steps_done <= steps_before:
            return None
        self._last = (steps_done, elapsed)
        step_seconds = (elapsed - seconds_before) / (steps_done - steps_before)
        if self._budget is not None:
            planned, left = "", self._budget - elapsed
        else:
            planned, left = f"/{self._steps}", ((self._steps or steps_done) - steps_done) * step_seconds
        line = (f"island {self.island} round {self._round + 1}/{self.rounds}: inner step {steps_done}{planned} "
                f"(step {step}), {step_seconds:.3g} s/step, {self.tokens_per_step / step_seconds:.0f} tokens/s, "
                f"{duration(elapsed)} in, ~{duration(left)} left")
        self.log(line)
        return line
