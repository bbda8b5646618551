"""Decoder-only transformer language model (bytes or a tokenizer's ids) with MoE feed-forward layers.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> MoE
or dense SwiGLU -> residual), learned or rotary positions, untied output head. Packed documents (segment
ids) attend only within themselves, their positions counted from each one's start. Every
`moe.every_n_layers`-th block has an MoE layer (blocks n-1, 2n-1, ...; n = 1:
all), the others a dense SwiGLU of width `model.mlp_hidden_dim`. The model
knows nothing of rounds or islands: it only expects to run under a mesh with
the axes of `island_jax.mesh.AXES`, batch split over both.

With `model.scan_layers`, the blocks' repeating unit (n = `moe.every_n_layers` blocks, the last with the MoE
layer) is scanned (`jax.lax.scan`) over its U = L // n repeats: each of the unit's n blocks holds its parameters
stacked on a leading `layers` axis of U (`layers.{j}`: blocks j, n + j, ..., (U - 1) n + j), and the L mod n
blocks left over, dense ones, follow unrolled (`tail.{k}`: block U n + k). `model.stacking` converts between
this and the per-layer form (`blocks.{i}`); both draw the same initial values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import PartitionSpec as P

from island_jax.mesh import BATCH_AXES, gathered, logical, spec_of
from island_jax.mesh import platform as mesh_platform
from island_jax.model.moe import MEAN_METRICS, MoE, SharedExperts, routing_bias_update


def _dtype(name: str):
    return jnp.dtype(name)


def _linear(layer: nnx.Linear, x: jax.Array) -> jax.Array:
    """`layer(x)` with its kernel whole over fsdp (`mesh.gathered`): the same dtype promotion and contraction as
    `nnx.Linear.__call__` (no bias). x [..., in] -> [..., out]."""
    x, kernel, _ = layer.promote_dtype((x, gathered(layer.kernel[...]), None), dtype=layer.dtype)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)


def _norm(width: int, pd, cd, rngs: nnx.Rngs, eps: float = 1e-6) -> nnx.RMSNorm:
    """RMSNorm over the last axis of `width`: x / sqrt(mean(x^2) + eps) * scale, in float32 inside."""
    return nnx.RMSNorm(width, epsilon=eps, param_dtype=pd, dtype=cd,
                       scale_init=logical(nnx.initializers.ones_init(), "norm"), rngs=rngs)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (RoFormer, arXiv 2104.09864, eq. 34, in the rotate-half layout): each pair
    (x[..., i], x[..., i + Dh / 2]) of a head is rotated by the angle position x theta^(-2i / Dh).

    Args:
      x: [B, S, H, Dh] queries or keys (Dh even).
      positions: int32 [S] (every row's) or [B, S] (each row its own, `segment_positions`).
      theta: the frequencies' base.

    Returns:
      [B, S, H, Dh] in x's dtype (the angles in float32).
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [S, half] or [B, S, half]
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its document: int32 [B, S] of segment ids [B, S] (`data.records.pack`; a new
    document starts where the id changes), counting from 0 at each document's first token in the row."""
    s = segment_ids.shape[1]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [B, 1, S, S]: query i may attend to key j when both belong to one document (packed sequences;
    the causal part is the attention's own)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


class Attention(nnx.Module):
    """Causal multi-head self-attention. x [B, S, D] -> [B, S, D]; with `rope_theta`, queries and keys carry
    rotary positions (`rotary`). With `segment_ids` [B, S] (packed documents, `data.records.pack`), a token attends
    only to earlier tokens of its own document, on the XLA path and on cuDNN's (which takes the mask as a bias),
    and rotary positions count from each document's start.

    One fused projection `qkv` [D, (H + 2 K) Dh] gives H query heads, then K key and K value heads of width
    Dh = D / H (K = `num_kv_heads`: grouped-query attention, GQA, arXiv 2305.13245, each key and value head
    serving H / K query heads; K = H is multi-head attention). With `qk_norm`, each query and key head is
    RMSNorm-ed over its Dh before the rotary positions (a scale [Dh] each, shared by the heads; Qwen3)."""

    def __init__(self, d_model: int, num_heads: int, *, param_dtype, compute_dtype, rngs: nnx.Rngs,
                 rope_theta: float | None = None, num_kv_heads: int = 0, qk_norm: bool = False,
                 norm_eps: float = 1e-6):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = d_model // num_heads
        self.rope_theta = rope_theta
        kw = dict(use_bias=False, param_dtype=param_dtype, dtype=compute_dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal()  # nnx.Linear's own default
        width = (num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv = nnx.Linear(d_model, width, kernel_init=logical(init, "embed", "qkv"), **kw)
        self.out = nnx.Linear(d_model, d_model, kernel_init=logical(init, "heads", "embed"), **kw)
        self.q_norm = _norm(self.head_dim, param_dtype, compute_dtype, rngs, norm_eps) if qk_norm else None
        self.k_norm = _norm(self.head_dim, param_dtype, compute_dtype, rngs, norm_eps) if qk_norm else None

    def _project(self, x, positions):
        """x [B, S, D] -> (q [B, S, H, Dh], k and v [B, S, K, Dh]), q and k normed (`qk_norm`) and rotated."""
        b, s, _ = x.shape
        h, kv = self.num_heads, self.num_kv_heads
        y = _linear(self.qkv, x).reshape(b, s, h + 2 * kv, self.head_dim)
        q, k, v = y[:, :, :h], y[:, :, h: h + kv], y[:, :, h + kv:]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        return q, k, v

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        b, s, d = x.shape
        if segment_ids is None:
            positions, mask = jnp.arange(s, dtype=jnp.int32), None
        else:
            positions, mask = segment_positions(segment_ids), segment_mask(segment_ids)
        q, k, v = self._project(x, positions)
        y = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                         implementation=attention_implementation(q.dtype))
        return _linear(self.out, y.reshape(b, s, d))

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array):
        """The attention of one new position per row, with a KV cache.

        Args:
          x: [B, 1, D], the inputs at position `pos`.
          cache: (keys, values), each [B, T, K, Dh] in the compute dtype: positions 0..pos-1 hold what
            earlier calls wrote; T is the longest sequence the cache serves.
          pos: int32 [], the new position, in 0..T-1.

        Returns:
          ([B, 1, D], the cache with position `pos` written): the same as `__call__`'s row `pos` over
          positions 0..pos.
        """
        b, s, d = x.shape
        q, k, v = self._project(x, jnp.reshape(pos, (1,)).astype(jnp.int32))
        keys, values = (
            jax.lax.dynamic_update_slice_in_dim(c, jax.sharding.reshard(new.astype(c.dtype), jax.P(BATCH_AXES)), pos, 1)
            for c, new in zip(cache, (k, v))
        )
        seen = (jnp.arange(keys.shape[1]) <= pos)[None, None, None, :]  # [1, 1, 1, T]: positions 0..pos
        y = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=seen)
        return _linear(self.out, y.reshape(b, s, d)), (keys, values)


def attention_implementation(dtype) -> str:
    """`jax.nn.dot_product_attention`'s implementation for activations of `dtype` on the devices of the current
    mesh (`jax.set_mesh`; else the default backend): "cudnn" (fused flash attention) on GPU in bfloat16 or
    float16, which cuDNN's kernel needs, "xla" otherwise."""
    return "cudnn" if mesh_platform() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


# `model.remat` -> the `jax.checkpoint` policy of a block (None: recompute everything from the block's input)
REMAT_POLICIES = {
    "full": None,
    **{name: getattr(jax.checkpoint_policies, name) for name in (
        "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable", "nothing_saveable")},
}


def _call_block(block, x, mask, key, segment_ids):
    return block(x, mask, key, segment_ids)


def _stacked(blocks: list[nnx.Module]) -> nnx.Module:
    """One module shaped like `blocks[0]` whose every parameter is the blocks' values stacked on a new leading
    axis (logical name `layers`, never split: `mesh.LOGICAL_RULES`). The blocks must share one structure."""
    template = blocks[0]
    others = [nnx.state(b, nnx.Param) for b in blocks]
    flat = [dict(nnx.to_flat_state(s)) for s in others]
    for path, var in nnx.to_flat_state(nnx.state(template, nnx.Param)):
        values = [f[path][...] for f in flat]
        var.set_value(jnp.stack(values))
        names = var.get_metadata("out_sharding", None)
        if names is not None:
            var.set_metadata("out_sharding", ("layers", *names))
    return template


def _batch_split(x: jax.Array) -> jax.Array:
    """Activations [B, ...] with the batch split over the mesh (`BATCH_AXES`), as an MoE layer returns them: a
    scan's carry must keep one sharding, and tokens given unsplit (a sampler's, an evaluation's) would not."""
    return jax.sharding.reshard(x, jax.P(BATCH_AXES))


def scan_unit(num_layers: int, every_n_layers: int) -> tuple[int, int, int]:
    """How `model.scan_layers` lays out L = `num_layers` blocks: (n, U, T), a unit of n = `every_n_layers` blocks
    (MoE in its last) scanned U = L // n times, then T = L mod n dense blocks unrolled."""
    return every_n_layers, num_layers // every_n_layers, num_layers % every_n_layers


def is_moe_layer(layer: int, every_n_layers: int) -> bool:
    """Whether block `layer` (0-based) has an MoE layer: every n-th block, the last of each n."""
    return (layer + 1) % every_n_layers == 0


def routing_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
    """(MoE layers, routed experts per layer, experts per token k) of the config's model (`model.num_layers`,
    `moe.every_n_layers`, `moe.num_experts`, `moe.num_experts_per_token`): the shape of its routed counts."""
    moe = config.moe
    layers = sum(is_moe_layer(i, moe.every_n_layers) for i in range(config.model.num_layers))
    return layers, int(moe.num_experts), int(moe.num_experts_per_token)


class Block(nnx.Module):
    """Pre-norm transformer block with an MoE (or, between MoE layers, dense SwiGLU) feed-forward layer.

    Call: x [B, S, D], mask [B, S] or None, PRNG key or None, segment ids [B, S] or None (`Attention`) ->
    (x [B, S, D], the MoE layer's stats (see `MoE`), or None for a dense block).
    """

    def __init__(self, config: ml_collections.ConfigDict, layer: int, *, rngs: nnx.Rngs):
        m, moe = config.model, config.moe
        pd, cd = _dtype(m.param_dtype), _dtype(m.compute_dtype)
        eps = m.get("norm_eps", 1e-6)
        self.attn_norm = _norm(m.d_model, pd, cd, rngs, eps)
        rope = m.get("rope_theta", 10_000.0) if m.get("positions", "learned") == "rope" else None
        self.attn = Attention(m.d_model, m.num_heads, param_dtype=pd, compute_dtype=cd, rngs=rngs, rope_theta=rope,
                              num_kv_heads=m.get("num_kv_heads", 0), qk_norm=m.get("qk_norm", False), norm_eps=eps)
        self.ffn_norm = _norm(m.d_model, pd, cd, rngs, eps)
        if is_moe_layer(layer, moe.every_n_layers):
            self.moe = MoE(
                m.d_model,
                moe.num_experts,
                moe.num_experts_per_token,
                moe.expert_hidden_dim,
                moe.capacity_factor,
                moe.renormalize,
                dispatch=moe.dispatch,
                jitter_noise=moe.jitter_noise,
                num_shared_experts=moe.num_shared_experts,
                shared_expert_gate=moe.get("shared_expert_gate", False),
                routing_bias=moe.routing_bias_update_rate > 0,
                param_dtype=pd,
                compute_dtype=cd,
                rngs=rngs,
            )
            self.mlp = None
        else:
            self.moe = None
            self.mlp = SharedExperts(m.d_model, m.mlp_hidden_dim, pd, cd, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None, key: jax.Array | None,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        x = x + self.attn(self.attn_norm(x), segment_ids)
        return self._feed_forward(x, mask, key)

    def _feed_forward(self, x, mask, key):
        if self.moe is None:
            return x + self.mlp(self.ffn_norm(x)).astype(x.dtype), None
        y, stats = self.moe(self.ffn_norm(x), mask, key)
        return x + y, stats

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array):
        """One new position per row (x [B, 1, D]) with the attention's KV cache (`Attention.decode`);
        returns (x [B, 1, D], the cache with `pos` written). No router jitter."""
        y, cache = self.attn.decode(self.attn_norm(x), cache, pos)
        return self._feed_forward(x + y, None, None)[0], cache


class Transformer(nnx.Module):
    """MoE language model over bytes or a tokenizer's ids.

    Call: tokens [B, S] int32 (ids below vocab_size), optional mask [B, S] (1 real, 0
    padded), optional PRNG key (router jitter, training only), optional segment ids [B, S] int32 (packed
    documents: attention stays within a document and positions count from its start) -> (logits
    [B, S, vocab] float32, stats). With L the number of MoE layers, stats hold
    per layer (`moe.LAYER_METRICS`) `load_balancing_loss`, `router_z_loss`,
    `router_entropy` (nats), `dropped_fraction` [L] float32, `capacity` [L]
    int32, `expert_load` [L, E] float32 and `routed_counts` [L, E] int32; the losses the optimizer sees are
    their means over layers (`aggregate_stats`).
    """

    def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
        m = config.model
        pd, cd = _dtype(m.param_dtype), _dtype(m.compute_dtype)
        normal = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(logical(normal, "vocab", "embed")(rngs.params(), (m.vocab_size, m.d_model), pd))
        self.compute_dtype = cd
        self.remat = m.get("remat", "none")
        # learned positions: a row per position up to seq_len; rotary ones live in the attention (`rotary`)
        self.learned_positions = m.get("positions", "learned") == "learned"
        if self.learned_positions:
            self.position = nnx.Param(logical(normal, "position", "embed")(rngs.params(), (m.seq_len, m.d_model), pd))
        blocks = [Block(config, layer, rngs=rngs) for layer in range(m.num_layers)]
        self.scan_layers = m.get("scan_layers", False)
        if self.scan_layers:  # every block drawn as unrolled, then each unit position's repeats stacked
            unit, repeats, _ = scan_unit(m.num_layers, config.moe.every_n_layers)
            self.layers = nnx.List([_stacked(blocks[j: unit * repeats: unit]) for j in range(unit)])
            self.tail = nnx.List(blocks[unit * repeats:])
        else:
            self.blocks = nnx.List(blocks)
        self.final_norm = _norm(m.d_model, pd, cd, rngs, m.get("norm_eps", 1e-6))
        # A zero output head makes the first prediction uniform: loss ln(vocab_size).
        self.head = nnx.Linear(
            m.d_model, m.vocab_size, use_bias=False, kernel_init=logical(nnx.initializers.zeros_init(), "embed", "vocab"),
            param_dtype=pd, dtype=cd, rngs=rngs,
        )

    def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        # A one-hot matmul rather than a gather: it keeps the batch sharding under explicit mesh axes and costs
        # little at a byte-level vocabulary (at V = 32,768 the one-hot is B x S x V values of the compute dtype).
        one_hot = jax.nn.one_hot(tokens, self.embedding.shape[0], dtype=self.compute_dtype)
        x = one_hot @ gathered(self.embedding[...]).astype(self.compute_dtype)
        return x if positions is None else x + positions.astype(self.compute_dtype)

    def init_cache(self, batch: int, length: int):
        """An empty KV cache for `decode`: per block, (keys, values) of zeros [batch, length, K, Dh] in the
        compute dtype, the batch split over the mesh as the activations are; `length` (tokens) at most
        `model.seq_len`, the positions the model learned. A list over blocks; with `scan_layers`, {"layers": per
        unit position, (keys, values) [U, batch, length, K, Dh], stacked as the parameters are; "tail": a
        list over the unrolled blocks}."""
        attn = (self.layers[0] if self.scan_layers else self.blocks[0]).attn
        shape = (batch, length, attn.num_kv_heads, attn.head_dim)

        def zeros(*lead):
            return jnp.zeros((*lead, *shape), self.compute_dtype, out_sharding=jax.P(*(None,) * len(lead), BATCH_AXES))

        if not self.scan_layers:
            return [(zeros(), zeros()) for _ in self.blocks]
        repeats = self.layers[0].attn_norm.scale.shape[0]
        return {"layers": [(zeros(repeats), zeros(repeats)) for _ in self.layers],
                "tail": [(zeros(), zeros()) for _ in self.tail]}

    def decode(self, tokens: jax.Array, pos: jax.Array, cache: list):
        """Logits of the next token after `tokens` at position `pos`, reusing the keys and values of positions
        0..pos-1 (`init_cache`, then one call per position).

        Args:
          tokens: int32 [B, 1], the token at position `pos` of each row.
          pos: int32 [], 0..length-1 of the cache.
          cache: `init_cache`'s list, positions 0..pos-1 written by earlier calls.

        Returns:
          (logits float32 [B, 1, vocab], the cache with `pos` written): `__call__`'s logits at `pos` over the
          same tokens, with no router jitter (run with `moe.capacity_factor <= 0`, so that no token is dropped
          in either).
        """
        x = self._embed(tokens, jax.lax.dynamic_slice_in_dim(gathered(self.position[...]), pos, 1)[None]
                        if self.learned_positions else None)
        if not self.scan_layers:
            new = []
            for block, layer_cache in zip(self.blocks, cache):
                x, layer_cache = block.decode(x, layer_cache, pos)
                new.append(layer_cache)
        else:
            graphdef, state = nnx.split(self.layers)

            def unit(x, xs):
                unit_state, unit_cache = xs
                out = []
                for block, block_cache in zip(nnx.merge(graphdef, unit_state), unit_cache):
                    x, block_cache = block.decode(x, block_cache, pos)
                    out.append(block_cache)
                return x, out

            x, stacked = jax.lax.scan(unit, _batch_split(x), (state, cache["layers"]))
            tail = []
            for block, block_cache in zip(self.tail, cache["tail"]):
                x, block_cache = block.decode(x, block_cache, pos)
                tail.append(block_cache)
            new = {"layers": stacked, "tail": tail}
        return _linear(self.head, self.final_norm(x)).astype(jnp.float32), new

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None, key: jax.Array | None = None,
                 segment_ids: jax.Array | None = None):
        positions = None
        if self.learned_positions:
            table = gathered(self.position[...])[: tokens.shape[1]]
            # packed documents: each one's positions from 0 (a one-hot matmul, as the embedding: no gather)
            positions = table if segment_ids is None else jax.nn.one_hot(
                segment_positions(segment_ids), tokens.shape[1], dtype=self.compute_dtype) @ table.astype(self.compute_dtype)
        x = self._embed(tokens, positions)
        x, stats = (self._scanned if self.scan_layers else self._unrolled)(x, mask, key, segment_ids)
        logits = _linear(self.head, self.final_norm(x)).astype(jnp.float32)
        return logits, stats

    def _unrolled(self, x, mask, key, segment_ids):
        """The blocks one after another: (x, the MoE layers' stats stacked [L, ...])."""
        layer_stats = []
        # model.remat: each block's activations recomputed in the backward pass, as its policy says
        call = _call_block if self.remat == "none" else nnx.remat(_call_block, policy=REMAT_POLICIES[self.remat])
        for i, block in enumerate(self.blocks):
            x, stats = call(block, x, mask, None if key is None else jax.random.fold_in(key, i), segment_ids)
            if stats is not None:
                layer_stats.append(stats)
        return x, jax.tree.map(lambda *xs: jnp.stack(xs), *layer_stats)

    def _scanned(self, x, mask, key, segment_ids):
        """The unit of n blocks under `jax.lax.scan` over its U repeats, then the unrolled tail: the same values as
        `_unrolled` (block i = u n + j draws its router jitter from fold_in(key, i) either way). With `model.remat`,
        the unit's body is rematerialized by its policy, so under fsdp each unit's weights are gathered whole
        (`mesh.gathered`) inside the body, once forward and again backward, and only one unit's are whole at a
        time. Returns (x, the MoE layers' stats stacked [U, ...], one MoE layer per unit)."""
        graphdef, state = nnx.split(self.layers)
        n = len(self.layers)

        def unit(x, xs):
            unit_state, u = xs
            stats = None
            for j, block in enumerate(nnx.merge(graphdef, unit_state)):
                x, block_stats = block(x, mask, None if key is None else jax.random.fold_in(key, u * n + j), segment_ids)
                stats = block_stats if block_stats is not None else stats
            return x, stats

        if self.remat != "none":
            unit = jax.checkpoint(unit, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        repeats = self.layers[0].attn_norm.scale.shape[0]
        x, stats = jax.lax.scan(unit, _batch_split(x), (state, jnp.arange(repeats, dtype=jnp.uint32)))
        call = _call_block if self.remat == "none" else nnx.remat(_call_block, policy=REMAT_POLICIES[self.remat])
        for k, block in enumerate(self.tail):  # dense blocks, rematerialized one by one as `_unrolled`'s: no stats
            x, _ = call(block, x, mask, None if key is None else jax.random.fold_in(key, n * repeats + k), segment_ids)
        return x, stats


def aggregate_stats(per_layer: dict) -> dict:
    """Scalars over MoE layers: the means of the per-layer losses, entropy and dropped fraction.

    The load-balancing loss is computed per layer first and then averaged:
    pooling the layers' statistics before the product would hide imbalance
    (two layers routing everything to different experts pool to a balanced 1.0).

    Args:
      per_layer: the model's stats, each of `moe.MEAN_METRICS` [L] float32.

    Returns:
      {name: [] float32} for each of `moe.MEAN_METRICS`.
    """
    return {k: jnp.mean(per_layer[k]) for k in MEAN_METRICS}


def update_routing_biases(params: dict, expert_load: jax.Array, rate: float) -> dict:
    """Applies `routing_bias_update` to every MoE layer's bias in a pure-dict `params`.

    Args:
      params: `nnx.to_pure_dict` of the model's parameters, per layer (`blocks`) or stacked (`layers`, with
        `model.scan_layers`: the unit's MoE block holds the U layers' biases [U, E]).
      expert_load: [L, E] per-MoE-layer expert load of the step, in layer order.
      rate: `moe.routing_bias_update_rate`.

    Returns:
      A copy of `params` with every MoE layer's `routing_bias` updated.
    """
    group = "layers" if "layers" in params else "blocks"
    params = dict(params, **{group: dict(params[group])})
    moe_blocks = [i for i in sorted(params[group]) if "moe" in params[group][i]]
    # unrolled: one MoE block per layer; stacked: one MoE block, the unit's last, holding all L layers
    loads = [expert_load] if group == "layers" else list(expert_load)
    for i, load in zip(moe_blocks, loads):
        block = dict(params[group][i])
        block["moe"] = dict(block["moe"], routing_bias=routing_bias_update(block["moe"]["routing_bias"], load, rate))
        params[group][i] = block
    return params


def partition_specs(params: nnx.State) -> dict:
    """PartitionSpec per parameter, as a pure dict shaped like `nnx.to_pure_dict(params)`.

    Each parameter's logical axis names (its `out_sharding` metadata, `mesh.logical`) go through the one rules
    table, `mesh.LOGICAL_RULES` (`mesh.spec_of`): the routed experts split over `expert`, and every parameter that
    has an `embed` dimension splits over `fsdp` on its leading dimension that is not `expert` nor the stacked
    `layers` axis (`mesh.fsdp_leading`), so that a process's part of it is a few runs of consecutive elements; the
    rest is replicated.
    """
    def spec(var):
        names = var.get_metadata("out_sharding", None)
        return spec_of(names) if names else P()

    specs = jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)
