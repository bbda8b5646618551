"""The coordinator: float32 master parameters, the outer optimizer, the island view.

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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import ml_collections
import ml_dtypes
import numpy as np

from island_jax.config import fingerprint_differences, fingerprint_fields
from island_jax.outer import chunk_step, codec
from island_jax.outer import fragments as fragments_lib
from island_jax.outer.optimizer import outer_optimizer
from island_jax.params import checksum
from island_jax.planning import plan_from_step_times


class HandshakeError(ValueError):
    """An island's config fingerprint or initial checksum differs from the coordinator's."""


class ContributionError(ValueError):
    """A contribution cannot be merged (wrong round, unknown island, bad payload, NaN/Inf)."""


class StaleRoundError(ContributionError):
    """An island asked for the update of a round older than the latest merged one; it should fetch the view."""


class UpdateNotReady(LookupError):
    """The update for a round is not merged yet (some islands have not contributed)."""


@dataclass
class Contribution:
    """One island's contribution to the current round, as its chunks arrive.

    `chunks` maps a chunk index to its rows (`chunk_step.wire_to_rows`): values
    (codes) [R * block_size] and scales [R].
    """

    island: str
    tokens: int
    params_checksum: str | None = None
    chunks: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def complete(self, num_chunks: int) -> bool:
        return len(self.chunks) == num_chunks


@dataclass
class RoundRecord:
    """What the coordinator logs for a merged round."""

    round: int
    contributors: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    pseudo_gradient_norm: dict[str, float] = field(default_factory=dict)
    cosine_similarity: dict[str, float] = field(default_factory=dict)  # "a/b": cos(pg_a, pg_b)
    update_bytes: int = 0
    update_codec_relative_error: float = 0.0  # ||update sent - (master - view)|| / ||master - view||
    view_checksum: Any = ""  # of the island view after the update (or a function that computes it once)

    @property
    def checksum(self) -> str:
        """`params.checksum` of the island view after this round's update.

        Computed when first asked for; the coordinator keeps a round's view
        only until the next round is merged, so a checksum not asked for by
        then is "" (both roles read it as soon as the round is merged).
        """
        if callable(self.view_checksum):
            self.view_checksum = self.view_checksum()
        return self.view_checksum


def _check_params_checksum(island: str, theirs: str, ours: str) -> None:
    """Raises HandshakeError when an island's initial parameters differ from the coordinator's."""
    if theirs != ours:
        raise HandshakeError(
            f"island {island!r} has parameter checksum {theirs} but the coordinator has "
            f"{ours}; both must initialise from the same config.seed and model on the CPU backend"
        )


class Coordinator:
    """Holds the global state and merges islands' contributions, chunk by chunk.

    Args:
      config: the run's validated config (outer, codec, comm.chunk_bytes,
        comm.pipeline, model, seed).
      params: the seeded initial parameters (pytree of NumPy arrays, as from
        `params.init_params`); the master copy is float32, the view keeps
        the parameters' dtypes.
      islands: names of the islands expected to contribute every round.
      clock: seconds, monotonic (injectable for the quorum's grace window).

    A contribution arrives as chunks (`codec.chunk_plan` of `comm.chunk_bytes`):
    `begin_contribution`, `add_chunk` per chunk in any order, `end_contribution`;
    `contribute` does all three for a whole payload. With `comm.pipeline`, chunk
    k is merged, stepped and encoded as soon as every expected island's chunk k
    is in, and `update_chunks` serves it while later chunks still arrive;
    otherwise the whole round is merged once every contribution is complete.
    Both give the same bytes (each chunk is computed by the same program from
    the same inputs). If an island drops out after chunks that included it were
    merged (a refused chunk, a closed quorum), the round's merge restarts from
    its first chunk without it (`generation` counts restarts), so a half-merged
    update is never final.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        params: Any,
        islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.kind, self.block_size = config.codec.kind, config.codec.block_size
        self.pipeline = bool(config.comm.pipeline)
        self.islands = list(islands)
        self.fingerprint_fields = fingerprint_fields(config)
        view = jax.tree.map(lambda x: np.array(x, copy=True), params)
        self._treedef = jax.tree.structure(view)
        self._leaf_specs = [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(view)]
        self._checksum: str | None = None
        self.plan = codec.chunk_plan(view, self.kind, self.block_size, config.comm.chunk_bytes)
        self.payload_bytes = codec.payload_bytes(view, self.kind, self.block_size)
        self.layouts, self.num_rows = chunk_step.row_layouts(self.plan, self.block_size)
        self.tx = outer_optimizer(config)
        self._step = chunk_step.ChunkStep(self.tx, self.kind, self.block_size, self.num_rows)
        self._bf16_rows = [self._bf16_mask(lay) for lay in self.layouts]
        self._master = self._rows_of(params)
        self._opt = [self._step.place(self._step.init(m)) for m in self._master]
        # The island view lives in rows next to the master (the merge program updates it); `view`
        # lays it out as a pytree when asked for.
        self._view_rows = self._rows_of(view)
        self._view: Any = view
        self.round = 0
        self.generation = 0  # restarts of the current round's merge
        self.joined: set[str] = set()
        self._pending: dict[str, Contribution] = {}
        self._refused: set[str] = set()  # islands whose contribution to this round was refused (NaN, ...)
        self._dropped: set[str] = set()  # islands the quorum closed the round without
        self._quorum_since: float | None = None  # when min_islands had contributed to this round
        self.clock = clock
        self.min_islands = config.outer.min_islands or len(self.islands)
        self.grace_seconds = config.outer.grace_seconds
        self.discarded: list[tuple[int, str]] = []  # (round, island) of contributions that came too late
        self.step_seconds: dict[str, float] = {}  # median step time each island reported in round 0
        self.plan_steps: dict[str, int] = {}  # inner steps per island from round 1 on (outer.auto_from = measured)
        self._updates: dict[int, bytes] = {}
        self._work: dict | None = None  # the current round's partial merge
        self.history: list[RoundRecord] = []

    def warm_up(self) -> None:
        """Compiles the chunk program for a merge of every island now, so the first round's merge does
        not wait for XLA (an island overlapping its exchange with compute would)."""
        layout, k = self.layouts[0], len(self.islands)
        values, scales = chunk_step.wire_to_rows(
            bytes(layout.chunk.nbytes), layout, self.kind, self.block_size, self.num_rows
        )
        weights = np.full(k, np.float32(1.0 / k), np.float32)
        self._step(
            np.stack([values] * k), np.stack([scales] * k), weights, self._master[0], self._opt[0],
            self._view_rows[0], self._bf16_rows[0],
        )

    # -- state -----------------------------------------------------------------------------------------------

    def _bf16_mask(self, layout: chunk_step.RowLayout) -> np.ndarray:
        """bool [R]: the rows of `layout` that hold a bfloat16 leaf (its view is rounded to bfloat16)."""
        mask = np.zeros(self.num_rows, bool)
        for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
            dtype = self._leaf_specs[piece.leaf][1]
            if dtype == ml_dtypes.bfloat16:
                mask[row : row + -(-(piece.stop - piece.start) // self.block_size)] = True
            elif dtype != np.float32:
                raise ValueError(f"parameters of dtype {dtype} are not supported; use float32 or bfloat16")
        return mask

    def _rows_of(self, tree: Any) -> list:
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
        return [
            self._step.place(chunk_step.gather_rows(leaves, lay, self.block_size, self.num_rows)) for lay in self.layouts
        ]

    def _tree_of(self, rows: list, dtypes: bool) -> Any:
        """A pytree of NumPy arrays from per-chunk rows, in the leaves' dtypes (or float32)."""
        leaves = [np.empty(shape, dtype if dtypes else np.float32) for shape, dtype in self._leaf_specs]
        for chunk_rows, lay in zip(rows, self.layouts):
            chunk_step.scatter_rows(np.asarray(chunk_rows), lay, leaves, self.block_size)
        return jax.tree.unflatten(self._treedef, leaves)

    @property
    def view(self) -> Any:
        """The island view (what every island holds after the latest update): a pytree of NumPy arrays
        in the parameters' dtypes, laid out from the rows when first asked for after each round."""
        if self._view is None:
            self._view = self._tree_of(self._view_rows, dtypes=True)
        return self._view

    @property
    def master(self) -> Any:
        """The float32 master parameters as a pytree of NumPy arrays (a copy)."""
        return self._tree_of(self._master, dtypes=False)

    @property
    def opt_state(self) -> list:
        """The outer optimizer's state, one optax state per chunk (each over that chunk's rows)."""
        return self._opt

    def state(self) -> dict:
        """What a checkpoint holds: `master` (float32), `opt_state` (per chunk), `view` and `round` (0-d int64)."""
        return dict(master=self.master, opt_state=self._opt, view=self.view, round=np.asarray(self.round, np.int64))

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands must then join at the same round."""
        self._view = jax.tree.map(lambda x: np.array(x, copy=True), state["view"])
        self._view_rows = self._rows_of(self._view)
        self._master = self._rows_of(state["master"])
        self._opt = [self._step.place(x) for x in state["opt_state"]]
        self.round = int(state["round"])
        self._checksum = None
        self._pending, self._updates, self._refused, self._dropped, self._quorum_since = {}, {}, set(), set(), None
        self._work = None

    @property
    def checksum(self) -> str:
        """`params.checksum` of the island view, computed when first asked for after each round.

        (SHA-256 over every parameter takes a while for a large model: left out
        of the merge, it never delays an update.)
        """
        if self._checksum is None:
            self._checksum = checksum(self.view)
        return self._checksum

    # -- joining ---------------------------------------------------------------------------------------------

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Admits an island whose model, codec, seed, round and parameters match.

        Args:
          island: the island's name in `config.islands`.
          config_fingerprint: the island's `config.fingerprint_fields(config)`.
          params_checksum: `params.checksum` of the island's global parameters.
          round: the round the island will train next (0 on a fresh start; the
            checkpointed round when it resumes).

        Returns:
          {"round": the round to train next, "checksum": the view's checksum}.

        Raises:
          HandshakeError: unknown island, fingerprint fields that differ (named
            in the message), another round, or another checksum.
        """
        if island not in self.islands:
            raise HandshakeError(f"island {island!r} is not in this run's config (islands: {self.islands})")
        differences = fingerprint_differences(self.fingerprint_fields, dict(config_fingerprint))
        if differences:
            raise HandshakeError(
                f"island {island!r} differs from the coordinator in {', '.join(differences)}; model shapes, "
                "codec, block_size, chunk_bytes and seed must match: run every role with the same config and overrides"
            )
        if round != self.round:
            raise HandshakeError(
                f"island {island!r} joins at round {round} but the coordinator is at round {self.round}; restart "
                "every role from the same workdir so they resume from checkpoints of the same round"
            )
        _check_params_checksum(island, params_checksum, self.checksum)
        self.joined.add(island)
        return dict(round=self.round, checksum=self.checksum)

    # -- contributions ---------------------------------------------------------------------------------------

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str:
        """Accepts one island's whole encoded pseudo-gradient; merges when the round can close.

        A round closes when every island has contributed (or been refused), or
        when `outer.min_islands` have contributed and `outer.grace_seconds` have
        passed since they did (see `poll`), whichever comes first (Decoupled
        DiLoCo's quorum, arXiv 2604.21428). A contribution for a round that has
        already closed is discarded and logged: the island then fetches that
        round's update, which brings it to the same global parameters as
        everyone else.

        Args:
          round: the round the pseudo-gradient belongs to.
          island: a joined island's name.
          tokens: tokens the island processed this round (> 0), the merge weight.
          payload: `codec.encode(anchor - params)`, `payload_bytes` bytes.
          params_checksum: when given, the checksum of the island's anchor, which
            must equal the view's: proof that every island trained from the same bits.
          step_seconds: the island's median inner-step time this round (seconds);
            round 0's plan the later rounds with `outer.auto_from = "measured"`.

        Returns:
          "accepted", or "discarded" for a round that has already closed.

        Raises:
          ContributionError: island not joined, a future round, duplicate,
            tokens <= 0, payload of the wrong size, or NaN/Inf in the decoded
            values (logged with the island's name; the round closes without
            it). Nothing of a refused contribution reaches the merge.
        """
        if len(payload) != self.payload_bytes and round >= self.round:
            raise ContributionError(
                f"island {island!r}, round {round}: payload is {len(payload)} bytes but a {self.kind} payload for "
                f"these parameters is {self.payload_bytes} bytes; the island uses a different model shape, codec "
                "or block_size"
            )
        if self.begin_contribution(round, island, tokens, params_checksum, step_seconds) == "discarded":
            return "discarded"
        view = memoryview(payload)
        for chunk in self.plan:
            self.add_chunk(round, island, chunk.index, view[chunk.offset : chunk.offset + chunk.nbytes])
        return self.end_contribution(round, island)

    def begin_contribution(
        self,
        round: int,
        island: str,
        tokens: int,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str:
        """Opens an island's contribution to `round` (its header); "accepted" or "discarded" (round closed).

        Raises:
          ContributionError: as for `contribute` (everything but the payload).
        """
        if island not in self.joined:
            raise ContributionError(f"island {island!r} contributed before joining; call join first")
        if round < self.round or (round == self.round and island in self._dropped):
            self.discarded.append((round, island))
            logging.warning(
                "island %s's contribution to round %d arrived after the round closed (at %d); discarded",
                island, round, self.round,
            )
            return "discarded"
        if round != self.round:
            raise ContributionError(f"island {island!r} sent round {round} but the coordinator is at round {self.round}")
        if island in self._pending or island in self._refused:
            raise ContributionError(f"island {island!r} already contributed to round {round}")
        if tokens <= 0:
            raise ContributionError(f"island {island!r} reported {tokens} tokens for round {round}; it must be > 0")
        if params_checksum is not None and params_checksum != self.checksum:
            raise ContributionError(
                f"island {island!r} trained round {round} from parameters with checksum {params_checksum}, not the "
                f"global {self.checksum}; its contribution was refused (restart the island from the workdir)"
            )
        self._pending[island] = Contribution(island, int(tokens), params_checksum)
        if step_seconds and round == 0:
            self.step_seconds[island] = float(step_seconds)
        return "accepted"

    def add_chunk(self, round: int, island: str, index: int, data) -> None:
        """Takes chunk `index` of an open contribution (bytes or memoryview of `plan[index].nbytes`).

        Chunks of a round that has closed, or of an island the quorum went on
        without, are ignored. With `comm.pipeline`, merges every chunk that is
        now ready.

        Raises:
          ContributionError: no open contribution, an unknown or repeated chunk,
            a chunk of the wrong size, or NaN/Inf in its values (the island's
            whole contribution is refused and the round goes on without it).
        """
        if round < self.round or (round == self.round and island in self._dropped):
            return
        contribution = self._pending.get(island)
        if round != self.round or contribution is None:
            raise ContributionError(f"island {island!r} sent a chunk of round {round} without an open contribution")
        if not 0 <= index < len(self.plan) or index in contribution.chunks:
            raise ContributionError(
                f"island {island!r}, round {round}: chunk {index} is unknown or repeated ({len(self.plan)} chunks)"
            )
        layout = self.layouts[index]
        if len(data) != layout.chunk.nbytes:
            raise ContributionError(
                f"island {island!r}, round {round}: chunk {index} is {len(data)} bytes, expected "
                f"{layout.chunk.nbytes}; the island's comm.chunk_bytes, model or codec differs"
            )
        values, scales = chunk_step.wire_to_rows(data, layout, self.kind, self.block_size, self.num_rows)
        finite = np.isfinite(scales).all() and (self.kind in codec.QUANTIZED_KINDS or np.isfinite(values).all())
        if not finite:
            self.refuse(island, f"round {round}'s pseudo-gradient holds NaN or Inf")
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
        if island in self._dropped:
            return "discarded"
        contribution = self._pending.get(island)
        if contribution is None:
            raise ContributionError(f"island {island!r}'s contribution to round {round} was refused")
        if not contribution.complete(len(self.plan)):
            missing = sorted(set(range(len(self.plan))) - set(contribution.chunks))
            raise ContributionError(f"island {island!r}, round {round}: chunks {missing[:8]} never arrived")
        self.poll()
        return "accepted"

    def refuse(self, island: str, reason: str) -> None:
        """Drops an island's contribution to the current round (logged); the round goes on without it."""
        logging.warning("island %s: %s; refused", island, reason)
        self._pending.pop(island, None)
        self._refused.add(island)
        self._restart_if_merged_with(island)
        self.poll()

    def abandon(self, island: str, reason: str) -> None:
        """Forgets an island's open contribution to the current round (a transfer that failed); it may send again."""
        if island in self._pending:
            logging.warning("island %s: its contribution to round %d was dropped: %s", island, self.round, reason)
            del self._pending[island]
            self._restart_if_merged_with(island)

    def _expected(self) -> list[str]:
        return [n for n in self.islands if n not in self._refused and n not in self._dropped]

    def _restart_if_merged_with(self, island: str) -> None:
        if self._work is not None and island in self._work["contributors"]:
            logging.info("round %d: restarting the merge without island %s", self.round, island)
            self._work = None
            self.generation += 1

    def poll(self) -> bool:
        """Closes the round if it can (see `contribute`); call it periodically while islands are missing.

        Returns:
          Whether a round was merged.
        """
        complete = [n for n in self._expected() if n in self._pending and self._pending[n].complete(len(self.plan))]
        if not complete:
            return False
        if len(complete) == len(self._expected()):
            return self._merge_ready()
        if len(complete) >= self.min_islands:
            now = self.clock()
            if self._quorum_since is None:
                self._quorum_since = now
            if now - self._quorum_since >= self.grace_seconds:
                for name in self._expected():
                    if name not in complete:
                        self._dropped.add(name)
                        self._pending.pop(name, None)
                        self._restart_if_merged_with(name)
                return self._merge_ready()
        return False

    # -- merging ---------------------------------------------------------------------------------------------

    def _merge_ready(self) -> bool:
        """Merges every chunk that all expected islands have sent; finishes the round when all are merged."""
        expected = self._expected()
        if not expected or any(n not in self._pending for n in expected):
            return False
        contributions = [self._pending[n] for n in expected]
        if not self.pipeline and not all(c.complete(len(self.plan)) for c in contributions):
            return False
        if self._work is None:
            total = sum(c.tokens for c in contributions)
            self._work = dict(
                contributors=[c.island for c in contributions],
                weights=np.asarray([np.float32(c.tokens / total) for c in contributions], np.float32),
                master=list(self._master), opt=list(self._opt), view=list(self._view_rows),
                chunks={}, dots=0.0, intended_sq=0.0, lost_sq=0.0,
            )
        work = self._work
        for chunk in self.plan:
            k = chunk.index
            if k in work["chunks"] or not all(k in c.chunks for c in contributions):
                continue
            self._merge_chunk(k, contributions, work)
        if len(work["chunks"]) == len(self.plan):
            self._finish_round(contributions, work)
            return True
        return False

    def _merge_chunk(self, k: int, contributions: list[Contribution], work: dict) -> None:
        layout = self.layouts[k]
        values = np.stack([c.chunks[k][0] for c in contributions])
        scales = np.stack([c.chunks[k][1] for c in contributions])
        master, opt, view, codes, update_scales, stats = self._step(
            values, scales, work["weights"], work["master"][k], work["opt"][k], work["view"][k], self._bf16_rows[k]
        )
        payload = chunk_step.rows_to_wire(codes, update_scales, layout, self.kind, self.block_size)
        work["master"][k], work["opt"][k], work["view"][k], work["chunks"][k] = master, opt, view, payload
        work["dots"] = work["dots"] + stats["dots"].astype(np.float64)
        work["intended_sq"] += float(stats["intended_sq"])
        work["lost_sq"] += float(stats["lost_sq"])

    def _finish_round(self, contributions: list[Contribution], work: dict) -> None:
        chunks = [work["chunks"][k] for k in range(len(self.plan))]
        self._master, self._opt = work["master"], work["opt"]
        self._view_rows = rows = work["view"]
        self._view, self._checksum = None, None
        for record in self.history:  # a checksum nobody asked for by now is not kept (nor its rows)
            if callable(record.view_checksum):
                record.view_checksum = ""
        names = work["contributors"]
        dots = np.asarray(work["dots"], np.float64)
        norms = {n: float(np.sqrt(dots[i, i])) for i, n in enumerate(names)}
        cosine = {
            f"{p}/{q}": float(dots[i, j] / max(norms[p] * norms[q], 1e-30))
            for i, p in enumerate(names)
            for j, q in enumerate(names)
            if j > i
        }
        total = sum(c.tokens for c in contributions)
        record = RoundRecord(
            round=self.round,
            contributors=list(names),
            tokens={c.island: c.tokens for c in contributions},
            weights={c.island: c.tokens / total for c in contributions},
            pseudo_gradient_norm=norms,
            cosine_similarity=cosine,
            update_bytes=sum(len(c) for c in chunks),
            update_codec_relative_error=float(np.sqrt(work["lost_sq"]) / max(np.sqrt(work["intended_sq"]), 1e-30)),
            view_checksum=lambda: self.checksum if self._view_rows is rows else checksum(self._tree_of(rows, True)),
        )
        self.history.append(record)
        logging.info(
            "round %d merged from %s (weights %s)%s", self.round, record.contributors, record.weights,
            f"; without {sorted(set(self.islands) - set(record.contributors))}" if len(record.contributors) < len(self.islands) else "",
        )
        if self.round == 0 and self.config.outer.sync == "auto" and self.config.outer.auto_from == "measured":
            self.plan_steps = plan_from_step_times(self.config, self.step_seconds)
            logging.info("inner steps from round 1 on, from measured step times %s: %s", self.step_seconds, self.plan_steps)
        self._updates = {self.round: chunks}  # only the latest round's update is kept, chunk by chunk
        self._pending, self._refused, self._dropped, self._quorum_since, self._work = {}, set(), set(), None, None
        self.round += 1

    # -- serving ---------------------------------------------------------------------------------------------

    def update_chunks(self, round: int) -> tuple[int, dict[int, bytes], bool]:
        """What of `round`'s update exists so far: (generation, {chunk index: bytes}, whether it is final).

        A generation other than the one a reader started with means the merge
        restarted and chunks it already has are void.

        Raises:
          StaleRoundError: the round is older than the latest merged one.
        """
        if round in self._updates:
            return self.generation, dict(enumerate(self._updates[round])), True
        if round < self.round:
            raise StaleRoundError(
                f"round {round} is older than the latest merged round {self.round - 1}; rejoin from the island view"
            )
        if round > self.round or self._work is None:
            return self.generation, {}, False
        return self.generation, dict(self._work["chunks"]), False

    def fetch_update(self, round: int, island: str) -> bytes:
        """The update bytes for `round` (identical for every island).

        Raises:
          UpdateNotReady: the round has not been merged yet.
          StaleRoundError: the round is older than the latest merged one (use `fetch_view`).
        """
        if round in self._updates:
            return b"".join(self._updates[round])
        if round >= self.round:
            raise UpdateNotReady(f"round {round} is not merged yet; waiting for {sorted(set(self._expected()) - set(n for n, c in self._pending.items() if c.complete(len(self.plan))))}")
        raise StaleRoundError(
            f"island {island!r} asked for round {round}, older than the latest merged round {self.round - 1}; "
            "it rejoins from the island view (fetch_view)"
        )

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round from now on, once a measured plan exists (else None)."""
        return self.plan_steps.get(island)

    def fetch_view(self) -> tuple[int, bytes]:
        """The island view, losslessly, for an island that fell behind by more than a round.

        Returns:
          (the round the view starts, the view as a float32 "none" payload; every
          parameter dtype up to float32 survives the round trip bit for bit).
        """
        with jax.default_device(jax.devices("cpu")[0]):
            return self.round, codec.encode(self.view, "none", self.block_size)


class FragmentedCoordinator:
    """One `Coordinator` per fragment (Streaming DiLoCo, arXiv 2501.18512): the coordinator of a run.

    The parameters are split by `fragments.partition` into `outer.fragments`
    groups of whole leaves; fragment p has a `Coordinator` of its own over the
    list of its leaves, with its own master slice, outer optimizer state,
    island view, chunk plan and rounds, so fragment p's round r merges as soon
    as every island has contributed it, whatever the other fragments are doing.
    The outer step is elementwise, so F fragments give the bits one coordinator
    over the whole model would, when every fragment is synced at the same step.
    With F = 1 there is one fragment holding every leaf: plain DiLoCo.

    Args:
      config, params, islands, clock: as for `Coordinator`.

    Attributes:
      fragments: the per-fragment `Coordinator`s.
      partition: leaf indices (in `jax.tree.leaves(params)` order) of each fragment.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        params: Any,
        islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        leaves = jax.tree.leaves(params)
        self.partition = fragments_lib.partition(fragments_lib.leaf_bytes(params), config.outer.fragments)
        parts = [Coordinator(config, [leaves[i] for i in idx], islands, clock) for idx in self.partition]
        for part in parts:
            part.warm_up()
        self._setup(parts, jax.tree.structure(params))

    @classmethod
    def wrap(cls, coordinator: Any) -> "FragmentedCoordinator":
        """A one-fragment coordinator around an existing `Coordinator` (or an object with its methods)."""
        self = cls.__new__(cls)
        self.partition = [list(range(len(jax.tree.leaves(coordinator.view))))]
        self._setup([coordinator], jax.tree.structure(coordinator.view), whole=True)
        return self

    def _setup(self, parts: list, treedef, whole: bool = False) -> None:
        self.fragments = parts
        self._treedef, self._whole = treedef, whole
        first = parts[0]
        self.config, self.islands = first.config, list(first.islands)
        self._checksum: tuple[tuple, str] | None = None

    def __len__(self) -> int:
        return len(self.fragments)

    @property
    def round(self) -> int:
        """Rounds every fragment has completed (the smallest fragment round)."""
        return min(f.round for f in self.fragments)

    @property
    def view(self) -> Any:
        """The island view of every fragment, laid out as the parameters' pytree (NumPy)."""
        if self._whole:
            return self.fragments[0].view
        leaves = [None] * sum(len(idx) for idx in self.partition)
        for f, idx in zip(self.fragments, self.partition):
            for i, leaf in zip(idx, f.view):
                leaves[i] = leaf
        return jax.tree.unflatten(self._treedef, leaves)

    @property
    def checksum(self) -> str:
        """`params.checksum` of the whole island view (kept until a fragment merges again)."""
        if self._whole:
            return self.fragments[0].checksum
        key = tuple((f.round, f.generation) for f in self.fragments)
        if self._checksum is None or self._checksum[0] != key:
            self._checksum = (key, checksum(self.view))
        return self._checksum[1]

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """`Coordinator.join` for every fragment, against the checksum of the whole view.

        Raises:
          HandshakeError: unknown island, fingerprint fields that differ, another
            round (every fragment must be at it), or another checksum.
        """
        if self._whole:
            return self.fragments[0].join(island, config_fingerprint, params_checksum, round)
        rounds = {f.round for f in self.fragments}
        if len(rounds) > 1:
            raise HandshakeError(
                f"island {island!r} joins while the fragments are at rounds {sorted(rounds)}; an island can join "
                "only between rounds: restart every role from the same workdir"
            )
        first = self.fragments[0]
        first.join(island, config_fingerprint, first.checksum, round)  # island, fingerprint and round
        _check_params_checksum(island, params_checksum, self.checksum)
        for f in self.fragments[1:]:
            f.join(island, config_fingerprint, f.checksum, round)
        return dict(round=self.round, checksum=self.checksum)

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
        fragment: int = 0,
    ) -> str:
        """`Coordinator.contribute` of fragment `fragment`; the payload encodes that fragment's leaves."""
        return self.fragments[fragment].contribute(round, island, tokens, payload, params_checksum, step_seconds)

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """`Coordinator.fetch_update` of fragment `fragment`."""
        return self.fragments[fragment].fetch_update(round, island)

    def poll(self) -> bool:
        """Polls every fragment (see `Coordinator.poll`); whether any merged."""
        return any([f.poll() for f in self.fragments])

    def planned_inner_steps(self, island: str) -> int | None:
        """The measured plan, made when the last fragment of round 0 (contributed at its end) merged."""
        return self.fragments[-1].planned_inner_steps(island)

    def fetch_view(self) -> tuple[int, bytes]:
        """(the round every fragment has completed, the whole view as a float32 "none" payload)."""
        with jax.default_device(jax.devices("cpu")[0]):
            return self.round, codec.encode(self.view, "none", self.fragments[0].block_size)

    def state(self) -> dict:
        """What a checkpoint holds: `fragments`, one `Coordinator.state()` per fragment."""
        return dict(fragments=[f.state() for f in self.fragments])

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`."""
        for f, s in zip(self.fragments, state["fragments"]):
            f.load_state(s)
        self._checksum = None
