"""Fragments: the parameter groups Streaming DiLoCo syncs on a staggered schedule.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512, Section 2.2) splits the
parameters into F fragments and syncs fragment p once every H inner steps, at
an offset of its own, so that only 1/F of the model is on the wire at a time.
Here a fragment is a group of whole leaves, consecutive in the stable pytree
leaf order, cut where the running byte count is nearest to p x total / F; every
fragment therefore lies within one (largest) leaf of total / F bytes. The outer
loop's leaves are the per-layer form's (`model.stacking`): with
`model.scan_layers` a stacked leaf counts as its U layer slices, and the cuts
fall only between layers, so that a fragment is a range of layers, a slice of
the stacked axis (as MaxText's streaming DiLoCo cuts them), with the
embedding, final norm, head and positions, which follow the blocks, in the last.

Fragment p (0-based) of F is contributed at the end of inner step t (1-based,
counted over the whole run) with t mod H = ((p + 1) x H // F) mod H: with H = 4
and F = 2, fragment 0 after steps 2, 6, 10, ... and fragment 1 after steps 4, 8,
12, ... With F = 1 it is plain DiLoCo: the whole model after steps H, 2H, ...
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np


def leaf_bytes(tree: Any) -> list[int]:
    """Bytes of every leaf of `tree` (arrays or shape-and-dtype structs), in `jax.tree.leaves` order."""
    return [int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)]


def partition(sizes: Sequence[int], num_fragments: int, groups: Sequence | None = None) -> list[list[int]]:
    """Splits leaves into `num_fragments` groups of consecutive leaves, near-equal in bytes.

    Boundary g (between fragment g - 1 and g) falls after the unit where the
    running total is nearest to g x total / F, and every fragment keeps at
    least one unit; so each fragment's bytes lie within the largest unit of
    total / F (a single unit larger than total / F stays whole). A unit is one
    leaf, or with `groups` a run of consecutive leaves of one group (a layer's).

    Args:
      sizes: bytes of each leaf, in the stable leaf order (`leaf_bytes`).
      num_fragments: F >= 1.
      groups: per leaf, a label; fragments are cut only where it changes (None: between any two leaves).

    Returns:
      F lists of leaf indices; together they are 0 .. len(sizes) - 1 in order.

    Raises:
      ValueError: F < 1, or more fragments than units.
    """
    n = len(sizes)
    # unit starts: every leaf, or where the group label changes
    starts = [i for i in range(n) if groups is None or i == 0 or groups[i] != groups[i - 1]]
    units = len(starts)
    if num_fragments < 1 or num_fragments > units:
        what = "parameter leaves" if groups is None else "layers and other parameter leaves"
        raise ValueError(f"outer.fragments is {num_fragments} but the model has {units} {what}; use 1..{units} fragments")
    unit_sizes = np.add.reduceat(np.asarray(sizes, np.float64), starts) if n else np.zeros(0)
    ends = np.cumsum(unit_sizes)
    total = float(ends[-1]) if n else 0.0
    bounds = [0]
    for g in range(1, num_fragments):
        target = g * total / num_fragments
        cut = int(np.argmin(np.abs(ends - target))) + 1  # fragment g starts after unit `cut - 1`
        # keep every fragment non-empty: at least one unit before, and enough left after
        cut = min(max(cut, bounds[-1] + 1), units - (num_fragments - g))
        bounds.append(cut)
    leaf_bounds = [starts[b] for b in bounds] + [n]
    return [list(range(a, b)) for a, b in zip(leaf_bounds[:-1], leaf_bounds[1:])]


def partition_params(params: Any, num_fragments: int, by_layer: bool) -> list[list[int]]:
    """`partition` of a parameter tree's leaves by their bytes: the one rule islands and coordinator share.

    Args:
      params: the per-layer form's tree (`model.stacking.unstack`) of arrays or shape structs.
      num_fragments: F.
      by_layer: cut only between layers (`model.scan_layers`: a fragment is then a range of layers, slices of
        the stacked axis); the leaves of block i (`blocks.{i}`) are one unit, each other leaf one of its own.

    Returns:
      F lists of leaf indices in `jax.tree.leaves(params)` order (`partition`).
    """
    groups = None
    if by_layer:
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        groups = [(path[0].key, path[1].key) if getattr(path[0], "key", None) == "blocks" else i
                  for i, path in enumerate(paths)]
    return partition(leaf_bytes(params), num_fragments, groups)


def contribution_step(p: int, inner_steps: int, num_fragments: int) -> int:
    """Inner step of a round (1..H) after which fragment p is contributed: ((p + 1) x H // F), H for the last.

    Raises:
      ValueError: H < F (two fragments would share a step, or one fall on step 0).
    """
    if inner_steps < num_fragments:
        raise ValueError(
            f"{num_fragments} fragments need at least as many inner steps per round, but H = {inner_steps}; "
            "lower outer.fragments or raise the island's inner_steps"
        )
    return (p + 1) * inner_steps // num_fragments


def last_contributions(step: int, inner_steps: int, num_fragments: int, first_round: int, timed: bool) -> list[int]:
    """Each fragment's step at its last contribution, for an island that starts at `first_round` (a round
    boundary, inner step `step`): by steps, fragment p was contributed `contribution_step(p)` steps into the
    round before, so its first contribution here weighs as many tokens as in a run never stopped; at round 0, or
    by time (`timed`), `step`."""
    if first_round == 0 or timed:
        return [step] * num_fragments
    return [step - inner_steps + contribution_step(p, inner_steps, num_fragments) for p in range(num_fragments)]


def due_fragments(step: int, inner_steps: int, num_fragments: int) -> list[int]:
    """Fragments contributed at the end of inner step `step` (1-based, over the run) under `sync = steps`.

    Raises:
      ValueError: H < F (see `contribution_step`).
    """
    offset = (step - 1) % inner_steps + 1
    return [p for p in range(num_fragments) if contribution_step(p, inner_steps, num_fragments) == offset]


def auto_overlap_steps(exchange_seconds: float, step_seconds: float, max_steps: int) -> int:
    """The overlap tau (`outer.overlap_steps = "auto"`) that hides an exchange behind compute.

    tau = ceil(exchange / step) + 1 (one step of margin for jitter), clipped to
    1 .. max_steps (0 when max_steps is 0; a fragment's update must land before its next contribution).

    Args:
      exchange_seconds: from a contribution leaving to its update decoded, seconds.
      step_seconds: one inner step, seconds (> 0).
      max_steps: the largest tau allowed (H - 1 under `sync = steps`).

    Returns:
      tau, inner steps.
    """
    tau = math.ceil(exchange_seconds / step_seconds) + 1 if step_seconds > 0 else 1
    return int(min(max(tau, 1), max(max_steps, 0)))
