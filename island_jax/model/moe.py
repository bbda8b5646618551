"""Expert-parallel Mixture-of-Experts feed-forward layer under `jax.shard_map` (docs/moe.md).

Router: float32 softmax over E experts, each token to its top k (Switch Transformer, arXiv 2101.03961; input
jitter, sec. 2.4); optional renormalised weights, shared experts (DeepSeekMoE, arXiv 2401.06066) and a per-expert
bias on the top-k choice only (DeepSeek-V3, arXiv 2412.19437, sec. 2.1.2), moved by `routing_bias_update`.

`dispatch="capacity"` (every backend): per batch shard, C slots per expert (static shapes) in token order (later
assignments dropped, padded tokens take none); buckets [E, C, D] reach the experts' owners by `all_to_all` over
`expert`, the local experts run as one batched einsum, and a second all_to_all brings them back for the weighted
combine. `dispatch="dropless"`: `jax.lax.ragged_dot` over groups sorted by expert, moved by `ragged_all_to_all`
(which XLA:CPU lacks: `check_dispatch`). Statistics (`LAYER_METRICS`), over the island batch's real tokens:

  load_balancing_loss = E * sum_i f_i * P_i (Switch eq. 4), router_z_loss = mean logsumexp(logits)^2 (ST-MoE,
  arXiv 2202.08906, eq. 5), router_entropy (nats), dropped_fraction, capacity (C), expert_load (f_i, [E]), routed_counts (the assignments per
  expert before drops, [E] int32, summing to real tokens x k).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from island_jax.config import DISPATCH  # values of `moe.dispatch` (see the module docstring)
from island_jax.mesh import BATCH_AXES, EXPERT_AXIS, gathered, logical
from island_jax.mesh import platform as mesh_platform

# The statistics an MoE layer returns; the first four are scalars whose mean over
# MoE layers each inner step reports (`transformer.aggregate_stats`).
MEAN_METRICS = ("load_balancing_loss", "router_z_loss", "router_entropy", "dropped_fraction")
LAYER_METRICS = MEAN_METRICS + ("capacity", "expert_load", "routed_counts")


class DispatchError(ValueError):
    """The configured dispatch cannot run on this backend and mesh; the message names the config field."""


def capacity(tokens_per_shard: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert in each shard's buckets.

    C = ceil(capacity_factor * tokens_per_shard * k / num_experts), from static
    shapes only, clamped to tokens_per_shard: an expert receives each token at
    most once, so more slots could never be filled. capacity_factor <= 0 means
    nothing is ever dropped: worst-case buckets, C = tokens_per_shard.

    Args:
      tokens_per_shard: tokens (padded ones included) on one device of the batch.
      num_experts: E, over the whole island.
      k: experts per token (top-k).
      capacity_factor: slots per expert over the balanced share tokens x k / E.

    Returns:
      C, slots per expert in each shard's buckets, in 1..tokens_per_shard.
    """
    if capacity_factor <= 0:
        return tokens_per_shard
    c = math.ceil(capacity_factor * tokens_per_shard * k / num_experts)
    return max(1, min(c, tokens_per_shard))


def check_dispatch(dispatch: str, expert_axis_size: int, platform: str) -> None:
    """Refuses a dispatch the backend cannot run.

    Args:
      dispatch: `moe.dispatch`, one of `DISPATCH`.
      expert_axis_size: the island's `mesh.expert`.
      platform: the devices' platform ("cpu", "gpu", "tpu"): of the mesh a program is traced on
        (`mesh.platform`), compile-only devices of a target included.

    Raises:
      DispatchError: `dropless` with an expert axis above 1 on CPU (XLA:CPU has
        no ragged_all_to_all), or an unknown dispatch.
    """
    if dispatch not in DISPATCH:
        raise DispatchError(f"moe.dispatch is {dispatch!r}; choose one of {DISPATCH}")
    if dispatch == "dropless" and expert_axis_size > 1 and platform == "cpu":
        raise DispatchError(
            f"moe.dispatch='dropless' with an expert axis of {expert_axis_size} moves tokens with "
            "jax.lax.ragged_all_to_all, which XLA:CPU does not implement; on CPU set moe.dispatch='capacity' "
            "(moe.capacity_factor <= 0 drops nothing) or make the island's mesh.expert 1"
        )


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward (Shazeer, arXiv 2002.05202): (silu(x W_gate) * x W_up) W_down.

    x [..., D], w_gate and w_up [D, F], w_down [F, D] -> [..., D], in the inputs' dtype.
    """
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _psum(x):
    return jax.lax.psum(x, BATCH_AXES)


def _ragged_swiglu(x, w_gate, w_up, w_down, group_sizes):
    """SwiGLU over rows grouped by expert: x [M, D] sorted by expert, w_* [E, ...], group_sizes [E]."""
    h = jax.nn.silu(jax.lax.ragged_dot(x, w_gate, group_sizes)) * jax.lax.ragged_dot(x, w_up, group_sizes)
    return jax.lax.ragged_dot(h, w_down, group_sizes)


@jax.custom_vjp
def _gather_rows(x, index, inverse):
    """x_pad[index] for x [N, D] with a zero row appended (index N reads zeros).

    `index` is injective on the rows it reads (every row of x is read by at
    most the entries `inverse` names): `inverse` [N, m] lists, for each row of
    x, the positions of the output that read it (the output's length for none).
    The gradient is then a gather too, not a scatter-add.
    """
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _gather_rows_fwd(x, index, inverse):
    return _gather_rows(x, index, inverse), inverse


def _gather_rows_bwd(inverse, g):
    g_pad = jnp.concatenate([g, jnp.zeros((1, g.shape[1]), g.dtype)])
    return jnp.sum(g_pad[inverse], axis=1), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _capacity_experts(xc, flat_e, real_a, tokens, k, cap, w_gate, w_up, w_down):
    """Fixed-capacity buckets, all_to_all over the expert axis, batched einsum. Returns ([A, D], kept [A])."""
    num_experts = w_gate.shape[0] * jax.lax.axis_size(EXPERT_AXIS)
    ep = jax.lax.axis_size(EXPERT_AXIS)
    d = xc.shape[-1]
    a = tokens * k
    # Position of each assignment in its expert's bucket: real assignments to
    # the same expert, counted in token order.
    onehot = jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32) * real_a[:, None]
    position = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), flat_e[:, None], axis=1)[:, 0] - 1
    kept = real_a & (position < cap)
    slots = num_experts * cap
    slot = jnp.where(kept, flat_e * cap + position, slots)  # [A]; `slots` = dropped
    # The inverse map: which assignment fills each slot (`a` = empty).
    assignment = jnp.full((slots + 1,), a, jnp.int32).at[slot].set(jnp.arange(a, dtype=jnp.int32))[:slots]
    token_of_slot = jnp.where(assignment < a, assignment // k, tokens)
    buckets = _gather_rows(xc, token_of_slot, slot.reshape(tokens, k))
    # To the experts' owners: [ep (owner), E_local, C, D] -> [E_local, ep (source shard), C, D],
    # so each local expert's rows are contiguous for one batched matmul.
    e_local = num_experts // ep
    buckets = buckets.reshape(ep, e_local, cap, d)
    received = jax.lax.all_to_all(buckets, EXPERT_AXIS, 0, 2, tiled=True).reshape(e_local, ep * cap, d)
    gate = jnp.einsum("ecd,edf->ecf", received, w_gate)
    up = jnp.einsum("ecd,edf->ecf", received, w_up)
    y = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down)
    # Back home, in global expert order: [E_local, ep, C, D] -> [ep (owner), E_local, C, D].
    y = jax.lax.all_to_all(y.reshape(1, e_local, ep * cap, d), EXPERT_AXIS, 2, 0, tiled=True)
    return _gather_rows(y.reshape(slots, d), slot, assignment[:, None]), kept


def _dropless_experts(xc, flat_e, real_a, counts, k, w_gate, w_up, w_down):
    """Sorted by expert, ragged_dot; ragged_all_to_all when the expert axis is above 1. Returns [A, D]."""
    ep = jax.lax.axis_size(EXPERT_AXIS)
    e_local = w_gate.shape[0]
    num_experts = e_local * ep
    a, d = flat_e.shape[0], xc.shape[-1]
    order = jnp.argsort(jnp.where(real_a, flat_e, num_experts), stable=True)  # padded assignments last
    sorted_x = xc[order // k]
    if ep == 1:
        y_sorted = _ragged_swiglu(sorted_x, w_gate, w_up, w_down, counts)
    else:
        me = jax.lax.axis_index(EXPERT_AXIS)
        all_counts = jax.lax.all_gather(counts, EXPERT_AXIS)  # [ep sender, E]
        per_pair = all_counts.reshape(ep, ep, e_local).sum(-1)  # [sender, receiver] assignments
        send_sizes = per_pair[me]
        input_offsets = jnp.cumsum(send_sizes) - send_sizes
        output_offsets = (jnp.cumsum(per_pair, axis=0) - per_pair)[me]  # where my chunk lands at each receiver
        recv_sizes = per_pair[:, me]
        recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
        received = jax.lax.ragged_all_to_all(
            sorted_x, jnp.zeros((ep * a, d), xc.dtype), input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name=EXPERT_AXIS,
        )
        # Rows arrive by sender, each sender's rows by expert: regroup by local expert.
        mine = jax.lax.dynamic_slice_in_dim(all_counts, me * e_local, e_local, axis=1)  # [sender, E_local]
        local_e = jnp.repeat(jnp.tile(jnp.arange(e_local), ep), mine.reshape(-1), total_repeat_length=ep * a)
        local_e = jnp.where(jnp.arange(ep * a) < recv_sizes.sum(), local_e, e_local)
        regroup = jnp.argsort(local_e, stable=True)
        y_grouped = _ragged_swiglu(received[regroup], w_gate, w_up, w_down, mine.sum(0))
        y_received = jnp.zeros_like(y_grouped).at[regroup].set(y_grouped)
        back_offsets = (jnp.cumsum(per_pair, axis=1) - per_pair)[:, me]  # where each sender sorted its chunk for me
        y_sorted = jax.lax.ragged_all_to_all(
            y_received, jnp.zeros((a, d), y_grouped.dtype), recv_offsets, recv_sizes, back_offsets, send_sizes,
            axis_name=EXPERT_AXIS,
        )
    y_sorted = jnp.where((jnp.arange(a) < counts.sum())[:, None], y_sorted, 0)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def _moe_shard(x, mask, key, router, bias, w_gate, w_up, w_down, *, k, capacity_factor, renormalize, jitter,
               dispatch, compute_dtype, capture=False):
    """Per-device body. x [b, s, D] and mask [b, s] local; w_* [E_local, ...] local experts. `capture`: the stats
    also hold `top_experts` int32 [b, s, k], each token's chosen experts."""
    b, s, d = x.shape
    num_experts = router.shape[1]
    tokens = b * s
    cap = capacity(tokens, num_experts, k, capacity_factor)

    xt = x.reshape(tokens, d)
    real = mask.reshape(tokens) > 0
    realf = real.astype(jnp.float32)
    router_in = xt.astype(jnp.float32)
    if jitter > 0:
        shard_key = jax.random.fold_in(key, jax.lax.axis_index(BATCH_AXES))
        router_in = router_in * jax.random.uniform(shard_key, router_in.shape, jnp.float32, 1 - jitter, 1 + jitter)
    logits = router_in @ router.astype(jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        top_w, top_e = jax.lax.top_k(probs, k)  # [T, k]
    else:  # the bias steers the choice, never the weights
        _, top_e = jax.lax.top_k(probs + jax.lax.stop_gradient(bias), k)
        top_w = jnp.take_along_axis(probs, top_e, axis=1)
    if renormalize:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)

    # Island-wide statistics over real tokens (sums over every shard of the batch).
    n_real = jnp.maximum(_psum(jnp.sum(realf)), 1.0)
    flat_e = top_e.reshape(-1)  # [A = T*k], token-major: earlier tokens first
    real_a = jnp.repeat(real, k)
    counts = jnp.sum(jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32) * real_a[:, None], axis=0)  # [E]
    routed = _psum(counts)  # [E] int32: the island batch's real assignments per expert, before drops
    load = routed.astype(jnp.float32) / (n_real * k)
    mean_prob = _psum(jnp.sum(probs * realf[:, None], axis=0)) / n_real
    z = jax.nn.logsumexp(logits, axis=-1)
    entropy = -jnp.sum(jax.scipy.special.xlogy(probs, probs), axis=-1)

    xc = xt.astype(compute_dtype)
    w = [w.astype(compute_dtype) for w in (w_gate, w_up, w_down)]
    if dispatch == "capacity":
        per_assignment, kept = _capacity_experts(xc, flat_e, real_a, tokens, k, cap, *w)
    else:
        per_assignment, kept, cap = _dropless_experts(xc, flat_e, real_a, counts, k, *w), real_a, tokens
    combine = top_w * realf[:, None]
    out = jnp.einsum("tkd,tk->td", per_assignment.reshape(tokens, k, d).astype(jnp.float32), combine)
    stats = dict(
        load_balancing_loss=num_experts * jnp.sum(load * mean_prob),
        router_z_loss=_psum(jnp.sum(z * z * realf)) / n_real,
        router_entropy=jax.lax.stop_gradient(_psum(jnp.sum(entropy * realf)) / n_real),
        dropped_fraction=_psum(jnp.sum(real_a & ~kept)).astype(jnp.float32) / (n_real * k),
        capacity=jnp.asarray(cap, jnp.int32),
        expert_load=load,
        routed_counts=routed,
    )
    if capture:
        stats["top_experts"] = top_e.reshape(b, s, k).astype(jnp.int32)
    return out.astype(x.dtype).reshape(b, s, d), stats


class SharedExperts(nnx.Module):
    """A dense SwiGLU feed-forward layer (replicated weights). x [..., D] -> [..., D].

    Serves both as the shared experts of an MoE layer and as the dense layer
    between MoE layers.
    """

    def __init__(self, d_model: int, hidden_dim: int, param_dtype, compute_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
        self.w_gate = nnx.Param(logical(init, "embed", "mlp")(rngs.params(), (d_model, hidden_dim), param_dtype))
        self.w_up = nnx.Param(logical(init, "embed", "mlp")(rngs.params(), (d_model, hidden_dim), param_dtype))
        self.w_down = nnx.Param(logical(init, "mlp", "embed")(rngs.params(), (hidden_dim, d_model), param_dtype))
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        w = (gathered(self.w_gate[...]), gathered(self.w_up[...]), gathered(self.w_down[...]))
        return swiglu(x.astype(cd), *(v.astype(cd) for v in w))


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts, expert-parallel over the `expert` mesh axis.

    Must be called under a mesh (`jax.set_mesh`) with the axes of `mesh.AXES`;
    a 1 x 1 mesh runs it on one device.

    Args:
      d_model: model width D.
      num_experts: E, divisible by the mesh's expert axis.
      num_experts_per_token: k (top-k).
      expert_hidden_dim: F, SwiGLU hidden width of each expert.
      capacity_factor: see `capacity`.
      renormalize: rescale the k router weights of a token to sum to 1.
      dispatch: "capacity" or "dropless" (see the module docstring).
      jitter_noise: eps of the multiplicative router-input noise in training (0: off).
      num_shared_experts: experts of width F every token passes through (0: none).
      shared_expert_gate: scale the shared experts' output per token by sigmoid(x w) (w [D, 1]; Qwen2-MoE).
      routing_bias: keep a per-expert routing bias for auxiliary-loss-free balancing.
      param_dtype, compute_dtype: dtypes of the expert weights and matmuls
        (the router always computes in float32).

    Call: x [B, S, D] (B divisible by data x fsdp x expert), optional mask [B, S]
      (1 real, 0 padded), optional PRNG key (jitter; training only) ->
      (y [B, S, D] in x's dtype, stats (`LAYER_METRICS`): load_balancing_loss [],
      router_z_loss [], router_entropy [] (nats), dropped_fraction [] float32,
      capacity [] int32, expert_load [E] float32 (fraction of assignments per
      expert, before drops), routed_counts [E] int32 (those assignments: real tokens x k in all)); with
      `capture_routing` set (a probe of the routing, `island.step.build_probe_step`) nothing is dropped
      (capacity_factor 0) and the stats also hold top_experts [B, S, k] int32, each token's chosen experts.

    Raises (on call):
      DispatchError: a dispatch the backend and mesh cannot run (`check_dispatch`).
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
        dispatch: str = "capacity",
        jitter_noise: float = 0.0,
        num_shared_experts: int = 0,
        shared_expert_gate: bool = False,
        routing_bias: bool = False,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
        e, d, f = num_experts, d_model, expert_hidden_dim
        self.router = nnx.Param(logical(init, "embed", "router")(rngs.params(), (d, e), jnp.float32))
        self.w_gate = nnx.Param(logical(init, "expert", "embed", "mlp")(rngs.params(), (e, d, f), param_dtype))
        self.w_up = nnx.Param(logical(init, "expert", "embed", "mlp")(rngs.params(), (e, d, f), param_dtype))
        self.w_down = nnx.Param(logical(init, "expert", "mlp", "embed")(rngs.params(), (e, f, d), param_dtype))
        # DeepSeek-style shared experts: one dense SwiGLU of width num_shared_experts * F.
        self.shared_experts = (
            SharedExperts(d, num_shared_experts * f, param_dtype, compute_dtype, rngs) if num_shared_experts else None
        )
        # A parameter the optimizer never moves: it gets no gradient (it only
        # steers top_k) and no weight decay (rank 1); `routing_bias_update` moves it.
        self.routing_bias = (nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=("router",), eager_sharding=False)
                             if routing_bias else None)
        init_gate = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
        self.shared_expert_gate = (nnx.Param(logical(init_gate, "embed", "router")(rngs.params(), (d, 1), param_dtype))
                                   if shared_expert_gate and num_shared_experts else None)
        self.k = num_experts_per_token
        self.capacity_factor = capacity_factor
        self.renormalize = renormalize
        self.dispatch = dispatch
        self.jitter = jitter_noise
        self.compute_dtype = compute_dtype
        self.capture_routing = False  # a routing probe: no drops, and each token's top-k experts in the stats

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, key: jax.Array | None = None):
        check_dispatch(self.dispatch, jax.sharding.get_abstract_mesh().shape[EXPERT_AXIS], mesh_platform())
        if mask is None:
            mask = jnp.ones(x.shape[:2], jnp.float32)
        jitter = self.jitter if key is not None else 0.0
        if key is None:
            key = jax.random.PRNGKey(0)
        bias = None if self.routing_bias is None else self.routing_bias[...]
        capture = self.capture_routing
        body = lambda x, mask, key, router, bias, *w: _moe_shard(  # noqa: E731
            x, mask, key, router, bias, *w,
            k=self.k, capacity_factor=0.0 if capture else self.capacity_factor, renormalize=self.renormalize,
            jitter=jitter, dispatch=self.dispatch, compute_dtype=self.compute_dtype, capture=capture,
        )
        stats_specs = {name: P() for name in LAYER_METRICS} | ({"top_experts": P(BATCH_AXES)} if capture else {})
        y, stats = jax.shard_map(
            body,
            in_specs=(P(BATCH_AXES), P(BATCH_AXES), P(), P(), P(), P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS)),
            out_specs=(P(BATCH_AXES), stats_specs),
        )(*self._placed(x, mask, key, bias))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                cd = self.compute_dtype
                shared = jax.nn.sigmoid(x.astype(cd) @ gathered(self.shared_expert_gate[...]).astype(cd)) * shared
            y = y + shared.astype(y.dtype)
        return y, stats

    def _placed(self, x, mask, key, bias):
        """The shard_map's inputs with the shardings its in_specs name (a no-op when they already have them)."""
        batch, replicated, experts = P(BATCH_AXES), P(), P(EXPERT_AXIS)
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        return (
            _reshard(x, batch), _reshard(mask, batch), key, _reshard(self.router[...], replicated),
            _reshard(bias, replicated), *(_reshard(w, experts) for w in weights),
        )


def _reshard(x, spec):
    return None if x is None else jax.reshard(x, spec)


def dense_reference(x: jax.Array, weights: dict, k: int, mask: jax.Array | None = None):
    """The MoE layer's oracle: every expert on every real token, combined with the top-k router weights
    (renormalised to sum to 1), and the auxiliary losses over real tokens, in plain float32 einsums on one
    device. What `MoE` (renormalize=True, no drops, no jitter, no shared experts or routing bias) must equal on
    any mesh (tests/test_moe.py, benchmarks/accelerator_check.py).

    Args:
      x: [B, S, D]; weights: `router` [D, E], `w_gate`, `w_up` [E, D, F], `w_down` [E, F, D]; k: top-k;
      mask: [B, S] (1 real, 0 padded) or None (all real).

    Returns:
      (y [B, S, D], load-balancing loss [], router z-loss []).
    """
    e = weights["router"].shape[1]
    xt = x.reshape(-1, x.shape[-1])
    real = jnp.ones(xt.shape[0]) if mask is None else mask.reshape(-1)
    logits = xt @ weights["router"]
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_e = jax.lax.top_k(probs, k)
    top_w = top_w / top_w.sum(-1, keepdims=True)
    gate = jnp.einsum("td,edf->tef", xt, weights["w_gate"])
    up = jnp.einsum("td,edf->tef", xt, weights["w_up"])
    all_out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, weights["w_down"])
    combine = jnp.sum(jax.nn.one_hot(top_e, e) * top_w[..., None], axis=1) * real[:, None]
    out = jnp.einsum("ted,te->td", all_out, combine).reshape(x.shape)
    n = jnp.sum(real)
    f = jnp.sum(jnp.sum(jax.nn.one_hot(top_e, e), axis=1) * real[:, None], axis=0) / (n * k)
    lb = e * jnp.sum(f * jnp.sum(probs * real[:, None], axis=0) / n)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * real) / n
    return out, lb, z


def routing_bias_update(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free update: b_i += rate * sign(mean load - load_i).

    Args:
      bias: [..., E] float32 routing bias of one layer (or of several, stacked on leading axes).
      expert_load: [..., E] fraction of each layer's assignments per expert this step.
      rate: gamma, the bias update speed (`moe.routing_bias_update_rate`).

    Returns:
      The new bias, [..., E] float32; each layer's mean load is its own.
    """
    return bias + rate * jnp.sign(jnp.mean(expert_load, axis=-1, keepdims=True) - expert_load)
