"""An island: one JAX mesh training a full replica of the model on its own data.

Per round (DiLoCo, arXiv 2311.08105, Algorithm 1): H jitted inner AdamW steps
from the anchor (the global parameters of the round's start), then the
pseudo-gradient anchor - params over `nnx.Param`s, encoded for the wire. When
the coordinator's update arrives, the island applies it to its host copy of the
global parameters with the shared `codec.decode_and_apply`, and those exact bits
become both the new anchor and the new local parameters. The AdamW state is kept
across rounds, as DiLoCo does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax import data as data_lib
from island_jax.mesh import island_mesh
from island_jax.models.moe import BATCH_AXES, check_dispatch
from island_jax.models.transformer import aggregate_stats, update_routing_biases
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib
from island_jax.params import checksum
from island_jax.planning import plan_inner_steps

# Scalars each inner step reports (see `Island.train_round`); the MoE ones are means over MoE layers.
STEP_METRICS = (
    "loss", "cross_entropy", "load_balancing_loss", "router_z_loss", "router_entropy", "dropped_fraction", "grad_norm"
)
# Per-MoE-layer arrays each inner step reports: [L] each, expert_load [L, E].
LAYER_METRICS = ("load_balancing_loss", "router_z_loss", "router_entropy", "dropped_fraction", "capacity", "expert_load")


def inner_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and warm-up + cosine decay over `total_steps` inner steps.

    Weight decay applies to matrices only (rank >= 2), not to norms' scales.
    """
    i = config.inner
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=i.learning_rate,
        warmup_steps=min(i.warmup_steps, max(total_steps - 1, 0)),
        decay_steps=max(total_steps, 1),
        end_value=i.learning_rate * i.min_learning_rate_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(i.grad_clip_norm),
        optax.adamw(
            schedule,
            b1=i.b1,
            b2=i.b2,
            eps=i.eps,
            weight_decay=i.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-byte cross-entropy in nats over real tokens. logits [B, S, V] float32, targets and mask [B, S]."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return jnp.mean(losses)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)


def loss_fn(graphdef, params, inputs, targets, moe_config, mask=None, key=None, cross_entropy_coef=1.0):
    """Training loss: cross-entropy + load-balancing and router z-loss terms (means over MoE layers).

    Args:
      graphdef, params: the model (`nnx.split`) and its parameters (pure dict).
      inputs, targets: int32 [B, S]; mask: optional [B, S] (1 real, 0 padded).
      moe_config: `config.moe` (the two loss coefficients).
      key: PRNG key for router jitter (training), or None.
      cross_entropy_coef: weight of the language-model loss (1; 0 isolates the auxiliary losses).

    Returns:
      (loss [], metrics): the STEP_METRICS scalars (but grad_norm) and, per MoE
      layer, `layers`: the LAYER_METRICS arrays.
    """
    logits, per_layer = nnx.merge(graphdef, nnx.State(params))(inputs, mask, key)
    stats = aggregate_stats(per_layer)
    ce = cross_entropy(logits, targets, mask)
    loss = (
        cross_entropy_coef * ce
        + moe_config.load_balancing_loss_coef * stats["load_balancing_loss"]
        + moe_config.router_z_loss_coef * stats["router_z_loss"]
    )
    return loss, dict(stats, cross_entropy=ce, loss=loss, layers=per_layer)


class Island:
    """One island: its mesh, parameters, AdamW state, anchor and data shard.

    Args:
      name: the island's key in `config.islands`.
      config: the run's validated config.
      devices: this island's own devices (len = islands.NAME.num_devices).
      graphdef, params, specs: from `params.init_params(config)` (params are
        the seeded initial values as NumPy arrays).
      train_bytes: the island's training shard (uint8 [N]).
      total_rounds: rounds in the run, for the learning-rate schedule.
    """

    def __init__(
        self,
        name: str,
        config: ml_collections.ConfigDict,
        devices: Sequence[jax.Device],
        graphdef: nnx.GraphDef,
        params: dict,
        specs: dict,
        train_bytes: np.ndarray,
        total_rounds: int,
    ):
        cfg = config.islands[name]
        self.name, self.config = name, config
        self.inner_steps = plan_inner_steps(config)[name]
        self.simulated_speed = cfg.simulated_speed
        self.batch_size = cfg.batch_size
        self.seq_len = config.model.seq_len
        check_dispatch(config.moe.dispatch, cfg.mesh.expert, devices[0].platform)
        self.mesh = island_mesh(cfg.mesh.data, cfg.mesh.expert, devices)
        self._param_sharding = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )
        self._batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES))
        self.global_params = params  # host copy of the global view (NumPy): the anchor
        self._global_checksum: str | None = None
        self.dataset = data_lib.train_dataset(train_bytes, self.seq_len, cfg.batch_size, config.seed)
        self.step = 0  # inner steps taken: also the data position
        self._compute_times: collections.deque = collections.deque(maxlen=16)  # recent steps' seconds, no sleep
        self.tokens_per_step = cfg.batch_size * self.seq_len
        self._graphdef = graphdef
        self._build_train_step(self.inner_steps * total_rounds)
        tx = self.tx

        def eval_step(params, inputs, targets):
            logits, _ = nnx.merge(graphdef, nnx.State(params))(inputs)  # no jitter
            return cross_entropy(logits, targets)

        def pseudo_gradient(anchor, params):
            return jax.tree.map(lambda a, p: a.astype(jnp.float32) - p.astype(jnp.float32), anchor, params)

        self._eval_step = jax.jit(eval_step)
        self._pseudo_gradient = jax.jit(pseudo_gradient)
        with jax.set_mesh(self.mesh):
            self.params = self._place(params)
            self.anchor = self._place(params)
            self.opt_state = jax.jit(tx.init)(self.params)
        # Error feedback's memory of what the codec lost (float32 NumPy, like the parameters).
        self.residual = jax.tree.map(lambda x: np.zeros(np.shape(x), np.float32), params)
        c = config.codec
        self.plan = codec.chunk_plan(params, c.kind, c.block_size, config.comm.chunk_bytes)
        # Streaming DiLoCo's fragments: leaf indices (jax.tree.leaves order) and each one's chunk plan.
        self._treedef = jax.tree.structure(params)
        self.partition = fragments_lib.partition(fragments_lib.leaf_bytes(params), config.outer.fragments)
        leaves = jax.tree.leaves(params)
        self.fragment_plans = [
            codec.chunk_plan([leaves[i] for i in idx], c.kind, c.block_size, config.comm.chunk_bytes)
            for idx in self.partition
        ]
        self._leaf_shardings = jax.tree.leaves(self._param_sharding)
        self.device_lock = contextlib.nullcontext()  # held around device work when islands share a process

        def mix(local, global_, alpha):
            return [(alpha * l.astype(jnp.float32) + (1.0 - alpha) * g.astype(jnp.float32)).astype(l.dtype)
                    for l, g in zip(local, global_)]

        self._mix = jax.jit(mix)

    def _build_train_step(self, total_steps: int) -> None:
        """The inner optimizer for `total_steps` steps in all, and the jitted step that uses it (its first
        call compiles)."""
        self._compile_pending = True
        self.last_step_compiled = False
        self.tx = tx = inner_optimizer(self.config, total_steps)
        moe_config, seed, graphdef = self.config.moe, self.config.seed, self._graphdef

        def train_step(params, opt_state, inputs, targets, step):
            key = jax.random.fold_in(jax.random.PRNGKey(seed), step) if moe_config.jitter_noise > 0 else None
            grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef), has_aux=True)
            (_, metrics), grads = grad_fn(params, inputs, targets, moe_config, None, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            if moe_config.routing_bias_update_rate > 0:  # outside the optimizer (DeepSeek-V3)
                params = update_routing_biases(
                    params, metrics["layers"]["expert_load"], moe_config.routing_bias_update_rate
                )
            return params, opt_state, dict(metrics, grad_norm=optax.tree.norm(grads))

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1))

    def set_inner_steps(self, inner_steps: int, rounds_left: int) -> None:
        """A new H for the remaining rounds (a plan from measured step times).

        The learning-rate schedule is rebuilt to end after the steps left
        (warm-up and cosine keep their shape; the AdamW state carries over).
        """
        self.inner_steps = inner_steps
        self._build_train_step(self.step + inner_steps * rounds_left)

    def _place(self, host_params: dict) -> dict:
        return jax.device_put(host_params, self._param_sharding)

    def _batch(self, windows: np.ndarray) -> tuple[jax.Array, jax.Array]:
        windows = windows.astype(np.int32)
        return (
            jax.device_put(windows[:, :-1], self._batch_sharding),
            jax.device_put(windows[:, 1:], self._batch_sharding),
        )

    def warm_up(self) -> None:
        """Compiles the inner step, and the fragments' pseudo-gradient and mixing programs, on throwaway
        copies, so that the first round's steps are steps (nothing of the island's state changes)."""
        with self.device_lock, jax.set_mesh(self.mesh):
            params = jax.tree.map(lambda x: x.copy(), self.params)
            opt_state = jax.tree.map(lambda x: x.copy(), self.opt_state)
            inputs, targets = self._batch(self.dataset[self.step])
            jax.block_until_ready(self._train_step(params, opt_state, inputs, targets, self.step))
            self._compile_pending = False
            anchor, local = jax.tree.leaves(self.anchor), jax.tree.leaves(self.params)
            for idx in self.partition:
                a, p = [anchor[i] for i in idx], [local[i] for i in idx]
                jax.block_until_ready(self._pseudo_gradient(a, p))
                jax.block_until_ready(self._mix(p, a, np.float32(self.config.outer.mix_alpha)))

    def train_round(self, num_steps: int | None = None, after_step=None, seconds: float | None = None) -> dict:
        """Runs one round of inner steps from the current parameters.

        The round is `num_steps` steps when given; otherwise the planned H
        (`outer.sync` "steps" or "auto"), or as many steps as fit in
        `outer.round_seconds` of wall clock (`outer.sync = "time"`, at least
        one; `seconds`, when given, replaces that budget). With
        `islands.NAME.simulated_speed` s < 1 the island sleeps (1/s - 1) x the
        median time of its last 16 steps after each step, standing for slower
        hardware (a median, so that a step slowed by other work on the machine
        is not slowed twice); the sleep counts as compute. A step that compiled (the first after the step was built,
        unless `warm_up` ran) does not sleep, and `last_step_compiled` says so. `after_step(steps_done, elapsed_seconds,
        step_seconds)`, when given, is called after every step (sleep included)
        on this thread: Streaming DiLoCo contributes and applies fragments there
        (island_jax/streaming.py).

        Returns:
          dict with `steps`, `tokens` (processed this round), `seconds` (wall,
          sleeps included), `busy_seconds` (steps only), `step_seconds` (the
          median step, sleep included: robust to the first step's compilation), per-step lists of the
          STEP_METRICS scalars, `layers` (per step, the LAYER_METRICS arrays per
          MoE layer), `expert_load` of the last step [num_moe_layers, E], and
          `step_times` (each step's seconds, sleep included).
        """
        budget = seconds
        if budget is None and num_steps is None and self.config.outer.sync == "time":
            budget = self.config.outer.round_seconds
        num_steps = self.inner_steps if num_steps is None else num_steps
        slowdown = 1.0 / self.simulated_speed - 1.0
        start = time.perf_counter()
        history, busy, step_times = [], 0.0, []
        with jax.set_mesh(self.mesh):
            while (len(history) < num_steps) if budget is None else (
                not history or time.perf_counter() - start < budget
            ):
                step_start = time.perf_counter()
                inputs, targets = self._batch(self.dataset[self.step])
                with self.device_lock:
                    self.params, self.opt_state, metrics = self._train_step(
                        self.params, self.opt_state, inputs, targets, self.step
                    )
                    # One step in flight at a time: XLA:CPU's in-process collectives can
                    # deadlock when consecutive steps' all-to-alls interleave across devices.
                    jax.block_until_ready(metrics)
                step_seconds = time.perf_counter() - step_start
                busy += step_seconds
                self.last_step_compiled, self._compile_pending = self._compile_pending, False
                sleep = 0.0
                if not self.last_step_compiled:
                    self._compute_times.append(step_seconds)
                    sleep = float(np.median(self._compute_times)) * slowdown
                step_times.append(step_seconds + sleep)  # what the step costs, sleep included
                if sleep > 0:
                    time.sleep(sleep)
                history.append(metrics)
                self.step += 1
                if after_step is not None:
                    after_step(len(history), time.perf_counter() - start, step_times[-1])
            history = jax.device_get(history)
        seconds = time.perf_counter() - start
        out = {k: [float(m[k]) for m in history] for k in STEP_METRICS}
        out["layers"] = [{k: np.asarray(m["layers"][k]) for k in LAYER_METRICS} for m in history]
        out.update(
            steps=len(history),
            tokens=len(history) * self.tokens_per_step,
            seconds=seconds,
            busy_seconds=busy,
            step_seconds=float(np.median(step_times)) if step_times else 0.0,
            expert_load=out["layers"][-1]["expert_load"] if history else None,
            step_times=step_times,
        )
        return out

    def encode_pseudo_gradient(self) -> codec.ChunkEncoder:
        """anchor - params (float32, one program on the island's devices), encoded with `config.codec`:
        on an accelerator by one more program there, on CPUs chunk by chunk (`comm.chunk_bytes`) as the
        transport sends it (see `codec.ChunkEncoder`).

        With `codec.error_feedback`, what the codec lost in the previous round is
        added first, and what it loses now is kept for the next round.
        Once the payload is sent, the encoder's `relative_error` is ||sent - intended|| / ||intended||.
        """
        c = self.config.codec
        with jax.set_mesh(self.mesh):
            pg = self._pseudo_gradient(self.anchor, self.params)
            return codec.ChunkEncoder(
                pg, c.kind, c.block_size, self.plan, self.residual if c.error_feedback else None, measure=True
            )

    @property
    def global_checksum(self) -> str:
        """`params.checksum` of the global parameters (the anchors), computed when first asked for."""
        if self._global_checksum is None:
            self._global_checksum = checksum(self.global_params)
        return self._global_checksum

    # -- fragments (Streaming DiLoCo) ------------------------------------------------------------------

    def _global_leaves(self, fragment: int) -> list[np.ndarray]:
        leaves = jax.tree.leaves(self.global_params)
        return [leaves[i] for i in self.partition[fragment]]

    def fragment_pseudo_gradient(self, fragment: int) -> list[jax.Array]:
        """anchor - params (float32) over the fragment's leaves, on the island's devices.

        Runs on the calling (training) thread and waits for the result, so the
        next inner step may take (donate) the parameters.
        """
        idx = self.partition[fragment]
        anchor, params = jax.tree.leaves(self.anchor), jax.tree.leaves(self.params)
        with self.device_lock, jax.set_mesh(self.mesh):
            pg = self._pseudo_gradient([anchor[i] for i in idx], [params[i] for i in idx])
            return jax.block_until_ready(pg)

    def encode_fragment(self, fragment: int, pseudo_gradient: list) -> codec.ChunkEncoder:
        """The fragment's pseudo-gradient for the wire (`codec.ChunkEncoder` over `fragment_plans[fragment]`).

        Safe on a background thread. With `codec.error_feedback` the fragment's
        residual leaves are read and updated in place.
        """
        c = self.config.codec
        residual = None
        if c.error_feedback:
            leaves = jax.tree.leaves(self.residual)
            residual = [leaves[i] for i in self.partition[fragment]]
        return codec.ChunkEncoder(
            pseudo_gradient, c.kind, c.block_size, self.fragment_plans[fragment], residual, measure=True
        )

    def fragment_checksum(self, fragment: int) -> str:
        """`params.checksum` of the fragment's global leaves (a list): what its contribution carries."""
        return checksum(self._global_leaves(fragment))

    def decode_fragment(self, fragment: int, payload: bytes) -> list[np.ndarray]:
        """The fragment's new global leaves: its update applied with `codec.decode_and_apply` (host NumPy).

        Safe on a background thread (reads only this fragment's global leaves).

        Raises:
          CodecError: if the payload does not fit the fragment.
        """
        c = self.config.codec
        return codec.decode_and_apply(self._global_leaves(fragment), payload, c.kind, c.block_size)

    def place_fragment(self, fragment: int, global_leaves: list[np.ndarray], copies: int) -> list[list[jax.Array]]:
        """`copies` placements of a fragment's new global leaves on the island's devices, for
        `apply_fragment` (one for the anchor, one more for the parameters without mixing). Safe on a
        background thread, so the training thread does not wait for the copies."""
        shardings = [self._leaf_shardings[i] for i in self.partition[fragment]]
        placed = [jax.device_put(list(global_leaves), shardings) for _ in range(copies)]
        return jax.block_until_ready(placed)

    def apply_fragment(
        self, fragment: int, global_leaves: list[np.ndarray], mix_alpha: float | None = None, placed=None
    ) -> None:
        """Takes a fragment's new global leaves: they become its anchor, and its parameters become
        `mix_alpha` x local + (1 - mix_alpha) x global (Streaming DiLoCo's mixing), or exactly the
        global values when `mix_alpha` is None (no overlap). `placed`: `place_fragment`'s copies
        (two without mixing), when already made."""
        idx = self.partition[fragment]
        host = jax.tree.leaves(self.global_params)
        for i, leaf in zip(idx, global_leaves):
            host[i] = leaf
        self.global_params = jax.tree.unflatten(self._treedef, host)
        self._global_checksum = None
        if placed is None:
            placed = self.place_fragment(fragment, global_leaves, 1 if mix_alpha is not None else 2)
        anchor, params = jax.tree.leaves(self.anchor), jax.tree.leaves(self.params)
        with self.device_lock, jax.set_mesh(self.mesh):
            new_anchor = placed[0]
            if mix_alpha is None:
                new_params = placed[1]
            else:  # dispatched; the next inner step waits for it
                new_params = self._mix([params[i] for i in idx], new_anchor, np.float32(mix_alpha))
            for k, i in enumerate(idx):
                anchor[i], params[i] = new_anchor[k], new_params[k]
            self.anchor = jax.tree.unflatten(self._treedef, anchor)
            self.params = jax.tree.unflatten(self._treedef, params)

    def apply_update(self, payload: bytes) -> None:
        """Applies the coordinator's update to the global view; it becomes anchor and params.

        Raises:
          CodecError: if the payload does not fit the model.
        """
        self._set_global(
            codec.decode_and_apply(self.global_params, payload, self.config.codec.kind, self.config.codec.block_size)
        )

    def load_view(self, payload: bytes) -> None:
        """Replaces the global parameters with the coordinator's view, sent whole (`Coordinator.fetch_view`).

        Raises:
          CodecError: if the payload does not fit the model.
        """
        self._set_global(codec.decode_view(payload, self.global_params))

    def _set_global(self, global_params: dict) -> None:
        self.global_params = global_params
        self._global_checksum = None
        with jax.set_mesh(self.mesh):
            self.params = self._place(global_params)
            self.anchor = self._place(global_params)

    def state(self, round: int) -> dict:
        """What a checkpoint holds after `round` completed rounds: `params`, `anchor`,
        `opt_state` (AdamW), `residual` (error feedback), `step` (inner steps taken,
        also the data position) and `round`."""
        return dict(
            params=self.params,
            anchor=self.anchor,
            opt_state=self.opt_state,
            residual=self.residual,
            step=np.asarray(self.step, np.int64),
            round=np.asarray(round, np.int64),
        )

    def load_state(self, state: dict) -> int:
        """Continues from a checkpointed `state()`; returns its round (completed rounds)."""
        opt_sharding = jax.tree.map(lambda x: x.sharding, self.opt_state)
        self.global_params = state["anchor"]
        self._global_checksum = None
        with jax.set_mesh(self.mesh):
            self.params = self._place(state["params"])
            self.anchor = self._place(state["anchor"])
            self.opt_state = jax.device_put(state["opt_state"], opt_sharding)
        self.residual = jax.tree.map(lambda x: np.array(x, np.float32, copy=True), state["residual"])
        self.step = int(state["step"])
        return int(state["round"])

    def params_checksum(self) -> str:
        """Checksum of the parameters on the island's devices (gathered to the host)."""
        return checksum(jax.device_get(self.params))

    def evaluate(self, batches: Sequence[np.ndarray], global_params: bool = False) -> float:
        """Mean cross-entropy (nats per byte) over fixed batches, of the island's parameters or (with
        `global_params`) of the global ones, its anchors (the same once every update is applied without
        overlap)."""
        params = self.anchor if global_params else self.params
        with self.device_lock, jax.set_mesh(self.mesh):
            # One batch in flight at a time, as in train_round (XLA:CPU rendezvous).
            losses = [float(self._eval_step(params, *self._batch(b))) for b in batches]
            return float(np.mean(np.asarray(losses, np.float32)))
