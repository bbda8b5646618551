"""One fragment's round on the coordinator: contributions as their chunks arrive, quorum, merge, update.

It knows no transport: the in-process transport and the gRPC service call these
plain methods. Per round (DiLoCo, arXiv 2311.08105, Algorithm 1):

  1. collect one contribution per island: encoded pseudo-gradient + tokens;
  2. decode each, refuse non-finite values, take the token-weighted mean;
  3. outer step (SGD with Nesterov momentum) on the master parameters;
  4. encode `master - view` once, apply those bytes to the view with the rule
     of `codec.decode_and_apply` the islands use, and serve the same bytes to
     every island. Whatever the codec loses stays in `master - view` and is
     sent in a later round, never lost.

Steps 2-4 run chunk by chunk (`codec.chunk_plan`, `outer/chunk_step.py`), as
soon as every contributing island's chunk has arrived when `comm.pipeline` is
on, so the update flows back while the contributions are still arriving.
With Streaming DiLoCo (arXiv 2501.18512) every fragment has a `Coordinator` of
its own (`FragmentedCoordinator`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np

from island_jax.config import fingerprint_fields
from island_jax.coordinator import handshake
from island_jax.coordinator.state import FragmentState
from island_jax.outer.inner_steps import plan_from_step_times
from island_jax.outer.optimizer import outer_hyperparams
from island_jax.protocol import ContributionError, ContributionHeader, StaleRoundError, UpdateNotReady


@dataclass
class Contribution:
    """One island's contribution to the current round, as its chunks arrive.

    `chunks` maps a chunk index to its rows (`chunk_step.wire_to_rows`): values
    (codes) [R * W] and scales float32, or for topk its kept values and their positions (`FragmentState.decode`).
    """

    island: str
    tokens: int
    chunks: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    ended: bool = False  # its stream(s) ended well (`end_contribution`): nothing after its chunks was refused

    def has_chunks(self, num_chunks: int) -> bool:
        return len(self.chunks) == num_chunks

    def complete(self, num_chunks: int) -> bool:
        """Every chunk is in and the contribution was closed: it may be merged into a finished round."""
        return self.ended and self.has_chunks(num_chunks)

    def check_chunk(self, round: int, index: int, nbytes: int, plan: list) -> None:
        """Raises ContributionError for an index the plan lacks or this contribution has, or a size off the plan."""
        if not 0 <= index < len(plan) or index in self.chunks:
            raise ContributionError(
                f"island {self.island!r}, round {round}: chunk {index} is unknown or repeated ({len(plan)} chunks)"
            )
        if nbytes != plan[index].nbytes:
            raise ContributionError(
                f"island {self.island!r}, round {round}: chunk {index} is {nbytes} bytes, expected "
                f"{plan[index].nbytes}; the island's comm.chunk_bytes, model or codec differs"
            )


@dataclass
class RoundRecord:
    """What the coordinator logs for a merged round (tokens are counts, weights sum to 1)."""

    round: int
    contributors: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    pseudo_gradient_norm: dict[str, float] = field(default_factory=dict)
    cosine_similarity: dict[str, float] = field(default_factory=dict)  # "a/b": cos(pg_a, pg_b)
    update_bytes: int = 0
    update_codec_relative_error: float = 0.0  # ||update sent - (master - view)|| / ||master - view||
    outer_learning_rate: float | None = None  # the outer step's learning rate (`optimizer.outer_hyperparams`)
    outer_momentum: float | None = None  # its momentum mu_r, warmed up over rounds (`optimizer.momentum_schedule`)
    view_checksum: Any = ""  # of the island view after the update (or a function that computes it once)

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the island view after this round's update.

        Computed when first asked for; the coordinator keeps a round's view
        only until the next round is merged, so a checksum not asked for by
        then is "" (both roles read it as soon as the round is merged).
        """
        if callable(self.view_checksum):
            self.view_checksum = self.view_checksum()
        return self.view_checksum


def merge_weights(contributions: list[Contribution], weighting: str) -> dict[str, float]:
    """Each contributor's weight in the round's average (`outer.weighting`); the weights sum to 1.

    "tokens": w_k = n_k / sum_j n_j, with n_k the tokens island k trained on this
    round (token-weighted merging for unequal learners, Decoupled DiLoCo, arXiv
    2604.21428). "uniform": w_k = 1 / K for K contributors (DiLoCo's average,
    arXiv 2311.08105), however many tokens each trained on.

    Raises:
      ValueError: another `weighting`, or no contributions.
    """
    if not contributions:
        raise ValueError("a merge needs at least one contribution")
    if weighting == "tokens":
        total = sum(c.tokens for c in contributions)
        return {c.island: c.tokens / total for c in contributions}
    if weighting == "uniform":
        return {c.island: 1.0 / len(contributions) for c in contributions}
    raise ValueError(f"outer.weighting is {weighting!r}; choose 'tokens' or 'uniform'")


@dataclass
class PartialMerge:
    """A round's merge in progress: the chunks merged so far, from one fixed set of contributors.

    `master`, `opt` and `view` start as the fragment's rows and optimizer states
    (one per chunk) and take each chunk's new ones as it is merged; `chunks`
    holds the update's bytes per merged chunk; `dots` [K, K] float64, and
    `intended_sq`, `lost_sq`, sum the chunks' stats for the round record.
    """

    contributors: list[str]
    shares: dict[str, float]  # `merge_weights` of the contributors (what the round record logs)
    master: list
    opt: list
    view: list
    chunks: dict[int, bytes] = field(default_factory=dict)
    dots: Any = 0.0
    intended_sq: float = 0.0
    lost_sq: float = 0.0

    @classmethod
    def start(cls, contributions: list[Contribution], state: FragmentState, weighting: str) -> "PartialMerge":
        """A merge of `contributions` (in run order) from the fragment's current rows, weighted by `merge_weights`."""
        return cls(
            contributors=[c.island for c in contributions],
            shares=merge_weights(contributions, weighting),
            master=list(state.master_rows), opt=list(state.opt), view=list(state.view_rows),
        )

    @functools.cached_property
    def weights(self) -> np.ndarray:
        """float32 [K]: `shares` in contributor order, as the merge program takes them."""
        return np.asarray([np.float32(self.shares[n]) for n in self.contributors], np.float32)

    def merge_ready(self, contributions: list[Contribution], state: FragmentState) -> bool:
        """Merges every chunk that all `contributions` hold and is not merged yet; whether all are merged."""
        for chunk in state.plan:
            k = chunk.index
            if k in self.chunks or not all(k in c.chunks for c in contributions):
                continue
            values = np.stack([c.chunks[k][0] for c in contributions])
            scales = np.stack([c.chunks[k][1] for c in contributions])
            self.master[k], self.opt[k], self.view[k], self.chunks[k], stats = state.step(
                k, values, scales, self.weights, self.master[k], self.opt[k], self.view[k]
            )
            self.dots = self.dots + stats["dots"].astype(np.float64)
            self.intended_sq += float(stats["intended_sq"])
            self.lost_sq += float(stats["lost_sq"])
        return len(self.chunks) == len(state.plan)

    def record(self, round: int, contributions: list[Contribution], view_checksum: Callable[[], str]) -> RoundRecord:
        """The round's record: tokens, weights, pseudo-gradient norms and cosines, update size and codec error,
        and the outer learning rate and momentum the step used (read from the merged optimizer state)."""
        names = self.contributors
        dots = np.asarray(self.dots, np.float64)
        norms = {n: float(np.sqrt(dots[i, i])) for i, n in enumerate(names)}
        cosine = {
            f"{p}/{q}": float(dots[i, j] / max(norms[p] * norms[q], 1e-30))
            for i, p in enumerate(names)
            for j, q in enumerate(names)
            if j > i
        }
        return RoundRecord(
            round=round,
            contributors=list(names),
            tokens={c.island: c.tokens for c in contributions},
            weights=dict(self.shares),
            pseudo_gradient_norm=norms,
            cosine_similarity=cosine,
            update_bytes=sum(len(c) for c in self.chunks.values()),
            update_codec_relative_error=float(np.sqrt(self.lost_sq) / max(np.sqrt(self.intended_sq), 1e-30)),
            **(outer_hyperparams(self.opt[0]) if self.opt else {}),  # every chunk's state stepped alike
            view_checksum=view_checksum,
        )


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
        return island in self.pending and self.pending[island].complete(num_chunks)

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


class Coordinator:
    """The coordinator of one fragment (the whole model with `outer.fragments = 1`): its rounds, chunk by chunk.

    Args: `config`, `islands` and `clock` as for `FragmentedCoordinator`; `params`
    the fragment's initial parameters (float32 or bfloat16 NumPy arrays).

    A contribution arrives as chunks: `begin_contribution`, `add_chunk` per
    chunk in any order, `end_contribution` (`contribute` does all three for a
    whole payload). With `comm.pipeline`, chunk k is merged as soon as every
    expected island's chunk k is in and `update_chunks` serves it while later
    chunks still arrive; otherwise the round is merged once every contribution
    is complete; both give the same bytes. If an island drops out after chunks
    that included it were merged (a refused chunk, a closed quorum), the merge
    restarts from the first chunk without it (`generation` counts restarts).
    """

    def __init__(
        self, config: ml_collections.ConfigDict, params: Any, islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.islands = list(islands)
        self.fingerprint_fields = fingerprint_fields(config)
        self.pipeline = bool(config.comm.pipeline)
        self.weighting = config.outer.weighting
        self._state = FragmentState(config, params)
        self.codec, self.update_codec = self._state.codec, self._state.update_codec
        # one plan both ways, each in its own codec's bytes (`codec.chunk_plan`'s `other`)
        self.plan, self.payload_bytes = self._state.plan, self._state.payload_bytes
        self.update_plan, self.update_bytes = self._state.update_plan, self._state.update_bytes
        self.quorum = Quorum(config.outer.min_islands or len(self.islands), config.outer.grace_seconds, clock)
        self.joined: set[str] = set()
        self.round = 0
        self.generation = 0  # restarts of a round's merge, counted over the run
        self.step_seconds: dict[str, float] = {}  # median step time each island reported in round 0
        self.plan_steps: dict[str, int] = {}  # inner steps per island from round 1 on (outer.auto_from = measured)
        self.history: list[RoundRecord] = []
        self._updates: dict[int, list[bytes]] = {}  # the latest merged round's update, chunk by chunk
        self._clock = clock
        self._round = RoundState(started_at=clock())  # replaced whole after each merge and on a restore
        self.held_from: int | None = None  # updates of this round and later are not served yet (`hold_updates`)

    def warm_up(self) -> None:
        """Compiles the chunk program for a merge of every island now, so the first merge never waits for XLA."""
        self._state.warm_up(len(self.islands))

    # -- state -------------------------------------------------------------------------------------------

    @property
    def view(self) -> Any:
        """The island view: a pytree of NumPy arrays in the parameters' dtypes (see `FragmentState.view`)."""
        return self._state.view

    @property
    def shapes(self) -> Any:
        """The fragment's parameters as `jax.ShapeDtypeStruct`s (`FragmentState.shapes`)."""
        return self._state.shapes

    def view_leaves(self) -> list:
        """The island view's leaves, read in place from the rows (`FragmentState.view_leaves`)."""
        return self._state.view_leaves()

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the island view (16 hex digits), computed when first asked for after each round."""
        return self._state.checksum

    @property
    def pending(self) -> dict[str, Contribution]:
        """The current round's open and complete contributions, by island."""
        return self._round.pending

    def state(self) -> dict:
        """What a checkpoint holds: `master` (float32), `opt_state` (per chunk), `view` and `round` (0-d int64)."""
        return dict(**self._state.state(), round=np.asarray(self.round, np.int64))

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands at other rounds rejoin (`FragmentedCoordinator.join`)."""
        self._state.load_state(state)
        self.round = int(state["round"])
        self._updates = {}
        self._round = RoundState(started_at=self._clock())

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Admits an island to this fragment's rounds at this fragment's round, from the same parameters;
        {"round", "checksum"} of this fragment's view. (A run's islands join through
        `FragmentedCoordinator.join`, which also admits them at other rounds.)

        Raises:
          HandshakeError: as `handshake.check_island`, another round, or another checksum.
        """
        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint)
        handshake.check_round(island, round, self.round)
        handshake.check_params_checksum(island, params_checksum, self.checksum)
        self.joined.add(island)
        return dict(round=self.round, checksum=self.checksum)

    def needs(self, island: str) -> bool:
        """Whether the current round waits for `island`: its quorum is not reached and the island has not
        contributed (so an island that joins now is admitted to this round)."""
        current = self._round
        done = current.has_complete(island, len(self.plan))
        return not done and not self.quorum.reached(current, self.islands, len(self.plan))

    def took_view(self, island: str) -> None:
        """Notes that `island` took the island view while the current round runs: the quorum then gives it
        as long as the others had (`Quorum`)."""
        self.joined.add(island)
        self._round.joined_at[island] = self._clock()

    def stalled(self) -> tuple[float, list[str]]:
        """(seconds the round has waited since its first complete contribution with its quorum not reached,
        the islands it waits for); (0, []) when it is not stalled."""
        current = self._round
        if current.first_complete_at is None or self.quorum.reached(current, self.islands, len(self.plan)):
            return 0.0, []
        waiting = current.waiting_for(self.islands, len(self.plan))
        # an island that rejoined (took the view) since is given the whole timeout from then
        since = max([current.first_complete_at, *(current.joined_at.get(n, 0.0) for n in waiting)])
        return self._clock() - since, waiting

    def hold_updates(self, round: int | None) -> None:
        """Holds back the updates of `round` and later (None: none) until called again: the coordinator serves
        no update two rounds past a checkpoint still being written."""
        self.held_from = round

    def _held(self, round: int) -> bool:
        return self.held_from is not None and round >= self.held_from

    # -- contributions -----------------------------------------------------------------------------------

    def contribute(self, header: ContributionHeader, payload: bytes) -> str:
        """One island's whole encoded pseudo-gradient (`payload_bytes` bytes): `begin_contribution`, every
        chunk's `add_chunk`, `end_contribution`. Arguments and errors as for `FragmentedCoordinator.contribute`.

        Returns:
          "accepted" (also for a contribution already in: a retry is counted once), or "discarded" for a round
          that has already closed.

        Raises:
          ContributionError: not joined, a future round, tokens <= 0, wrong size, NaN/Inf.
        """
        round, island = header.round, header.island
        if len(payload) != self.payload_bytes and round >= self.round:
            raise ContributionError(
                f"island {island!r}, round {round}: payload is {len(payload)} bytes but a {self.codec} payload for "
                f"these parameters is {self.payload_bytes} bytes; the island uses a different model shape or codec "
                "(codec.kind, block_size, topk_group, topk_k)"
            )
        status = self.begin_contribution(header)
        if status != "accepted":
            return "accepted" if status == "duplicate" else status
        view = memoryview(payload)
        for chunk in self.plan:
            self.add_chunk(round, island, chunk.index, view[chunk.offset : chunk.offset + chunk.nbytes])
        return self.end_contribution(round, island)

    def _has(self, round: int, island: str) -> bool:
        """Whether the island's whole contribution to `round` is in: complete and waiting, or merged."""
        if round == self.round:
            return self._round.has_complete(island, len(self.plan))
        merged = [r for r in self.history if r.round == round]
        return bool(merged) and island in merged[-1].contributors

    def _closed_for(self, round: int, island: str) -> bool:
        """Whether `round` closed for `island`: merged already, or the quorum went on without it."""
        return round < self.round or (round == self.round and island in self._round.dropped)

    def begin_contribution(self, header: ContributionHeader) -> str:
        """Opens an island's contribution to `header.round`: "accepted", "discarded" (round closed), or
        "duplicate" (the island's whole contribution is in already: a retry, whose chunks are ignored).

        Raises:
          ContributionError: not joined, a future round, a duplicate, tokens <= 0, or a params_checksum
            that is not the view's.
        """
        round, island, tokens, params_checksum = header.round, header.island, header.tokens, header.params_checksum
        if island not in self.joined:
            raise ContributionError(f"island {island!r} contributed before joining; call join first")
        if self._has(round, island):
            logging.info("island %s's contribution to round %d came again (a retry); counted once", island, round)
            return "duplicate"
        if self._closed_for(round, island):
            logging.warning(
                "island %s's contribution to round %d arrived after the round closed (at %d); discarded",
                island, round, self.round,
            )
            return "discarded"
        if round != self.round:
            raise ContributionError(
                f"island {island!r} sent round {round} but the coordinator is at round {self.round}"
            )
        self._round.check_new(round, island, tokens)
        if params_checksum is not None and params_checksum != self.checksum:
            raise ContributionError(
                f"island {island!r} trained round {round} from parameters with checksum {params_checksum}, not the "
                f"global {self.checksum}; its contribution was refused (restart the island from the workdir)"
            )
        self._round.pending[island] = Contribution(island, int(tokens))
        if header.step_seconds and round == 0:
            self.step_seconds[island] = float(header.step_seconds)
        return "accepted"

    def add_chunk(self, round: int, island: str, index: int, data) -> None:
        """Takes chunk `index` of an open contribution (bytes or memoryview of `plan[index].nbytes`).

        Chunks of a round that has closed, or of an island the quorum went on without, are ignored.
        With `comm.pipeline`, merges every chunk that is now ready.

        Raises:
          ContributionError: no open contribution, an unknown or repeated chunk,
            a chunk of the wrong size, or NaN/Inf in its values (the island's
            whole contribution is refused and the round goes on without it).
        """
        if self._closed_for(round, island):
            return
        contribution = self._round.pending.get(island)
        if round != self.round or contribution is None:
            raise ContributionError(f"island {island!r} sent a chunk of round {round} without an open contribution")
        contribution.check_chunk(round, index, len(data), self.plan)
        values, scales = self._state.decode(index, data)
        if not self._state.finite(values, scales):
            self._refuse(island, f"round {round}'s pseudo-gradient holds NaN or Inf")
            raise ContributionError(
                f"island {island!r}, round {round}: the pseudo-gradient holds NaN or Inf; the island diverged "
                "(lower inner.learning_rate or check its data) and its contribution was refused"
            )
        contribution.chunks[index] = (values, scales)
        if self.pipeline:
            self._merge_ready()

    def end_contribution(self, round: int, island: str) -> str:
        """Closes an island's contribution once all its chunks are in; "accepted" or "discarded".

        Raises:
          ContributionError: chunks are missing, or the contribution was refused.
        """
        if round < self.round:  # merged already (with its last chunk), or closed without it
            merged = [r for r in self.history if r.round == round]
            return "accepted" if merged and island in merged[-1].contributors else "discarded"
        if island in self._round.dropped:
            return "discarded"
        contribution = self._round.pending.get(island)
        if contribution is None:
            raise ContributionError(f"island {island!r}'s contribution to round {round} was refused")
        if not contribution.has_chunks(len(self.plan)):
            missing = sorted(set(range(len(self.plan))) - set(contribution.chunks))
            raise ContributionError(f"island {island!r}, round {round}: chunks {missing[:8]} never arrived")
        contribution.ended = True
        self.poll()
        return "accepted"

    def is_open(self, round: int, island: str) -> bool:
        """Whether `island` has an open contribution to `round` (the current one), which the other shares of an
        island of several processes join."""
        return round == self.round and island in self._round.pending and not self._closed_for(round, island)

    def forget_chunks(self, island: str, indices, reason: str) -> None:
        """Forgets chunks `indices` of an island's open contribution (one process's share, whose transfer failed:
        it sends them again), restarting the merge if it had taken any; a complete contribution is kept."""
        contribution = self._round.pending.get(island)
        if contribution is None or self._round.has_complete(island, len(self.plan)):
            return
        dropped = [k for k in indices if k in contribution.chunks]
        for k in dropped:
            del contribution.chunks[k]
        if dropped:
            logging.warning("island %s: %d chunks of its contribution to round %d were dropped: %s", island,
                            len(dropped), self.round, reason)
            self._restarted(island, self._round.forget_merge_with(island))

    def _refuse(self, island: str, reason: str) -> None:
        """Drops an island's contribution to the current round (logged); the round goes on without it."""
        logging.warning("island %s: %s; refused", island, reason)
        self._restarted(island, self._round.without(island, refused=True))
        if not self.poll() and self.pipeline:
            self._merge_ready()  # merges again, without it, the chunks the others sent

    def abandon(self, island: str, reason: str, keep_complete: bool = False) -> None:
        """Forgets an island's open contribution to the current round (a transfer that failed); it may send
        again. With `keep_complete`, a contribution whose every chunk is in is kept (a retry is then a duplicate)."""
        if keep_complete and self._round.has_complete(island, len(self.plan)):
            return
        if island in self._round.pending:
            logging.warning("island %s: its contribution to round %d was dropped: %s", island, self.round, reason)
            del self._round.pending[island]
            self._restarted(island, self._round.forget_merge_with(island))

    def _restarted(self, island: str, restarted: bool) -> None:
        """Counts a restart of the merge (a new generation, from chunk 0) after it lost `island`."""
        if restarted:
            logging.info("round %d: restarting the merge without island %s", self.round, island)
            self.generation += 1

    # -- quorum and merge --------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Closes the round if it can (every expected island is in, or the `Quorum`'s grace window has
        passed); call it periodically while islands are missing.

        Returns:
          Whether a round was merged.
        """
        current = self._round
        if current.first_complete_at is None and current.complete(self.islands, len(self.plan)):
            current.first_complete_at = self._clock()
        without = self.quorum.closing(current, self.islands, len(self.plan))
        if without is None:
            return False
        for name in without:
            self._restarted(name, self._round.without(name))
        return self._merge_ready()

    def _merge_ready(self) -> bool:
        """Merges every chunk that all expected islands have sent; finishes the round when all are merged."""
        expected = self._round.expected(self.islands)
        if not expected or any(n not in self._round.pending for n in expected):
            return False
        contributions = [self._round.pending[n] for n in expected]
        if not self.pipeline and not all(c.complete(len(self.plan)) for c in contributions):
            return False
        if self._round.merge is None:
            self._round.merge = PartialMerge.start(contributions, self._state, self.weighting)
        if not self._round.merge.merge_ready(contributions, self._state):
            return False
        if not all(c.complete(len(self.plan)) for c in contributions):  # chunks merged; their streams not ended
            return False
        self._finish_round(contributions, self._round.merge)
        return True

    def _finish_round(self, contributions: list[Contribution], merge: PartialMerge) -> None:
        state, rows = self._state, merge.view
        state.commit(merge.master, merge.opt, rows)
        for record in self.history:  # a checksum nobody asked for by now is not kept (nor its rows)
            if callable(record.view_checksum):
                record.view_checksum = ""
        record = merge.record(self.round, contributions, view_checksum=lambda: state.checksum_of(rows))
        self.history.append(record)
        missing = sorted(set(self.islands) - set(record.contributors))
        logging.info(
            "round %d merged from %s (weights %s)%s", self.round, record.contributors, record.weights,
            f"; without {missing}" if len(record.contributors) < len(self.islands) else "",
        )
        if self.round == 0 and self.config.outer.sync == "auto" and self.config.outer.auto_from == "measured":
            self.plan_steps = plan_from_step_times(self.config, self.step_seconds)
            logging.info(
                "inner steps from round 1 on, from measured step times %s: %s", self.step_seconds, self.plan_steps
            )
        self._updates = {self.round: [merge.chunks[k] for k in range(len(self.plan))]}
        self.round += 1
        self._round = RoundState(started_at=self._clock())

    # -- serving -----------------------------------------------------------------------------------------

    def update_chunks(self, round: int) -> tuple[int, dict[int, bytes], bool]:
        """What of `round`'s update exists so far: (generation, {chunk index: bytes}, whether it is final).
        A generation other than a reader's first means the merge restarted: chunks it has are void.

        Raises:
          StaleRoundError: the round is older than the latest merged one.
        """
        if self._held(round):
            return self.generation, {}, False
        if round in self._updates:
            return self.generation, dict(enumerate(self._updates[round])), True
        if round < self.round:
            raise StaleRoundError(
                f"round {round} is older than the latest merged round {self.round - 1}; rejoin from the island view"
            )
        if round > self.round or self._round.merge is None:
            return self.generation, {}, False
        return self.generation, dict(self._round.merge.chunks), False

    def fetch_update(self, round: int, island: str) -> bytes:
        """The update bytes for `round` (`payload_bytes` of them, identical for every island).

        Raises:
          UpdateNotReady: the round has not been merged yet.
          StaleRoundError: the round is older than the latest merged one (use `fetch_view`).
        """
        if self._held(round):
            raise UpdateNotReady(f"round {round}'s update waits for the coordinator's checkpoint to be complete")
        if round in self._updates:
            return b"".join(self._updates[round])
        if round >= self.round:
            waiting = self._round.waiting_for(self.islands, len(self.plan))
            raise UpdateNotReady(f"round {round} is not merged yet; waiting for {waiting}")
        raise StaleRoundError(
            f"island {island!r} asked for round {round}, older than the latest merged round {self.round - 1}; "
            "it rejoins from the island view (fetch_view)"
        )

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round from now on, once a measured plan exists (else None)."""
        return self.plan_steps.get(island)
