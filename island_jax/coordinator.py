"""The coordinator: float32 master parameters, the outer optimizer, the island view.

It knows no transport: the in-process transport and the gRPC service call these
plain methods. Per round (DiLoCo, arXiv 2311.08105, Algorithm 1):

  1. collect one contribution per island: encoded pseudo-gradient + tokens;
  2. decode each, refuse non-finite values, take the token-weighted mean;
  3. outer step (SGD with Nesterov momentum) on the master parameters;
  4. encode `master - view` once, apply those bytes to the view with the same
     `codec.decode_and_apply` the islands use, and serve the same bytes to every
     island. Whatever the codec loses stays in `master - view` and is sent in a
     later round, never lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from island_jax.config import fingerprint_differences, fingerprint_fields
from island_jax.outer import codec
from island_jax.outer.merge import weighted_mean
from island_jax.outer.optimizer import outer_optimizer, outer_step
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
    """One island's decoded pseudo-gradient for one round."""

    island: str
    tokens: int
    pseudo_gradient: Any


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
    checksum: str = ""  # of the island view after the update


class Coordinator:
    """Holds the global state and merges islands' contributions.

    Args:
      config: the run's validated config (outer, codec, model, seed).
      params: the seeded initial parameters (pytree of NumPy arrays, as from
        `params.init_params`); the master copy is float32, the view keeps
        the parameters' dtypes.
      islands: names of the islands expected to contribute every round.
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
        self.islands = list(islands)
        self.fingerprint_fields = fingerprint_fields(config)
        self.view = jax.tree.map(np.asarray, params)
        self.checksum = checksum(self.view)
        self.master = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
        self.tx = outer_optimizer(config)
        with jax.default_device(jax.devices("cpu")[0]):
            self.opt_state = jax.device_get(self.tx.init(self.master))
        self.round = 0
        self.joined: set[str] = set()
        self._pending: dict[str, Contribution] = {}
        self._refused: set[str] = set()  # islands whose contribution to this round was refused (NaN, ...)
        self._quorum_since: float | None = None  # when min_islands had contributed to this round
        self.clock = clock
        self.min_islands = config.outer.min_islands or len(self.islands)
        self.grace_seconds = config.outer.grace_seconds
        self.discarded: list[tuple[int, str]] = []  # (round, island) of contributions that came too late
        self.step_seconds: dict[str, float] = {}  # median step time each island reported in round 0
        self.plan: dict[str, int] = {}  # inner steps per island from round 1 on (outer.auto_from = measured)
        self._updates: dict[int, bytes] = {}
        self.history: list[RoundRecord] = []

    def state(self) -> dict:
        """What a checkpoint holds: `master` (float32), `opt_state`, `view` and `round` (0-d int64)."""
        return dict(master=self.master, opt_state=self.opt_state, view=self.view, round=np.asarray(self.round, np.int64))

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands must then join at the same round."""
        self.master, self.opt_state, self.view = state["master"], state["opt_state"], state["view"]
        self.round = int(state["round"])
        self.checksum = checksum(self.view)
        self._pending, self._updates, self._refused, self._quorum_since = {}, {}, set(), None

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
                "codec, block_size and seed must match: run every role with the same config and overrides"
            )
        if round != self.round:
            raise HandshakeError(
                f"island {island!r} joins at round {round} but the coordinator is at round {self.round}; restart "
                "every role from the same workdir so they resume from checkpoints of the same round"
            )
        if params_checksum != self.checksum:
            raise HandshakeError(
                f"island {island!r} has parameter checksum {params_checksum} but the coordinator has "
                f"{self.checksum}; both must initialise from the same config.seed and model on the CPU backend"
            )
        self.joined.add(island)
        return dict(round=self.round, checksum=self.checksum)

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str:
        """Accepts one island's encoded pseudo-gradient; merges when the round can close.

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
          payload: `codec.encode(anchor - params)`.
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
        if island not in self.joined:
            raise ContributionError(f"island {island!r} contributed before joining; call join first")
        if round < self.round:
            self.discarded.append((round, island))
            logging.warning(
                "island %s's contribution to round %d arrived after the round closed (at %d); discarded",
                island, round, self.round,
            )
            return "discarded"
        if round != self.round:
            raise ContributionError(f"island {island!r} sent round {round} but the coordinator is at round {self.round}")
        if island in self._pending:
            raise ContributionError(f"island {island!r} already contributed to round {round}")
        if tokens <= 0:
            raise ContributionError(f"island {island!r} reported {tokens} tokens for round {round}; it must be > 0")
        if params_checksum is not None and params_checksum != self.checksum:
            raise ContributionError(
                f"island {island!r} trained round {round} from parameters with checksum {params_checksum}, not the "
                f"global {self.checksum}; its contribution was refused (restart the island from the workdir)"
            )
        try:
            pseudo_gradient = codec.decode(payload, self.master, self.kind, self.block_size)
        except codec.CodecError as e:
            raise ContributionError(f"island {island!r}, round {round}: {e}") from e
        if not codec.all_finite(pseudo_gradient):
            self._refused.add(island)
            logging.warning("island %s: round %d's pseudo-gradient holds NaN or Inf; refused", island, round)
            self.poll()
            raise ContributionError(
                f"island {island!r}, round {round}: the pseudo-gradient holds NaN or Inf; the island diverged "
                "(lower inner.learning_rate or check its data) and its contribution was refused"
            )
        self._pending[island] = Contribution(island, int(tokens), pseudo_gradient)
        if step_seconds and round == 0:
            self.step_seconds[island] = float(step_seconds)
        self.poll()
        return "accepted"

    def poll(self) -> bool:
        """Closes the round if it can (see `contribute`); call it periodically while islands are missing.

        Returns:
          Whether a round was merged.
        """
        if not self._pending:
            return False
        if len(self._pending) + len(self._refused) >= len(self.islands):
            self._merge()
            return True
        if len(self._pending) >= self.min_islands:
            now = self.clock()
            if self._quorum_since is None:
                self._quorum_since = now
            if now - self._quorum_since >= self.grace_seconds:
                self._merge()
                return True
        return False

    def _merge(self) -> None:
        contributions = [self._pending[name] for name in self.islands if name in self._pending]
        tokens = [c.tokens for c in contributions]
        merged = weighted_mean([c.pseudo_gradient for c in contributions], tokens)
        self.master, self.opt_state = outer_step(self.tx, self.master, self.opt_state, merged)
        delta = jax.tree.map(lambda m, v: m - np.asarray(v, np.float32), self.master, self.view)
        with jax.default_device(jax.devices("cpu")[0]):
            payload = codec.encode(delta, self.kind, self.block_size)
        self.view = codec.decode_and_apply(self.view, payload, self.kind, self.block_size)
        lost = np.sqrt(sum(float(np.sum((m - np.asarray(v, np.float32)) ** 2)) for m, v in
                           zip(jax.tree.leaves(self.master), jax.tree.leaves(self.view), strict=True)))
        intended = np.sqrt(sum(float(np.sum(d * d)) for d in jax.tree.leaves(delta)))
        total = sum(tokens)
        self.checksum = checksum(self.view)
        flat = {c.island: np.concatenate([np.ravel(x) for x in jax.tree.leaves(c.pseudo_gradient)]) for c in contributions}
        norms = {k: float(np.linalg.norm(v)) for k, v in flat.items()}
        names = list(flat)
        cosine = {
            f"{p}/{q}": float(np.dot(flat[p], flat[q]) / max(norms[p] * norms[q], 1e-30))
            for i, p in enumerate(names)
            for q in names[i + 1 :]
        }
        record = RoundRecord(
            round=self.round,
            contributors=[c.island for c in contributions],
            tokens={c.island: c.tokens for c in contributions},
            weights={c.island: c.tokens / total for c in contributions},
            pseudo_gradient_norm=norms,
            cosine_similarity=cosine,
            update_bytes=len(payload),
            update_codec_relative_error=lost / max(intended, 1e-30),
            checksum=self.checksum,
        )
        self.history.append(record)
        logging.info(
            "round %d merged from %s (weights %s)%s", self.round, record.contributors, record.weights,
            f"; without {sorted(set(self.islands) - set(record.contributors))}" if len(record.contributors) < len(self.islands) else "",
        )
        if self.round == 0 and self.config.outer.sync == "auto" and self.config.outer.auto_from == "measured":
            self.plan = plan_from_step_times(self.config, self.step_seconds)
            logging.info("inner steps from round 1 on, from measured step times %s: %s", self.step_seconds, self.plan)
        self._updates = {self.round: payload}  # only the latest round's update is kept
        self._pending, self._refused, self._quorum_since = {}, set(), None
        self.round += 1

    def fetch_update(self, round: int, island: str) -> bytes:
        """The update bytes for `round` (identical for every island).

        Raises:
          UpdateNotReady: the round has not been merged yet.
          StaleRoundError: the round is older than the latest merged one (use `fetch_view`).
        """
        if round in self._updates:
            return self._updates[round]
        if round >= self.round:
            raise UpdateNotReady(f"round {round} is not merged yet; waiting for {sorted(set(self.islands) - set(self._pending))}")
        raise StaleRoundError(
            f"island {island!r} asked for round {round}, older than the latest merged round {self.round - 1}; "
            "it rejoins from the island view (fetch_view)"
        )

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round from now on, once a measured plan exists (else None)."""
        return self.plan.get(island)

    def fetch_view(self) -> tuple[int, bytes]:
        """The island view, losslessly, for an island that fell behind by more than a round.

        Returns:
          (the round the view starts, the view as a float32 "none" payload; every
          parameter dtype up to float32 survives the round trip bit for bit).
        """
        with jax.default_device(jax.devices("cpu")[0]):
            return self.round, codec.encode(self.view, "none", self.block_size)
