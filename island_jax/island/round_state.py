"""The state `outer_loop.StreamingSync` keeps between inner steps: its settings, where each fragment stands, the
round's clock, and each exchange in flight."""

from __future__ import annotations

import collections
import dataclasses
import time
from concurrent import futures


@dataclasses.dataclass(frozen=True)
class Settings:
    """The outer loop's part of the run's config."""

    fragments: int  # F
    mix_alpha: float  # alpha
    auto: bool  # outer.overlap_steps = "auto"
    tau: int  # outer.overlap_steps when fixed (0 under "auto")
    round_seconds: float | None  # outer.sync = "time": each round's wall-clock budget, s; None: by steps
    rounds: int  # outer.rounds
    connections: int  # comm.connections
    progress_seconds: float  # metrics.progress_seconds: a progress line this often within a round, s (0: none)

    @classmethod
    def from_config(cls, config, fragments: int) -> "Settings":
        o = config.outer
        auto = o.overlap_steps == "auto"
        metrics = config.get("metrics") or {}  # a config saved before the field existed: its default
        return cls(
            fragments=fragments,
            mix_alpha=float(o.mix_alpha),
            auto=auto,
            tau=0 if auto else int(o.overlap_steps),
            round_seconds=float(o.round_seconds) if o.sync == "time" else None,
            rounds=int(o.rounds),
            connections=int(config.comm.connections),
            progress_seconds=float(metrics.get("progress_seconds", 30.0)),
        )


@dataclasses.dataclass
class Schedule:
    """Where each fragment stands, and what the schedule is planned from."""

    next_round: list[int]  # per fragment: the round of its next contribution
    steps_at_contribution: list[int]  # per fragment: the island's step at its last contribution
    exchange_seconds: collections.deque  # the last F exchanges' seconds (encode to placed), for tau = "auto"
    last_tau: int  # tau of the last contribution
    contributed: set[int] = dataclasses.field(default_factory=set)  # fragments contributed this round
    planned_inner_steps: int | None = None  # H planned by the coordinator from measured step times

    def start_at(self, rounds: list[int], step: int) -> None:
        """Every fragment's next round (`rounds`, one each) and its last contribution at inner step `step`."""
        self.next_round = list(rounds)
        self.steps_at_contribution = [step] * len(rounds)


@dataclasses.dataclass
class RoundClock:
    """When rounds run (`time.perf_counter()` seconds)."""

    round: int  # the round being trained (the last one trained, between rounds)
    first_round: int  # this process's first round
    start: float = 0.0  # when the round's fragment schedule started (sync = time: aligned on the epoch)
    last_end: float | None = None  # when the last round ended
    epoch: tuple[float, int] | None = None  # (when, round): a drain realigned the islands there

    def begin(self, round: int, round_seconds: float | None) -> float | None:
        """Starts `round`. Returns its training seconds when rounds are aligned on a drain (sync = time:
        the round ends at epoch + (round - epoch round + 1) x round_seconds), else None."""
        self.round = round
        self.start = now = time.perf_counter()
        if round_seconds is None or self.epoch is None:
            return None
        self.start = self.epoch[0] + (round - self.epoch[1]) * round_seconds
        return max(self.start + round_seconds - now, 0.0)


@dataclasses.dataclass
class Flight:
    """One fragment's exchange in flight."""

    fragment: int
    round: int
    due_step: int  # apply at the end of this inner step (island.step, counted over the run)
    tau: int
    future: futures.Future
