"""An island's jitted programs and the pure pieces they are made of.

The inner step (DiLoCo, arXiv 2311.08105, Algorithm 1, the inner loop): one
AdamW step on cross-entropy plus the MoE auxiliary losses (load balancing,
Switch Transformer arXiv 2101.03961; router z-loss, ST-MoE arXiv 2202.08906).
Beside it: evaluation, the pseudo-gradient anchor - params, and Streaming
DiLoCo's mixing of local and global values (arXiv 2501.18512, Algorithm 1).
Nothing here knows of rounds, fragments or transports.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from island_jax.island.placement import Shardings
from island_jax.model import stacking
from island_jax.model.init import init_params
from island_jax.model.moe import MEAN_METRICS, MoE
from island_jax.model.transformer import aggregate_stats, update_routing_biases

# Scalars each inner step reports (see `Island.train_round`); the MoE ones are means over MoE layers.
# Per MoE layer, a step also reports the `model.moe.LAYER_METRICS` arrays: [L] each, expert_load [L, E].
STEP_METRICS = ("loss", "cross_entropy", *MEAN_METRICS, "grad_norm")


class InnerOptimizer(optax.GradientTransformationExtraArgs):
    """`inner_optimizer`'s optax transformation, which also names the learning-rate schedule it steps by.

    Attributes:
      learning_rate: the optax schedule the AdamW update reads: the optimizer's update count (the island's
        inner steps taken before a step) -> that step's learning rate (float32 scalar). `learning_rates` reads it.
    """

    learning_rate: optax.Schedule


def learning_rate_schedule(config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """The inner learning rate by update count: warm-up and cosine decay over `total_steps` inner steps.

    It rises linearly from 0 to `inner.learning_rate` over `inner.warmup_steps`
    (at most `total_steps - 1`), then decays by a cosine to
    `learning_rate x inner.min_learning_rate_ratio` at `total_steps`
    (`optax.warmup_cosine_decay_schedule`; float32).
    """
    i = config.inner
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=i.learning_rate,
        warmup_steps=min(i.warmup_steps, max(total_steps - 1, 0)),
        decay_steps=max(total_steps, 1),
        end_value=i.learning_rate * i.min_learning_rate_ratio,
    )


def inner_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> InnerOptimizer:
    """AdamW with global-norm clipping, stepping by `learning_rate_schedule(config, total_steps)`.

    Weight decay applies to matrices only (rank >= 2 per layer, `model.stacking.layer_ndim`: a stacked leaf's
    `layers` axis does not count), not to norms' scales nor routing biases. The schedule is the result's `learning_rate` (the one object both the
    update and the logged learning rate read: `learning_rates`).
    """
    i = config.inner
    schedule = learning_rate_schedule(config, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(i.grad_clip_norm),
        optax.adamw(
            schedule,
            b1=i.b1,
            b2=i.b2,
            eps=i.eps,
            weight_decay=i.weight_decay,
            mask=lambda p: jax.tree.map(lambda rank: rank >= 2, stacking.layer_ndim(p)),
        ),
    )
    out = InnerOptimizer(tx.init, tx.update)
    out.learning_rate = schedule
    return out


def learning_rates(tx: InnerOptimizer, first: int, steps: int) -> list[float]:
    """The learning rate of each of `steps` inner steps taken with `tx`, the first after `first` updates.

    Each is `tx.learning_rate(count)` at the update count before its step
    (optax's AdamW reads its schedule at the count, then advances it: the
    island's first step runs at count 0), evaluated one by one on the host
    (a vectorised call may round differently) and given as Python floats of
    the float32 values; about 0.2 ms a step.
    """
    return [float(tx.learning_rate(count)) for count in range(first, first + steps)]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in nats over real tokens.

    Args:
      logits: float32 [B, S, V].
      targets: int32 [B, S].
      mask: optional [B, S], 1 for a real token and 0 for padding.

    Returns:
      A float32 scalar.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return jnp.mean(losses)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)


def packed_masks(segments: jax.Array | None, mask: jax.Array | None = None):
    """(the model's mask, the loss's mask, the inputs' segment ids), each [B, S] or None, of packed records'
    segment ids: the masks float32, the segment ids int32 (None for byte windows).

    Args:
      segments: int32 [B, S + 1], the segment ids of inputs and targets together (`data.records.pack`; 0 on
        padding), or None (byte windows: every token real).
      mask: optional float32 [B, S], 1 for a real row's input, 0 for a padded row.

    Returns:
      The model's mask keeps padding out of the experts' slots (an input whose segment is 0); the loss's
      counts a target whose segment is not 0, so that every token of a record's documents but its first is
      predicted once (the first of a document from the end-of-document token before it; a shard's very first
      token is no record's target).
    """
    if segments is None:
        return mask, mask, None
    inputs, targets = (segments[:, :-1] != 0).astype(jnp.float32), (segments[:, 1:] != 0).astype(jnp.float32)
    if mask is not None:
        inputs, targets = inputs * mask, targets * mask
    return inputs, targets, segments[:, :-1]


def loss_fn(graphdef, params, inputs, targets, moe_config, mask=None, key=None, cross_entropy_coef=1.0,
            segments=None):
    """Training loss: cross-entropy + load-balancing and router z-loss terms (means over MoE layers).

    Args:
      graphdef, params: the model (`nnx.split`) and its parameters (pure dict).
      inputs, targets: int32 [B, S]; mask: optional [B, S] (1 real, 0 padded).
      moe_config: `config.moe` (the two loss coefficients).
      key: PRNG key for router jitter (training), or None.
      cross_entropy_coef: weight of the language-model loss (1; 0 isolates the auxiliary losses).
      segments: int32 [B, S + 1] segment ids of packed records (`packed_masks`), or None.

    Returns:
      (loss [], metrics): the STEP_METRICS scalars (but grad_norm) and, per MoE
      layer, `layers`: the LAYER_METRICS arrays.
    """
    model_mask, loss_mask, segment_ids = packed_masks(segments, mask)
    logits, per_layer = nnx.merge(graphdef, nnx.State(params))(inputs, model_mask, key, segment_ids)
    stats = aggregate_stats(per_layer)
    ce = cross_entropy(logits, targets, loss_mask)
    loss = (
        cross_entropy_coef * ce
        + moe_config.load_balancing_loss_coef * stats["load_balancing_loss"]
        + moe_config.router_z_loss_coef * stats["router_z_loss"]
    )
    return loss, dict(stats, cross_entropy=ce, loss=loss, layers=per_layer)


def build_train_step(
    config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, tx: optax.GradientTransformation
) -> Callable:
    """The jitted inner step `(params, opt_state, inputs, targets, step, segments=None) -> (params, opt_state,
    metrics)`.

    `inputs`, `targets` are int32 [B, S], `segments` the int32 [B, S + 1] segment ids of packed records
    (`packed_masks`) or None for byte windows; `step` (an int, the island's inner
    steps so far) seeds the router jitter when `moe.jitter_noise` > 0. The
    parameters and optimizer state are donated. `metrics` holds the
    STEP_METRICS scalars and `layers` (the LAYER_METRICS arrays). With
    `moe.routing_bias_update_rate` > 0 the routing biases move outside the
    optimizer, by the step's expert load (DeepSeek-V3, arXiv 2412.19437).
    """
    moe_config, seed = config.moe, config.seed

    def train_step(params, opt_state, inputs, targets, step, segments=None):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step) if moe_config.jitter_noise > 0 else None
        grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef), has_aux=True)
        (_, metrics), grads = grad_fn(params, inputs, targets, moe_config, None, key, 1.0, segments)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if moe_config.routing_bias_update_rate > 0:
            params = update_routing_biases(
                params, metrics["layers"]["expert_load"], moe_config.routing_bias_update_rate
            )
        return params, opt_state, dict(metrics, grad_norm=optax.tree.norm(grads))

    return jax.jit(train_step, donate_argnums=(0, 1))


def build_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """The jitted `(params, inputs, targets, mask, segments=None) -> cross-entropy per window` (nats per token,
    float32 [B]: each row's mean over its S targets, or over the targets of packed records' documents,
    `packed_masks`; 0 for a row with none), no router jitter. `mask` (float32 [B, S], 1 real, 0 a padded row)
    keeps padded rows out of the MoE layers' expert slots, so they change no real window's loss."""

    def eval_step(params, inputs, targets, mask, segments=None):
        model_mask, loss_mask, segment_ids = packed_masks(segments, mask)
        logits, _ = nnx.merge(graphdef, nnx.State(params))(inputs, model_mask, None, segment_ids)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        if segments is None:
            return jnp.mean(losses, axis=-1)
        return jnp.sum(losses * loss_mask, axis=-1) / jnp.maximum(jnp.sum(loss_mask, axis=-1), 1.0)

    return jax.jit(eval_step)


def build_probe_step(graphdef: nnx.GraphDef) -> Callable:
    """The jitted `(params, inputs, mask, segments=None) -> top_experts`: int32 [L, B, S, k], the experts each MoE
    layer's router chose for every token of the probe batch (`moe.MoE.capture_routing`: nothing dropped, so a
    token's choices depend on its own window alone, whatever the mesh), no router jitter."""

    def probe_step(params, inputs, mask, segments=None):
        model_mask, _, segment_ids = packed_masks(segments, mask)
        model = nnx.merge(graphdef, nnx.State(params))
        for _, module in nnx.iter_modules(model):
            if isinstance(module, MoE):
                module.capture_routing = True
        _, per_layer = model(inputs, model_mask, None, segment_ids)
        return per_layer["top_experts"]

    return jax.jit(probe_step)


@jax.jit
def pseudo_gradient(anchor, params):
    """DiLoCo's outer gradient, anchor - params, in float32 (any pytree, leaves of any float dtype)."""
    return jax.tree.map(lambda a, p: a.astype(jnp.float32) - p.astype(jnp.float32), anchor, params)


@jax.jit
def mix(local: list, global_: list, alpha: jax.Array) -> list:
    """Streaming DiLoCo's merge of an updated fragment: alpha x local + (1 - alpha) x global per leaf.

    Computed in float32 and cast back to each local leaf's dtype; `alpha` is a
    float32 scalar (`outer.mix_alpha`).
    """
    return [(alpha * x.astype(jnp.float32) + (1.0 - alpha) * g.astype(jnp.float32)).astype(x.dtype)
            for x, g in zip(local, global_)]


def batch_args(batch: tuple, step: int) -> tuple:
    """The train step's arguments after the state, of `Shardings.batch_of`'s (inputs, targets, segments):
    (inputs, targets, step), and the segments when the batch is of packed records."""
    inputs, targets, segments = batch
    return (inputs, targets, step) if segments is None else (inputs, targets, step, segments)


def train_losses(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, batches, steps: int) -> tuple[list, dict]:
    """Cross-entropy of each of `steps` inner steps of a freshly initialised model on `mesh`, with no outer loop:
    a quick comparison of settings (bfloat16 against float32, say) on the same batches.

    Args:
      config: the model, MoE and inner optimizer settings (islands are not read).
      mesh: an `island_mesh` to train on; the batch is split over every axis.
      batches: `batches[step]`, a batch of `data.train_dataset` (byte windows or packed records).
      steps: inner steps, which also set the learning-rate schedule's length.

    Returns:
      (the per-step cross-entropy in nats per token as floats, the parameters after the last step).
    """
    graphdef, params, specs = init_params(config)
    shardings = Shardings(mesh, specs)
    tx = inner_optimizer(config, steps)
    train_step = build_train_step(config, graphdef, tx)
    losses = []
    with jax.set_mesh(mesh):
        params = shardings.place(params)
        opt_state = jax.jit(tx.init)(params)
        for step in range(steps):
            params, opt_state, metrics = train_step(params, opt_state, *batch_args(shardings.batch_of(batches[step]), step))
            losses.append(float(metrics["cross_entropy"]))
    return losses, params
