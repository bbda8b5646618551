"""DiLoCo's outer step over whole pytrees, in NumPy: the one page that shows Algorithm 1's outer loop whole.

DiLoCo (Douillard et al., arXiv 2311.08105), Algorithm 1, after each island's H inner steps:
  line 12  Δ = Σ_k w_k Δ_k: island k's pseudo-gradient Δ_k = θ^(t-1) - θ_k^(t), as its contribution codec
           carries it (`received`), weighted by w_k = n_k / Σ_j n_j tokens, or 1 / K as in the paper (`weights`);
  line 14  θ^(t) = OuterOpt(θ^(t-1), Δ): SGD with Nesterov momentum on the float32 master, as optax's `sgd` in
           `optimizer.outer_optimizer` does it:  m ← Δ + μ_r m,  θ ← θ - lr (Δ + μ_r m)  (`outer_step`);
then every island gets one update, master - view in the update codec (`sent`), and the island view, what every
island holds, takes it (`island_view`); what the codec loses stays in master - view and is sent later.

The coordinator runs this chunk by chunk in rows, in XLA (`chunk_step.py`, `coordinator/`);
tests/test_reference.py holds the two equal. Here every operation rounds once to float32, as NumPy does; in
the chunk program XLA may fuse a multiply and an add into one multiply-add (one rounding), and divides by the
constant max code as a multiplication by its reciprocal, so the two agree to the last bits the test states.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import ml_dtypes
import numpy as np

from island_jax.outer import codec
from island_jax.outer.codec import blocks


def received(pseudo_gradient: Any, fmt: codec.Codec) -> Any:
    """An island's pseudo-gradient Δ_k (a float32 tree) as the coordinator reads it: its `fmt` payload decoded."""
    return codec.decode(codec.encode(pseudo_gradient, fmt), pseudo_gradient, fmt)


def weights(tokens: Sequence[int], weighting: str = "tokens") -> list[np.float32]:
    """Line 12's w_k (`outer.weighting`): n_k / Σ_j n_j for the tokens n_k island k trained on, or 1 / K."""
    return [np.float32(n / sum(tokens) if weighting == "tokens" else 1.0 / len(tokens)) for n in tokens]


def sent(delta: np.ndarray, fmt: codec.Codec) -> np.ndarray:
    """What a dense update codec carries of master - view `delta` (float32): itself (none), its bfloat16
    rounding, or blockwise code x scale (int8, int4: `codec.blocks`, blocks from the leaf's first element)."""
    if fmt.kind == "none":
        return delta
    if fmt.kind == "bf16":
        return delta.astype(ml_dtypes.bfloat16).astype(np.float32)
    if fmt.kind not in codec.QUANTIZED_KINDS:
        raise ValueError(f"the reference outer step covers the dense update codecs, not {fmt}")
    codes, scales = blocks.quantize_blocks(delta.reshape(-1), fmt.block_size, codec.MAX_CODE[fmt.kind])
    return blocks.dequantize_blocks(codes, scales, fmt.block_size).reshape(delta.shape)


def outer_step(master: Any, m: Any, view: Any, pseudo_gradients: list, w: Sequence[np.float32], lr: float,
               mu: np.float32, update_codec: codec.Codec) -> tuple[Any, Any, Any]:
    """One round: lines 12 and 14, and the update. Returns (master θ, momentum m, the update sent), float32 trees.

    Args:
      master, m: θ^(t-1) and the momentum, float32 trees; view: the island view (the parameters' dtypes).
      pseudo_gradients: the K islands' `received` Δ_k, in island order; w: their `weights`.
      lr: `outer.learning_rate`; mu: the round's momentum μ_r (float32, `optimizer.momentum_schedule`).
      update_codec: the update's codec (a dense kind).
    """
    tree, lr, mu = jax.tree.map, np.float32(lr), np.float32(mu)
    delta = tree(np.zeros_like, pseudo_gradients[0])
    for w_k, delta_k in zip(w, pseudo_gradients):  # line 12: Δ = Σ_k w_k Δ_k, in island order
        delta = tree(lambda total, d: total + w_k * d, delta, delta_k)
    m = tree(lambda d, m: d + mu * m, delta, m)  # line 14, Nesterov: m ← Δ + μ_r m
    master = tree(lambda p, d, m: p + -lr * (d + mu * m), master, delta, m)  # θ ← θ - lr (Δ + μ_r m)
    update = tree(lambda p, v: sent(p - v.astype(np.float32), update_codec), master, view)
    return master, m, update


def island_view(view: Any, update: Any) -> Any:
    """The island view after the update: view + update in float32, cast back to each leaf's dtype (the rule of
    `codec.decode_and_apply` that every island applies)."""
    return jax.tree.map(lambda v, u: (v.astype(np.float32) + u).astype(v.dtype), view, update)


def init(params: Any) -> tuple[Any, Any, Any]:
    """(master, momentum, view) at the start: the parameters in float32, zeros, and the parameters themselves."""
    master = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
    return master, jax.tree.map(np.zeros_like, master), jax.tree.map(np.asarray, params)
