"""Expert-parallel Mixture-of-Experts feed-forward layer under `jax.shard_map`.

Routing follows Switch Transformer (arXiv 2101.03961) generalised to top-k:
a float32 router gives softmax probabilities over E experts, each token goes to
its k most probable experts. Inside each shard, assignments are sorted by expert
(stably, so earlier tokens win) into fixed-capacity buckets of C slots;
assignments past capacity are dropped (the token keeps its residual). Buckets
travel to the devices that own their experts with `jax.lax.all_to_all` over the
`expert` mesh axis, the local experts (SwiGLU) run as one batched einsum over
the buckets, and a second `all_to_all` brings the outputs home for the
probability-weighted combine.

Auxiliary losses, with statistics summed over the whole island batch (every
device of the mesh) before the product:
  load_balancing_loss = E * sum_i f_i * P_i   (Switch Transformer eq. 4)
     f_i: share of the top-k assignments routed to expert i (before drops),
     P_i: mean router probability of expert i.
  router_z_loss = mean over tokens of logsumexp(router logits)^2   (ST-MoE eq. 5)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "expert")  # the batch is split over both mesh axes
EXPERT_AXIS = "expert"


def capacity(tokens_per_shard: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert in each shard's buckets.

    C = ceil(capacity_factor * tokens_per_shard * k / num_experts), from static
    shapes only, clamped to tokens_per_shard (an expert can receive each token at
    most once, so more slots could never be filled). capacity_factor <= 0 means
    dropless: C = tokens_per_shard.
    """
    if capacity_factor <= 0:
        return tokens_per_shard
    c = math.ceil(capacity_factor * tokens_per_shard * k / num_experts)
    return max(1, min(c, tokens_per_shard))


def _moe_shard(x, router, w_gate, w_up, w_down, *, k, capacity_factor, renormalize, compute_dtype):
    """Per-device body. x: [b, s, d] local batch; w_*: [E_local, ...] local experts."""
    b, s, d = x.shape
    num_experts = router.shape[1]
    num_shards = jax.lax.axis_size(BATCH_AXES)
    ep = jax.lax.axis_size(EXPERT_AXIS)
    tokens = b * s
    cap = capacity(tokens, num_experts, k, capacity_factor)

    xt = x.reshape(tokens, d)
    logits = jnp.dot(xt.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_e = jax.lax.top_k(probs, k)  # [T, k]
    if renormalize:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)

    # Island-wide routing statistics (sums over every shard of the batch).
    island_tokens = tokens * num_shards
    local_counts = jnp.sum(jax.nn.one_hot(top_e, num_experts, dtype=jnp.int32), axis=(0, 1))  # [E]
    load = jax.lax.psum(local_counts, BATCH_AXES).astype(jnp.float32) / (island_tokens * k)
    mean_prob = jax.lax.psum(jnp.sum(probs, axis=0), BATCH_AXES) / island_tokens
    load_balancing_loss = num_experts * jnp.sum(load * mean_prob)
    z = jax.nn.logsumexp(logits, axis=-1)
    router_z_loss = jax.lax.psum(jnp.sum(z * z), BATCH_AXES) / island_tokens

    # Sort assignments (token-major, so earlier tokens come first) by expert and
    # give each its position inside the expert's bucket.
    flat_e = top_e.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_e, stable=True)
    starts = jnp.cumsum(local_counts) - local_counts  # first sorted index of each expert
    rank_sorted = jnp.arange(tokens * k) - starts[flat_e[order]]
    position = jnp.zeros_like(flat_e).at[order].set(rank_sorted)
    kept = position < cap
    dump = num_experts * cap  # index of an all-zero row for dropped assignments
    slot = jnp.where(kept, flat_e * cap + position, dump)  # [T*k]
    dropped = jax.lax.psum(jnp.sum(~kept), BATCH_AXES).astype(jnp.float32) / (island_tokens * k)

    # Gather tokens into buckets [E, C, d]; empty slots read the zero row.
    slot_token = jnp.full((dump + 1,), tokens, jnp.int32).at[slot].set(jnp.arange(tokens * k) // k)
    x_pad = jnp.concatenate([xt, jnp.zeros((1, d), xt.dtype)]).astype(compute_dtype)
    buckets = x_pad[slot_token[:dump]].reshape(num_experts, cap, d)

    # To the experts' owners: [E, C, d] -> [ep (source shard) * E_local, C, d].
    received = jax.lax.all_to_all(buckets, EXPERT_AXIS, 0, 0, tiled=True)
    received = received.reshape(ep, num_experts // ep, cap, d)
    gate = jnp.einsum("secd,edf->secf", received, w_gate.astype(compute_dtype))
    up = jnp.einsum("secd,edf->secf", received, w_up.astype(compute_dtype))
    y = jnp.einsum("secf,efd->secd", jax.nn.silu(gate) * up, w_down.astype(compute_dtype))
    # Back home: [ep * E_local, C, d] -> [E, C, d] in global expert order.
    y = jax.lax.all_to_all(y.reshape(num_experts, cap, d), EXPERT_AXIS, 0, 0, tiled=True)

    y_pad = jnp.concatenate([y.reshape(dump, d), jnp.zeros((1, d), y.dtype)])
    per_assignment = y_pad[slot].reshape(tokens, k, d).astype(jnp.float32)
    out = jnp.einsum("tkd,tk->td", per_assignment, top_w).astype(x.dtype)
    stats = dict(
        load_balancing_loss=load_balancing_loss,
        router_z_loss=router_z_loss,
        expert_load=load,
        dropped_fraction=dropped,
    )
    return out.reshape(b, s, d), stats


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts, expert-parallel over the `expert` mesh axis.

    Must be called under a mesh (`jax.set_mesh`) with axes ("data", "expert");
    a 1 x 1 mesh runs it on one device.

    Args:
      d_model: model width D.
      num_experts: E, divisible by the mesh's expert axis.
      num_experts_per_token: k (top-k).
      expert_hidden_dim: F, SwiGLU hidden width of each expert.
      capacity_factor: see `capacity`.
      renormalize: rescale the k router weights of a token to sum to 1.
      param_dtype, compute_dtype: dtypes of the expert weights and matmuls
        (the router always computes in float32).

    Call: x [B, S, D] (B divisible by data x expert) -> (y [B, S, D],
      stats dict: load_balancing_loss [], router_z_loss [], expert_load [E]
      (fraction of assignments per expert), dropped_fraction []).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        num_experts_per_token: int,
        expert_hidden_dim: int,
        capacity_factor: float,
        renormalize: bool,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
        e, d, f = num_experts, d_model, expert_hidden_dim
        self.router = nnx.Param(init(rngs.params(), (d, e), jnp.float32))
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, f), param_dtype), mesh_axes=(EXPERT_AXIS, None, None))
        self.w_up = nnx.Param(init(rngs.params(), (e, d, f), param_dtype), mesh_axes=(EXPERT_AXIS, None, None))
        self.w_down = nnx.Param(init(rngs.params(), (e, f, d), param_dtype), mesh_axes=(EXPERT_AXIS, None, None))
        self.k = num_experts_per_token
        self.capacity_factor = capacity_factor
        self.renormalize = renormalize
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        body = lambda *args: _moe_shard(
            *args,
            k=self.k,
            capacity_factor=self.capacity_factor,
            renormalize=self.renormalize,
            compute_dtype=self.compute_dtype,
        )
        stats_spec = dict(load_balancing_loss=P(), router_z_loss=P(), expert_load=P(), dropped_fraction=P())
        return jax.shard_map(
            body,
            in_specs=(P(BATCH_AXES), P(), P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS)),
            out_specs=(P(BATCH_AXES), stats_spec),
        )(x, self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...])
