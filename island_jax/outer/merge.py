"""Token-weighted merge of islands' pseudo-gradients."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np


def weighted_mean(pseudo_gradients: Sequence[Any], tokens: Sequence[int]) -> Any:
    """Mean of pseudo-gradients weighted by the tokens each island processed.

    merged = sum_i t_i * g_i / sum_i t_i (float32, on the host), so an island
    that saw twice the tokens counts twice.

    Args:
      pseudo_gradients: one pytree of float arrays per contributing island, all
        with the same structure and shapes.
      tokens: tokens processed by each island this round (same order), > 0.

    Returns:
      A pytree of float32 NumPy arrays.

    Raises:
      ValueError: if the lists differ in length, are empty, or a count is <= 0.
    """
    if len(pseudo_gradients) != len(tokens) or not tokens:
        raise ValueError(f"got {len(pseudo_gradients)} pseudo-gradients and {len(tokens)} token counts")
    if any(t <= 0 for t in tokens):
        raise ValueError(f"token counts must be positive, got {list(tokens)}")
    total = float(sum(tokens))
    weights = [np.float32(t / total) for t in tokens]

    def combine(*leaves):
        acc = np.zeros(np.shape(leaves[0]), np.float32)
        for w, leaf in zip(weights, leaves):
            acc += w * np.asarray(leaf, np.float32)
        return acc

    return jax.tree.map(combine, *pseudo_gradients)
