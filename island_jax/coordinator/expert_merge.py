"""Per-expert merge weights from the tokens each island routed to each expert (no config selects them yet).

Merged this way, the rows of a routed expert (its `w_gate`, `w_up` and `w_down` in one MoE layer) are
merged with weights proportional to the assignments each contributing island routed to that expert over the
contribution's steps; every other leaf keeps `outer.weighting`'s per-island weights (`merge_weights`). For
island k, MoE layer l and expert e, with c_k[l, e] its routed assignments (before capacity drops):

    w_k[l, e] = c_k[l, e] / sum_j c_j[l, e]        (0 for every k where sum_j c_j[l, e] = 0)

so an island that routed nothing to an expert contributes nothing to it, and an expert no island routed to
gets a zero pseudo-gradient: its update is the outer optimizer's step on zero (momentum alone). Counts
proportional to the islands' tokens give exactly the "tokens" weights: both are a correctly rounded float64
quotient of the same rational number. docs/moe.md derives the rule.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def check_routed_counts(counts, num_layers: int, num_experts: int, tokens: int, top_k: int) -> np.ndarray:
    """A contribution's routed counts, checked against the model and the contribution's tokens.

    Args:
      counts: integers [num_layers, num_experts] (any nested sequence or array): the assignments the island's
        router sent to each expert of each MoE layer over the steps the contribution covers, before capacity
        drops.
      num_layers: MoE layers of the model.
      num_experts: routed experts per MoE layer (`moe.num_experts`).
      tokens: tokens the contribution covers (its header's).
      top_k: experts each token is routed to (`moe.num_experts_per_token`).

    Returns:
      int64 [num_layers, num_experts], the counts.

    Raises:
      ValueError: the shape is not [num_layers, num_experts], a count is not an integer or is negative, or a
        layer's counts do not sum to tokens x top_k; the message names the layer and what was expected.
    """
    array = np.asarray(counts)
    if array.shape != (num_layers, num_experts):
        raise ValueError(f"routed counts have shape {list(array.shape)}; the model has {num_layers} MoE layers of "
                         f"{num_experts} experts: send [{num_layers}, {num_experts}] integers")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"routed counts are {array.dtype}; send integers (assignments per expert)")
    array = array.astype(np.int64)
    if (array < 0).any():
        layer, expert = (int(i) for i in np.argwhere(array < 0)[0])
        raise ValueError(f"routed count of layer {layer}, expert {expert} is {int(array[layer, expert])}; counts are "
                         "assignments and cannot be negative")
    sums = array.sum(axis=1)
    wrong = np.flatnonzero(sums != tokens * top_k)
    if wrong.size:
        layer = int(wrong[0])
        raise ValueError(f"routed counts of layer {layer} sum to {int(sums[layer])}; {tokens} tokens routed to "
                         f"{top_k} experts each make {tokens * top_k}")
    return array


def expert_merge_weights(routed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each contributor's weight for each routed expert: w_k[l, e] = c_k[l, e] / sum_j c_j[l, e].

    Args:
      routed: island name -> int [num_layers, num_experts] routed counts (`check_routed_counts`), every island
        the same shape, in the merge's contributor order.

    Returns:
      island name -> float64 [num_layers, num_experts], in `routed`'s order. For each (l, e) the weights sum to
      1, or are all 0 where no island routed to expert e of layer l.

    Raises:
      ValueError: no contributors, or counts of different shapes.
    """
    if not routed:
        raise ValueError("a merge needs at least one contribution")
    shapes = {name: np.shape(c) for name, c in routed.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"routed counts of different shapes {shapes}; every island runs the same model")
    counts = {name: np.asarray(c, np.int64) for name, c in routed.items()}
    total = sum(counts.values())
    # integer counts divided in float64: correctly rounded, so equal ratios give equal bits
    safe = np.where(total > 0, total, 1).astype(np.float64)
    return {name: np.where(total > 0, c.astype(np.float64) / safe, 0.0) for name, c in counts.items()}
