"""Decoder-only byte-level transformer with MoE feed-forward layers.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> MoE
-> residual), learned positions, untied output head. The model knows nothing of
rounds or islands: it only expects to run under a mesh with axes
("data", "expert"), batch split over both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from island_jax.models.moe import MoE


def _dtype(name: str):
    return jnp.dtype(name)


class Attention(nnx.Module):
    """Causal multi-head self-attention. x [B, S, D] -> [B, S, D]."""

    def __init__(self, d_model: int, num_heads: int, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        kw = dict(use_bias=False, param_dtype=param_dtype, dtype=compute_dtype, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, **kw)
        self.out = nnx.Linear(d_model, d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * self.num_heads, d // self.num_heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(b, s, d))


class Block(nnx.Module):
    """Pre-norm transformer block with an MoE feed-forward layer."""

    def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
        m, moe = config.model, config.moe
        pd, cd = _dtype(m.param_dtype), _dtype(m.compute_dtype)
        self.attn_norm = nnx.RMSNorm(m.d_model, param_dtype=pd, dtype=cd, rngs=rngs)
        self.attn = Attention(m.d_model, m.num_heads, param_dtype=pd, compute_dtype=cd, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(m.d_model, param_dtype=pd, dtype=cd, rngs=rngs)
        self.moe = MoE(
            m.d_model,
            moe.num_experts,
            moe.num_experts_per_token,
            moe.expert_hidden_dim,
            moe.capacity_factor,
            moe.renormalize,
            param_dtype=pd,
            compute_dtype=cd,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        x = x + self.attn(self.attn_norm(x))
        y, stats = self.moe(self.moe_norm(x))
        return x + y, stats


class Transformer(nnx.Module):
    """Byte-level MoE language model.

    Call: tokens [B, S] int32 (bytes 0..255) -> (logits [B, S, vocab] float32,
    stats: load_balancing_loss [] and router_z_loss [] averaged over layers,
    expert_load [num_layers, E], dropped_fraction [] averaged over layers).
    """

    def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
        m = config.model
        pd, cd = _dtype(m.param_dtype), _dtype(m.compute_dtype)
        self.embedding = nnx.Param(0.02 * jax.random.normal(rngs.params(), (m.vocab_size, m.d_model), pd))
        self.compute_dtype = cd
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (m.seq_len, m.d_model), pd))
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(m.num_layers)])
        self.final_norm = nnx.RMSNorm(m.d_model, param_dtype=pd, dtype=cd, rngs=rngs)
        # A zero output head makes the first prediction uniform: loss ln(vocab_size).
        self.head = nnx.Linear(
            m.d_model, m.vocab_size, use_bias=False, kernel_init=nnx.initializers.zeros_init(),
            param_dtype=pd, dtype=cd, rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        # A one-hot matmul rather than a gather: it keeps the batch sharding under
        # explicit mesh axes and costs little at a byte-level vocabulary.
        one_hot = jax.nn.one_hot(tokens, self.embedding.shape[0], dtype=self.compute_dtype)
        x = one_hot @ self.embedding[...].astype(self.compute_dtype)
        x = x + self.position[...][: tokens.shape[1]].astype(self.compute_dtype)
        layer_stats = []
        for block in self.blocks:
            x, stats = block(x)
            layer_stats.append(stats)
        logits = self.head(self.final_norm(x)).astype(jnp.float32)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layer_stats)
        return logits, dict(
            load_balancing_loss=jnp.mean(stacked["load_balancing_loss"]),
            router_z_loss=jnp.mean(stacked["router_z_loss"]),
            expert_load=stacked["expert_load"],
            dropped_fraction=jnp.mean(stacked["dropped_fraction"]),
        )


def partition_specs(params: nnx.State) -> dict:
    """PartitionSpec per parameter, as a pure dict shaped like `nnx.to_pure_dict(params)`.

    Expert weights are split over the `expert` mesh axis (from the `mesh_axes`
    metadata their layer attaches to the `nnx.Param`); the rest is replicated.
    """
    specs = jax.tree.map(
        lambda v: jax.P(*v.get_metadata().get("mesh_axes", ())),
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(specs)
