"""Per-expert merge weights from the tokens each island routed to each expert (`outer.expert_weighting`).

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

from typing import Any, Mapping, Sequence

import jax
import numpy as np


def check_routed_counts(counts, num_layers: int, num_experts: int, tokens: int, top_k: int,
                        unrouted: int = 0) -> np.ndarray:
    """A contribution's routed counts, checked against the model and the contribution's tokens.

    Args:
      counts: integers [num_layers, num_experts] (any nested sequence or array): the assignments the island's
        router sent to each expert of each MoE layer over the steps the contribution covers, before capacity
        drops.
      num_layers: MoE layers of the model.
      num_experts: routed experts per MoE layer (`moe.num_experts`).
      tokens: tokens the contribution covers (its header's).
      top_k: experts each token is routed to (`moe.num_experts_per_token`).
      unrouted: of `tokens`, those no router saw (padding in the island's batches), in 0..tokens - 1.

    Returns:
      int64 [num_layers, num_experts], the counts.

    Raises:
      ValueError: the shape is not [num_layers, num_experts], a count is not an integer or is negative, `unrouted`
        is outside 0..tokens - 1, or a layer's counts do not sum to (tokens - unrouted) x top_k; the message
        names the layer and what was expected.
    """
    if not 0 <= unrouted < max(tokens, 1):
        raise ValueError(f"unrouted tokens are {unrouted} of the contribution's {tokens}; send 0..{tokens - 1} (the "
                         "padding positions of its batches)")
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
    routed = tokens - unrouted
    wrong = np.flatnonzero(sums != routed * top_k)
    if wrong.size:
        layer = int(wrong[0])
        of = f" ({tokens} less {unrouted} unrouted)" if unrouted else ""
        raise ValueError(f"routed counts of layer {layer} sum to {int(sums[layer])}; {routed} tokens{of} routed to "
                         f"{top_k} experts each make {routed * top_k}")
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


ROUTED_EXPERT_LEAVES = ("w_gate", "w_up", "w_down")  # an MoE layer's routed experts' weights, [E, ...] each


def _moe_leaves(params: Any, names: Sequence[str]) -> list[int | None]:
    """For each leaf of a per-layer parameter tree, the MoE layer (0-based among the model's MoE layers) whose
    `blocks.{i}.moe.{name}` it is for a name of `names`, or None."""
    moe_blocks: set = set()
    found = []
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if len(keys) == 4 and keys[0] == "blocks" and keys[2] == "moe":
            moe_blocks.add(keys[1])
        found.append(keys[1] if len(keys) == 4 and keys[0] == "blocks" and keys[2] == "moe" and keys[3] in names
                     else None)
    order = {block: layer for layer, block in enumerate(sorted(moe_blocks, key=int))}
    return [None if block is None else order[block] for block in found]


def expert_leaves(params: Any) -> list[int | None]:
    """For each leaf of a per-layer parameter tree (`stacking.unstack`'s form, `jax.tree.leaves` order), the MoE
    layer (0-based, among the model's MoE layers in layer order) whose routed experts it holds, or None.

    A routed expert leaf is `blocks.{i}.moe.{w_gate, w_up, w_down}`, shaped [E, ...]: expert e's weights are its
    slice e, elements [e S, (e + 1) S) of the flattened leaf for S = size / E. The router, routing biases and
    shared experts (`moe.shared_experts`) are not. With `model.scan_layers` the stacked leaves [U, E, ...] are
    unstacked into per-layer leaves first, so each (layer, expert) slice of a stacked leaf is one such slice.
    """
    return _moe_leaves(params, ROUTED_EXPERT_LEAVES)


def router_leaves(params: Any) -> list[int | None]:
    """For each leaf of a per-layer parameter tree, the MoE layer whose router (`blocks.{i}.moe.router`, [D, E]) it
    is, or None (what the round record's router distance measures, `coordinator/routing.py`)."""
    return _moe_leaves(params, ("router",))


def leaf_mask(leaf_layers: Sequence[int | None], layout, width: int, num_rows: int) -> np.ndarray | None:
    """bool [R * W]: the elements of one chunk's rows that belong to a leaf `leaf_layers` names (not None); None
    for a chunk with none of them."""
    pieces = [(p, row) for p, row in zip(layout.chunk.pieces, layout.row_offsets) if leaf_layers[p.leaf] is not None]
    if not pieces:
        return None
    mask = np.zeros(num_rows * width, bool)
    for piece, row in pieces:
        mask[row * width : row * width + piece.stop - piece.start] = True
    return mask


def expert_slots(leaf_layers: Sequence[int | None], leaf_sizes: Sequence[int], num_experts: int, layout,
                 width: int, num_rows: int) -> np.ndarray | None:
    """Which weight each element of one chunk's rows takes: 0 for `outer.weighting`'s, 1 + l E + e for expert e of
    MoE layer l.

    Args:
      leaf_layers: per leaf of the fragment, `expert_leaves`' MoE layer or None.
      leaf_sizes: per leaf, its elements.
      num_experts: E.
      layout: the chunk's `chunk_step.RowLayout`; width, num_rows: W and R of the rows.

    Returns:
      None for a chunk with no routed expert's elements; int32 [R] when every row lies within one expert's
      slice (each slice starts on a row: a row's weight is the slice's); int32 [R * W] otherwise (a weight per
      element). Padding takes the slot of the piece it ends, or 0 (its values are zero either way).
    """
    pieces = [(p, row) for p, row in zip(layout.chunk.pieces, layout.row_offsets) if leaf_layers[p.leaf] is not None]
    if not pieces:
        return None
    slots = np.zeros(num_rows * width, np.int32)
    for piece, row in pieces:
        per_expert = leaf_sizes[piece.leaf] // num_experts
        n = piece.stop - piece.start
        # the piece's last row is padded past its end: the padding takes the last element's slot
        element = np.minimum(np.arange(-(-n // width) * width, dtype=np.int64), n - 1) + piece.start
        start = row * width
        slots[start : start + element.size] = 1 + leaf_layers[piece.leaf] * num_experts + element // per_expert
    rows = slots.reshape(num_rows, width)
    if (rows == rows[:, :1]).all():
        return np.ascontiguousarray(rows[:, 0])
    return slots
