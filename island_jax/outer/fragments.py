"""Fragments: the parameter groups Streaming DiLoCo syncs on a staggered schedule.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512, Section 2.2) splits the
parameters into F fragments and syncs fragment p once every H inner steps, at
an offset of its own, so that only 1/F of the model is on the wire at a time.
Here a fragment is a group of whole leaves, consecutive in the stable pytree
leaf order, cut where the running byte count is nearest to p x total / F; every
fragment therefore lies within one (largest) leaf of total / F bytes.

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


def partition(sizes: Sequence[int], num_fragments: int) -> list[list[int]]:
    """Splits leaves into `num_fragments` groups of consecutive leaves, near-equal in bytes.

    Boundary g (between fragment g - 1 and g) falls after the leaf where the
    running total is nearest to g x total / F, and every fragment keeps at
    least one leaf; so each fragment's bytes lie within the largest leaf of
    total / F (a single leaf larger than total / F stays whole).

    Args:
      sizes: bytes of each leaf, in the stable leaf order (`leaf_bytes`).
      num_fragments: F >= 1.

    Returns:
      F lists of leaf indices; together they are 0 .. len(sizes) - 1 in order.

    Raises:
      ValueError: F < 1, or more fragments than leaves.
    """
    n = len(sizes)
    if num_fragments < 1 or num_fragments > n:
        raise ValueError(
            f"outer.fragments is {num_fragments} but the model has {n} parameter leaves; use 1..{n} fragments"
        )
    ends = np.cumsum(np.asarray(sizes, np.float64))
    total = float(ends[-1]) if n else 0.0
    bounds = [0]
    for g in range(1, num_fragments):
        target = g * total / num_fragments
        cut = int(np.argmin(np.abs(ends - target))) + 1  # fragment g starts after leaf `cut - 1`
        # keep every fragment non-empty: at least one leaf before, and enough left after
        cut = min(max(cut, bounds[-1] + 1), n - (num_fragments - g))
        bounds.append(cut)
    bounds.append(n)
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


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
