"""A round's merge on the coordinator, chunk by chunk, and the record of the merged round.

Per chunk of the fragment's plan (DiLoCo, arXiv 2311.08105, Algorithm 1, the outer step): the contributors'
decoded pseudo-gradients, their weighted mean (`merge_weights`: by tokens, or uniform), the outer step (SGD
with Nesterov momentum) on the master rows, and the update `master - view` encoded once and applied to the
view with the rule of `codec.decode_and_apply` the islands use (`FragmentState.step`, `outer/chunk_step.py`).
Whatever the codec loses stays in `master - view` and is sent in a later round. A `PartialMerge` merges each
chunk as soon as every contributor's chunk has arrived (with `comm.pipeline`), so the update flows back while
contributions still arrive; `RoundRecord` is what the coordinator logs of the merged round.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from island_jax.coordinator.contribution import Contribution
from island_jax.coordinator.expert_merge import expert_merge_weights
from island_jax.coordinator.routing import DECIMALS, round_diagnostics
from island_jax.coordinator.state import FragmentState
from island_jax.outer.optimizer import outer_hyperparams


@dataclass
class RoundRecord:
    """What the coordinator logs for a merged round (tokens are counts, weights sum to 1)."""

    round: int
    contributors: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    # "tokens_routed": island -> [MoE layer][expert] its weight for that expert's rows (6 decimals); None: `weights`
    expert_weights: dict[str, list] | None = None
    routing: dict | None = None  # the routing diagnostics (`routing.round_diagnostics`); None: no routed counts sent
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


def merge_stats(names: list[str], dots, intended_sq: float, lost_sq: float, update_bytes: int) -> dict:
    """A round record's statistics from the merge's sums: `pseudo_gradient_norm` (sqrt of `dots`' diagonal),
    `cosine_similarity` ("a/b": dots[a, b] / (|a| |b|)), `update_bytes` and `update_codec_relative_error`
    (sqrt(lost_sq / intended_sq)); `dots` [K, K] float64 in contributor order."""
    dots = np.asarray(dots, np.float64)
    norms = {n: float(np.sqrt(dots[i, i])) for i, n in enumerate(names)} if dots.ndim == 2 else dict.fromkeys(names, 0.0)
    cosine = {
        f"{p}/{q}": float(dots[i, j] / max(norms[p] * norms[q], 1e-30)) if dots.ndim == 2 else 0.0
        for i, p in enumerate(names)
        for j, q in enumerate(names)
        if j > i
    }
    return dict(pseudo_gradient_norm=norms, cosine_similarity=cosine, update_bytes=int(update_bytes),
                update_codec_relative_error=float(np.sqrt(lost_sq) / max(np.sqrt(intended_sq), 1e-30)))


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
    experts: dict[str, np.ndarray] | None = None  # `expert_merge_weights` (float64 [L, E] each), or None: `shares`
    router_sq: dict[str, float] = field(default_factory=dict)  # island -> sum (R_k - R)^2 over its routers' rows
    router_norm_sq: float = 0.0  # sum R^2 over the merged routers' rows (`routing.round_diagnostics`)

    @classmethod
    def start(cls, contributions: list[Contribution], state: FragmentState, weighting: str,
              expert_weighting: str = "same") -> "PartialMerge":
        """A merge of `contributions` (in run order) from the fragment's current rows, weighted by `merge_weights`;
        with `expert_weighting` "tokens_routed" the routed experts' rows by `expert_merge_weights` of the
        contributions' routed counts. A round in which a contributor sent no counts (its batches held padding)
        merges its experts by `merge_weights` too, and says so in the log: nothing of a pseudo-gradient is
        dropped for want of counts."""
        experts = None
        if expert_weighting == "tokens_routed" and state.has_experts:
            missing = [c.island for c in contributions if c.routed is None]
            if missing:
                logging.warning("round merged without routed counts from %s: its experts are merged by "
                                "outer.weighting, as every other parameter", missing)
            else:
                experts = expert_merge_weights({c.island: c.routed for c in contributions})
        return cls(
            contributors=[c.island for c in contributions],
            shares=merge_weights(contributions, weighting),
            master=list(state.master_rows), opt=list(state.opt), view=list(state.view_rows),
            experts=experts,
        )

    @functools.cached_property
    def weights(self) -> np.ndarray:
        """float32 [K]: `shares` in contributor order, as the merge program takes them."""
        return np.asarray([np.float32(self.shares[n]) for n in self.contributors], np.float32)

    @functools.cached_property
    def _slot_weights(self) -> np.ndarray:
        """float32 [K, 1 + L E]: slot 0 `weights`, slot 1 + l E + e each contributor's weight for expert e of MoE
        layer l (`expert_merge.expert_slots`)."""
        per_expert = np.stack([self.experts[n].reshape(-1) for n in self.contributors]).astype(np.float32)
        return np.concatenate([self.weights[:, None], per_expert], axis=1)

    def chunk_weights(self, index: int, state: FragmentState) -> np.ndarray:
        """The weights chunk `index` is merged with: float32 [K] (`weights`), or, for a chunk holding routed
        experts' rows under "tokens_routed", [K, R] per row or [K, R * W] per element (`state.expert_slots`)."""
        slots = state.expert_slots[index]
        if self.experts is None or slots is None:
            return self.weights
        return self._slot_weights[:, slots]

    def merge_ready(self, contributions: list[Contribution], state: FragmentState) -> bool:
        """Merges every chunk that all `contributions` hold and is not merged yet; whether all are merged."""
        for k in state.owned:
            if k in self.chunks or not all(k in c.chunks for c in contributions):
                continue
            values = np.stack([c.chunks[k][0] for c in contributions])
            scales = np.stack([c.chunks[k][1] for c in contributions])
            anchor = self.view[k]
            self.master[k], self.opt[k], self.view[k], self.chunks[k], stats = state.step(
                k, values, scales, self.chunk_weights(k, state), self.master[k], self.opt[k], self.view[k]
            )
            if state.router_masks[k] is not None:
                self._router_sums(k, contributions, state, anchor)
            self.dots = self.dots + stats["dots"].astype(np.float64)
            self.intended_sq += float(stats["intended_sq"])
            self.lost_sq += float(stats["lost_sq"])
        return len(self.chunks) == len(state.owned)

    def _router_sums(self, k: int, contributions: list[Contribution], state: FragmentState, anchor) -> None:
        """Adds chunk k's router rows to `router_sq` and `router_norm_sq`: each island's router at the end of its
        round, anchor - pg_k (its contribution as decoded), against the merged view the update leads to."""
        mask = state.router_masks[k]
        merged = np.asarray(self.view[k], np.float64)[mask]
        start = np.asarray(anchor, np.float64)[mask]
        self.router_norm_sq += float(np.dot(merged, merged))
        for c in contributions:
            local = start - state.dequantized(*c.chunks[k]).astype(np.float64)[mask]
            self.router_sq[c.island] = self.router_sq.get(c.island, 0.0) + float(np.sum((local - merged) ** 2))

    def partial_stats(self) -> dict:
        """This shard's sums of the round's statistics (`shards.combine_stats` adds every shard's), as JSON."""
        return dict(dots=np.asarray(self.dots, np.float64).tolist(), intended_sq=self.intended_sq, lost_sq=self.lost_sq,
                    update_bytes=sum(len(c) for c in self.chunks.values()), router_sq=dict(self.router_sq),
                    router_norm_sq=self.router_norm_sq)

    def record(self, round: int, contributions: list[Contribution], view_checksum: Callable[[], str]) -> RoundRecord:
        """The round's record: tokens, weights, pseudo-gradient norms and cosines, update size and codec error,
        and the outer learning rate and momentum the step used (read from the merged optimizer state)."""
        return RoundRecord(
            round=round,
            contributors=list(self.contributors),
            tokens={c.island: c.tokens for c in contributions},
            weights=dict(self.shares),
            expert_weights=None if self.experts is None else {
                n: np.round(w, DECIMALS).tolist() for n, w in self.experts.items()},
            routing=round_diagnostics({c.island: c.routed for c in contributions},
                                      {c.island: c.probe for c in contributions},
                                      {c.island: c.post_sync for c in contributions}, self.router_sq,
                                      self.router_norm_sq, {c.island: c.unrouted for c in contributions}),
            **merge_stats(self.contributors, self.dots, self.intended_sq, self.lost_sq,
                          sum(len(c) for c in self.chunks.values())),
            **(outer_hyperparams(next(o for o in self.opt if o is not None))
               if any(o is not None for o in self.opt) else {}),  # every chunk's state stepped alike
            view_checksum=view_checksum,
        )
