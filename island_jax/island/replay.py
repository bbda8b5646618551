"""Replay: a restarted island recomputes the rounds it missed, to the bits of the run that was not interrupted.

An island restarted from its checkpoint of round c, behind the run (the coordinator at round T > c), is given at
its join the coordinator's records of the rounds it kept (`coordinator.replay.KeptUpdates`): per round and
fragment, the tokens and tau of the island's contribution as merged and the SHA-256 of each of its chunks. With
`outer.rejoin = "replay"` it trains rounds c + 1..T again from its own restored state and data position, by the
same code as the first time (`StreamingSync`), with two differences for a kept (round, fragment):

- the contribution is encoded (so error feedback's residual moves as it did) and its chunks' digests are
  compared with the record; nothing is sent. A digest that differs, or a round merged without the island (a
  quorum went on while it was dead), ends the replay (`ReplayEnded`, a `StaleRoundError`): the island takes the
  coordinator's view, as `outer.rejoin = "view"` does at once, and says why.
- the update is the kept one (`Transport.fetch_update` of a past round is served from them to a replaying
  island), applied at the same step with the same tau and mixing.

Each kept round's inner steps (`tokens // tokens_per_step` of each fragment's contribution) and, under
`outer.overlap_steps = "auto"`, its tau come from the record, not from a clock, so rounds first run under
`outer.sync = "time"` or a measured plan replay alike.
"""

from __future__ import annotations

from absl import logging

from island_jax.protocol import ContributionHeader, StaleRoundError, chunk_digest


class ReplayEnded(StaleRoundError):
    """A replay stopped before the run's round: a recomputed contribution's digest differs from the one merged,
    or the round was merged without the island. The island takes the view (`StreamingSync` rejoins)."""


def short_reason(message: str) -> str:
    """The short form of why a replay ended ("digest mismatch at round R", "round R merged without it"): a
    `ReplayEnded` message's text before its first ": ", less the prefix an island of several processes adds."""
    if message.startswith("process ") and " of the island: " in message:
        message = message.split(" of the island: ", 1)[1]
    return message.split(": ", 1)[0]


class ReplayPlan:
    """The rounds an island replays, from the coordinator's kept records (`KeptUpdates.records`).

    Args:
      records: the join reply's "kept" list.
      start: the round the island replays from (its checkpoint's: rounds completed).
      target: the round it was admitted at (the run's); rounds before it are replayed.
      fragments: F.
      tokens_per_step: the island's tokens per inner step (a record's steps are its tokens // this).

    Attributes:
      kept: {(round, fragment): record}.
    """

    def __init__(self, records: list[dict], start: int, target: int, fragments: int, tokens_per_step: int):
        self.kept = {(r["round"], r["fragment"]): r for r in records}
        self.start, self.target, self.fragments, self.tokens_per_step = start, target, fragments, tokens_per_step

    @staticmethod
    def starts(records: list[dict], candidates: list[int], target: int, fragments: int) -> list[int]:
        """The `candidates` (checkpoint rounds) a replay up to `target` may start from, in their order: one with
        a round to replay, merged with the island, and every round kept from it up to `target` or up to one
        merged without the island (`covers`); or one at `target` itself when a fragment is kept at or past it (the
        fragments were at different rounds, so the island's own state there is not the view)."""
        merged_with = {(k["round"], k["fragment"]) for k in records if k["merged_with"]}
        ahead = any(k["round"] >= target for k in records)
        return [c for c in candidates if ReplayPlan.covers(records, c, target, fragments)
                and (c < target and all((c, p) in merged_with for p in range(fragments)) or c == target and ahead)]

    @staticmethod
    def covers(records: list[dict], start: int, target: int, fragments: int) -> bool:
        """Whether `records` hold every fragment's round from `start` up to (not including) `target`, or up to a
        round merged without the island (where the replay ends anyway)."""
        kept = {(r["round"], r["fragment"]): r for r in records}
        for r in range(start, target):
            if not all((r, p) in kept for p in range(fragments)):
                return False
            if not all(kept[(r, p)]["merged_with"] for p in range(fragments)):
                return True
        return True

    def has(self, round: int, fragment: int) -> bool:
        return (round, fragment) in self.kept

    def whole_round(self, round: int) -> bool:
        """Every fragment of `round` is kept: its steps and contribution moments come from the records."""
        return all((round, p) in self.kept for p in range(self.fragments))

    def steps(self, round: int, fragment: int) -> int:
        """Inner steps the island trained between its last contribution of `fragment` and this one."""
        return max(int(self.kept[(round, fragment)]["tokens"]) // self.tokens_per_step, 1)

    def tau(self, round: int, fragment: int) -> int | None:
        """The tau recorded with the contribution (None: the config's fixed tau was used)."""
        return self.kept[(round, fragment)].get("tau")

    def due(self, round: int, step: int, last: list[int], contributed: set[int]) -> list[int]:
        """The fragments of a whole kept `round` to contribute at inner step `step` (over the run): those whose
        recorded steps since their last contribution (`last[p]`, the step of it) have run."""
        return [p for p in range(self.fragments)
                if p not in contributed and step - last[p] >= self.steps(round, p)]

    def round_steps(self, round: int, step: int, last: list[int]) -> int:
        """Inner steps of a whole kept `round` that starts at inner step `step`: up to its last contribution."""
        return max(last[p] + self.steps(round, p) for p in range(self.fragments)) - step

    def check(self, header: ContributionHeader, chunks: dict[int, str]) -> None:
        """Compares a recomputed contribution (`chunks`: index -> SHA-256 of this process's chunks) with the one
        merged.

        Raises:
          ReplayEnded: the round was merged without the island, or its tokens or a chunk's digest differ.
        """
        round, fragment = header.round, header.fragment
        record = self.kept[(round, fragment)]
        where = f"round {round + 1}" + (f" fragment {fragment}" if self.fragments > 1 else "")
        if not record["merged_with"]:
            raise ReplayEnded(f"{where} merged without it: a quorum went on while island {header.island} was away, "
                              "so no uninterrupted run exists to match from there")
        if int(record["tokens"]) != header.tokens:
            raise ReplayEnded(f"digest mismatch at {where}: {header.tokens} tokens recomputed, {record['tokens']} "
                              "merged")
        merged = record["chunks"]
        differ = [k for k, d in chunks.items() if merged.get(str(k)) != d]
        if differ:
            raise ReplayEnded(f"digest mismatch at {where}: {len(differ)} of {len(chunks)} chunks differ from "
                              f"the contribution merged (first: chunk {differ[0]}); another machine or library "
                              "version computes other bits")


def chunk_digests(encoder) -> dict[int, str]:
    """`protocol.chunk_digest` of each chunk of a `codec.ChunkEncoder` (this process's share, every chunk encoded
    in order, so that error feedback's residual moves as when it is sent)."""
    return {chunk.index: chunk_digest(*encoder.chunk(chunk.index)) for chunk in encoder.plan}


class ReplayTransport:
    """The island's transport during a replay: a kept (round, fragment)'s contribution is checked against its
    record (`ReplayPlan.check`) instead of sent; everything else goes to `transport`, whose fetches of kept
    rounds the coordinator serves from what it kept."""

    def __init__(self, transport, plan: ReplayPlan):
        self.transport, self.plan = transport, plan

    def __getattr__(self, name):
        return getattr(self.transport, name)

    def contribute(self, header: ContributionHeader, payload) -> str:
        if not self.plan.has(header.round, header.fragment):
            return self.transport.contribute(header, payload)
        if isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError("a replayed contribution is checked chunk by chunk: pass the codec.ChunkEncoder")
        self.plan.check(header, chunk_digests(payload))
        logging.info("island %s: round %d%s recomputed to the bits merged", header.island, header.round + 1,
                     f" fragment {header.fragment}" if self.plan.fragments > 1 else "")
        return "duplicate"
