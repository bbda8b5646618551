"""When a fragment's round may close: the round in progress (`RoundState`) and the rule (`Quorum`).

A round closes once every expected island's contribution is complete, or once `outer.min_islands` are and
the grace window (`outer.grace_seconds`) has passed (Decoupled DiLoCo's quorum, arXiv 2604.21428), so a slow
or dead island does not stall the rest. An island refused (NaN, ...) or dropped by the quorum is no longer
expected; one that rejoined while the round ran is given as long as the others had.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from island_jax.coordinator.contribution import Contribution
from island_jax.coordinator.partial_merge import PartialMerge
from island_jax.protocol import ContributionError


@dataclass
class RoundState:
    """What a fragment's coordinator holds of the round it is merging; replaced whole when the round closes."""

    pending: dict[str, Contribution] = field(default_factory=dict)  # open or complete contributions
    refused: set[str] = field(default_factory=set)  # islands whose contribution was refused (NaN, ...)
    dropped: set[str] = field(default_factory=set)  # islands the quorum closed the round without
    quorum_since: float | None = None  # when min_islands had complete contributions (clock seconds)
    merge: PartialMerge | None = None
    started_at: float = 0.0  # when the round began: the previous round merged, or the coordinator started
    first_complete_at: float | None = None  # when the first contribution was complete (clock seconds)
    joined_at: dict[str, float] = field(default_factory=dict)  # islands that took the view while it ran

    def expected(self, islands: Sequence[str]) -> list[str]:
        """The islands the round still waits for or has: neither refused nor dropped, in run order."""
        return [n for n in islands if n not in self.refused and n not in self.dropped]

    def complete(self, islands: Sequence[str], num_chunks: int) -> list[str]:
        """The expected islands whose contribution has every chunk."""
        return [n for n in self.expected(islands) if n in self.pending and self.pending[n].complete(num_chunks)]

    def waiting_for(self, islands: Sequence[str], num_chunks: int) -> list[str]:
        """The expected islands whose contribution is missing or incomplete, sorted."""
        return sorted(set(self.expected(islands)) - set(self.complete(islands, num_chunks)))

    def without(self, island: str, refused: bool = False) -> bool:
        """Goes on without `island`'s contribution: refused (NaN, ...) or dropped by the quorum (`refused`
        False). Returns whether the merge in progress included it (it is then void, to restart)."""
        self.pending.pop(island, None)
        (self.refused if refused else self.dropped).add(island)
        return self.forget_merge_with(island)

    def forget_merge_with(self, island: str) -> bool:
        """Voids the merge in progress if it includes `island`; whether it did."""
        if self.merge is None or island not in self.merge.contributors:
            return False
        self.merge = None
        return True

    def has_complete(self, island: str, num_chunks: int) -> bool:
        """Whether `island`'s contribution is in, with every chunk."""
        return island in self.pending and self.pending[island].received(num_chunks)

    def check_new(self, round: int, island: str, tokens: int) -> None:
        """Raises ContributionError for an island that already contributed (or was refused), or tokens <= 0."""
        if island in self.pending or island in self.refused:
            raise ContributionError(f"island {island!r} already contributed to round {round}")
        if tokens <= 0:
            raise ContributionError(f"island {island!r} reported {tokens} tokens for round {round}; it must be > 0")


@dataclass
class Quorum:
    """When a round may close without the islands still missing (Decoupled DiLoCo's quorum, arXiv 2604.21428).

    A round closes once every expected island's contribution is complete, or
    once `min_islands` are and `grace_seconds` (clock seconds) have passed
    since they first were; a slow or dead island then does not stall the rest.

    An island that rejoined while the round ran (it took the island view at
    `RoundState.joined_at`) is given as long as the others had: the round
    closes without it only once as much time has passed since it joined as
    the quorum took from the round's start, plus the grace window. So a
    restarted island is not dropped from the first round it trains whole.
    """

    min_islands: int
    grace_seconds: float
    clock: Callable[[], float] = time.monotonic

    def closing(self, current: RoundState, islands: Sequence[str], num_chunks: int) -> list[str] | None:
        """None while the `current` round must wait; else the expected islands it closes without ([]: all in).

        Starts the grace window (`current.quorum_since`) when the quorum is first reached.
        """
        expected, complete = current.expected(islands), current.complete(islands, num_chunks)
        if not complete:
            return None
        if len(complete) == len(expected):
            return []
        if not self.reached(current, islands, num_chunks):
            return None
        now = self.clock()
        if current.quorum_since is None:
            current.quorum_since = now
        if now - current.quorum_since < self.grace_seconds:
            return None
        missing = [n for n in expected if n not in complete]
        took = current.quorum_since - current.started_at  # what the quorum needed of the round
        if any(now - current.joined_at[n] < took + self.grace_seconds for n in missing if n in current.joined_at):
            return None
        return missing

    def reached(self, current: RoundState, islands: Sequence[str], num_chunks: int) -> bool:
        """Whether `min_islands` contributions of the `current` round are complete (it can close without
        the rest once the grace window passes)."""
        return len(current.complete(islands, num_chunks)) >= self.min_islands
