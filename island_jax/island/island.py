"""An island: one JAX mesh training a full replica of the model on its own data.

Per round (DiLoCo, arXiv 2311.08105, Algorithm 1): H jitted inner AdamW steps
from the anchor (the global parameters of the round's start), then the
pseudo-gradient anchor - params, fragment by fragment (Streaming DiLoCo,
arXiv 2501.18512, Algorithm 1; one fragment is plain DiLoCo), encoded for the
wire, and the coordinator's update applied (`fragments.py`). The AdamW state
is kept across rounds, as DiLoCo does. The programs are in `step.py`, the
placement on the mesh in `placement.py`, the checkpointed state in
`state.py`; the schedule that calls these methods is `outer_loop.StreamingSync`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from island_jax import data as data_lib
from island_jax import distributed
from island_jax.config import ConfigError
from island_jax.hardware import CATALOG, kind_of, peak_flops
from island_jax.island import shards as shards_lib
from island_jax.island import step as step_lib
from island_jax.island.fragments import FragmentExchange, OuterLeaves
from island_jax.island.placement import Shardings
from island_jax.island.state import CheckpointState
from island_jax.mesh import island_mesh
from island_jax.model.flops import model_size
from island_jax.model.init import checksum
from island_jax.model.moe import LAYER_METRICS, check_dispatch
from island_jax.model.transformer import routing_shape
from island_jax.outer.inner_steps import plan_inner_steps


class SimulatedSpeed:
    """Sleep standing for slower hardware: (1/s - 1) x the median compute seconds of the last 16 steps,
    after each step (`islands.NAME.simulated_speed` s; 1.0 never sleeps). A median, so that a step slowed
    by other work on the machine is not slowed twice."""

    STEPS_KEPT = 16

    def __init__(self, speed: float):
        self.slowdown = 1.0 / speed - 1.0
        self._compute_times: collections.deque = collections.deque(maxlen=self.STEPS_KEPT)

    def sleep_seconds(self, compute_seconds: float) -> float:
        """Records a (not compiling) step's compute seconds; returns how long to sleep after it, s."""
        self._compute_times.append(compute_seconds)
        return float(np.median(self._compute_times)) * self.slowdown


class Island(FragmentExchange, CheckpointState):
    """One island: its mesh, parameters, AdamW state, anchor and data shard.

    Parameters, anchor and optimizer state live on the island's devices,
    sharded by `specs`; `global_params` is this process's host copy of its shards (`shards.HostLeaf`) of the global
    view, the anchor's exact bits. Its fragment methods (pseudo-gradient out, update in) are
    `fragments.FragmentExchange`'s, its checkpoint methods `state.CheckpointState`'s.

    Args:
      name: the island's key in `config.islands`.
      config: the run's validated config.
      devices: this island's own devices (len = islands.NAME.num_devices).
      graphdef, params, specs: from `model.init.init_params(config)` or, drawn on the island's own mesh,
        `init_params(config, mesh)` (params are the seeded initial values: NumPy arrays, or `jax.Array`s
        already sharded by `specs`, which the island then holds as its parameters).
      train: the island's training data: its shard of the byte corpus (uint8 [N]), or its records
        (`data.Corpus.train`: a `grain.MapDataset` of packed records, or an endless mixture of them).
      total_rounds: the rounds the learning-rate schedule is laid out over (`workdir.schedule_rounds`: the run's
        rounds, or those it started with when it was extended; rounds past them hold the schedule's final value).
      device_lock: held around the island's device work (a `threading.Lock` shared by the islands of one
        process on XLA:CPU; None: no lock).

    Raises:
      ValueError: `moe.dispatch` cannot run on these devices (`model.moe.check_dispatch`).

    Attributes:
      step: inner steps taken over the run; also the data position.
      inner_steps: H, inner steps per round.
      tokens_per_step: batch_size x seq_len tokens per inner step.
      partition: per fragment (`outer.fragments`), its leaf indices in `jax.tree.leaves` order.
      fragment_plans: per fragment, its payload's `codec.Chunk`s (`comm.chunk_bytes` each at most).
      last_step_compiled: the last inner step compiled (its seconds are no step time).
      device_lock: held around device work (a context manager).
    """

    def __init__(
        self,
        name: str,
        config: ml_collections.ConfigDict,
        devices: Sequence[jax.Device],
        graphdef: nnx.GraphDef,
        params: dict,
        specs: dict,
        train,
        total_rounds: int,
        device_lock=None,
    ):
        cfg = config.islands[name]
        self.device_lock = device_lock or contextlib.nullcontext()
        self.name, self.config = name, config
        self.inner_steps = plan_inner_steps(config)[name]
        self.batch_size = cfg.batch_size
        self.tokens_per_step = cfg.batch_size * config.model.seq_len
        # MFU's numerator per token and denominator (model/flops.py; a CPU's peak is measured, shared by its devices)
        self.flops_per_token = model_size(config).flops_per_token
        if devices[0].platform != "cpu" and cfg.hardware == "cpu":  # MFU and the memory check would use CPU figures
            raise ConfigError(
                f"islands.{name}.hardware is 'cpu' but its devices are {devices[0].platform} "
                f"({devices[0].device_kind}); set islands.{name}.hardware to their catalog name "
                f"({kind_of(devices[0]) or 'one of ' + ', '.join(sorted(CATALOG))})"
            )
        self.peak_flops = peak_flops(cfg.hardware, len(devices), devices[0].platform)
        self._speed = SimulatedSpeed(cfg.simulated_speed)
        check_dispatch(config.moe.dispatch, cfg.mesh.expert, devices[0].platform)
        self.mesh = island_mesh(cfg.mesh.data, cfg.mesh.expert, devices, fsdp=cfg.mesh.fsdp)
        self.shardings = Shardings(self.mesh, specs, params)
        # Of an island of several processes: this process's index and their count; each sends the chunks it owns
        # of every payload (`ownerships`), and every process holds the same bits of the shards it holds.
        self.multi_process = self.shardings.multi_process
        self.part, self.parts = (jax.process_index(), jax.process_count()) if self.multi_process else (0, 1)
        # The outer loop's leaves (the per-layer form's: a stacked leaf's layer slices, `fragments.OuterLeaves`),
        # where each one's elements are over the island's processes, and this process's host copy of the global
        # view (the anchor's bits): its own shards of every outer leaf (`shards.HostLeaf`).
        self.outer = OuterLeaves(params)
        leaves = jax.tree.leaves(params)
        self.layouts = []
        for slot in self.outer.slots:
            leaf, sharding = leaves[slot.leaf], self.shardings.leaves[slot.leaf]
            if slot.layer is not None:  # a layer's slice: the stacked axis is never split
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.P(*sharding.spec[1:]))
            shape = np.shape(leaf)[0 if slot.layer is None else 1:]
            self.layouts.append(shards_lib.LeafLayout(shape, leaf.dtype, sharding))
        with jax.set_mesh(self.mesh):
            self.global_params = self.host_shards(params)
        self._global_checksum: str | None = None
        self.dataset = data_lib.train_dataset(
            train, config.model.seq_len, cfg.batch_size, config.seed, rows=self.shardings.local_rows(cfg.batch_size)
        )
        self.step = 0
        self._graphdef = graphdef
        self.total_rounds = total_rounds
        self._build_train_step(self.inner_steps * total_rounds)
        self._eval_step = step_lib.build_eval_step(graphdef)
        with self.device_lock, jax.set_mesh(self.mesh):
            self.params = self.shardings.place(params)
            self.anchor = self.shardings.place(params, copy=True)  # the inner steps donate the parameters
            self.opt_state = jax.jit(self.tx.init)(self.params)
        self._plan_fragments()
        # per fragment: the assignments routed to each expert since its last contribution (int64 [F, L, E]; None
        # for a model without MoE layers), what its next contribution's header carries (`take_routed_counts`)
        layers, experts, _ = routing_shape(config)
        self.routed_pending = np.zeros((len(self.partition), layers, experts), np.int64) if layers else None
        self.routed_steps = np.zeros(len(self.partition), np.int64)  # per fragment: the steps those counts cover
        self.step_losses: dict[int, float] = {}  # step (over the run) -> its loss, for the recent steps
        self._probe = None  # the routing probe batch (`set_routing_probe`) and its program

    def _build_train_step(self, total_steps: int) -> None:
        """The inner optimizer for `total_steps` steps in all, and the jitted step that uses it (its first
        call compiles)."""
        self._compile_pending = True
        self.last_step_compiled = False
        self.tx = step_lib.inner_optimizer(self.config, total_steps)
        self._train_step = step_lib.build_train_step(self.config, self._graphdef, self.tx)

    def set_inner_steps(self, inner_steps: int, rounds_left: int) -> None:
        """A new H for the remaining rounds (a plan from measured step times).

        The learning-rate schedule is rebuilt to end after the steps left
        (warm-up and cosine keep their shape; the AdamW state carries over).
        """
        self.inner_steps = inner_steps
        self._build_train_step(self.step + inner_steps * rounds_left)

    def warm_up(self) -> None:
        """Compiles the inner step, and the fragments' pseudo-gradient and mixing programs, on throwaway
        copies, so that the first round's steps are steps (nothing of the island's state changes)."""
        with self.device_lock, jax.set_mesh(self.mesh):
            params = jax.tree.map(lambda x: x.copy(), self.params)
            opt_state = jax.tree.map(lambda x: x.copy(), self.opt_state)
            batch = self.shardings.batch_of(self.dataset[self.step], self.batch_size)
            jax.block_until_ready(self._train_step(params, opt_state, *step_lib.batch_args(batch, self.step)))
            self._compile_pending = False
            for f in range(len(self.partition)):
                jax.block_until_ready(self.outer.pseudo_gradient(self.anchor, self.params, self.partition[f]))
                a, p = self.fragments.take(self.anchor, f), self.fragments.take(self.params, f)
                jax.block_until_ready(step_lib.mix(p, a, np.float32(self.config.outer.mix_alpha)))

    def train_round(self, num_steps: int | None = None, after_step=None, seconds: float | None = None) -> dict:
        """Runs one round of inner steps from the current parameters.

        The round is `num_steps` steps when given; otherwise the planned H
        (`outer.sync` "steps" or "auto"), or as many steps as fit in
        `outer.round_seconds` of wall clock (`outer.sync = "time"`, at least
        one; `seconds`, when given, replaces that budget). With
        `islands.NAME.simulated_speed` < 1 the island sleeps after each step
        (`SimulatedSpeed`); the sleep counts as compute. A step that compiled (the first after the step was built,
        unless `warm_up` ran) does not sleep, and `last_step_compiled` says so. `after_step(steps_done, elapsed_seconds,
        step_seconds)`, when given, is called after every step (sleep included)
        on this thread: Streaming DiLoCo contributes and applies fragments there
        (`outer_loop.StreamingSync`).

        Returns:
          dict with `steps`, `tokens` (processed this round), `seconds` (wall,
          sleeps included), `busy_seconds` (steps only), `step_seconds` (the
          median step, sleep included: robust to the first step's compilation), `compute_step_seconds`
          (the median step without its sleep, over the steps that did not compile: what `SimulatedSpeed`
          scales; 0.0 when every step compiled), `mfu` (model FLOPs utilization at the median step,
          `Island.mfu`), per-step lists of the
          STEP_METRICS scalars, `layers` (per step, the LAYER_METRICS arrays per
          MoE layer; `routed_counts` of a step are also summed per fragment, `take_routed_counts`),
          `expert_load` of the last step [num_moe_layers, E], and
          `step_times` (each step's seconds, sleep included).
        """
        budget = seconds
        if budget is None and num_steps is None and self.config.outer.sync == "time":
            budget = self.config.outer.round_seconds
        num_steps = self.inner_steps if num_steps is None else num_steps
        start = time.perf_counter()
        history, busy, step_times, compute_times = [], 0.0, [], []
        with jax.set_mesh(self.mesh):
            while (len(history) < num_steps) if budget is None else (
                not history or time.perf_counter() - start < budget
            ):
                step_start = time.perf_counter()
                batch = self.shardings.batch_of(self.dataset[self.step], self.batch_size)
                with self.device_lock:
                    self.params, self.opt_state, metrics = self._train_step(
                        self.params, self.opt_state, *step_lib.batch_args(batch, self.step)
                    )
                    # One step in flight at a time: XLA:CPU's in-process collectives can
                    # deadlock when consecutive steps' all-to-alls interleave across devices.
                    jax.block_until_ready(metrics)
                step_seconds = time.perf_counter() - step_start
                busy += step_seconds
                self.last_step_compiled, self._compile_pending = self._compile_pending, False
                sleep = 0.0 if self.last_step_compiled else self._speed.sleep_seconds(step_seconds)
                if not self.last_step_compiled:
                    compute_times.append(step_seconds)
                step_times.append(step_seconds + sleep)  # what the step costs, sleep included
                if sleep > 0:
                    time.sleep(sleep)
                history.append(metrics)
                # two small replicated arrays, before `after_step` contributes: the loss (the post-sync change)
                # and the routed counts [L, E] int32
                host = self.shardings.to_host((metrics["loss"], metrics.get("layers", {}).get("routed_counts")))
                self.step_losses[self.step] = float(host[0])
                self.step_losses.pop(self.step - 4 * max(self.inner_steps, 1), None)
                if self.routed_pending is not None:
                    self.routed_pending += host[1]
                    self.routed_steps += 1
                self.step += 1
                if after_step is not None:
                    after_step(len(history), time.perf_counter() - start, step_times[-1])
            history = self.shardings.to_host(history)
        seconds = time.perf_counter() - start
        out = {k: [float(m[k]) for m in history] for k in step_lib.STEP_METRICS}
        out["layers"] = [{k: np.asarray(m["layers"][k]) for k in LAYER_METRICS} for m in history]
        out.update(
            steps=len(history),
            tokens=len(history) * self.tokens_per_step,
            seconds=seconds,
            busy_seconds=busy,
            step_seconds=float(np.median(step_times)) if step_times else 0.0,
            compute_step_seconds=float(np.median(compute_times)) if compute_times else 0.0,
            mfu=self.mfu(float(np.median(step_times))) if step_times else 0.0,
            expert_load=out["layers"][-1]["expert_load"] if history else None,
            step_times=step_times,
        )
        return out

    def take_routed_counts(self, fragment: int, tokens: int) -> dict:
        """The assignments this island's routers sent to each routed expert since `fragment`'s last contribution,
        before capacity drops, for a contribution of `tokens` tokens, and a new count from zero.

        Returns:
          The header's fields (`ContributionHeader`): `routed_counts` int64 [MoE layers, experts], each layer
          summing to the real (unpadded) tokens x `moe.num_experts_per_token`, and `unrouted_tokens`, the
          padding positions among `tokens`; {} for a model without MoE layers, for a contribution whose steps the
          counts do not all cover (of a fragment contributed within a round, steps before a resume that kept no
          counts: logged), and for one of no real token, so that the contribution goes without counts and under
          `outer.expert_weighting = "tokens_routed"` its round merges the experts by `outer.weighting`.
        """
        if self.routed_pending is None:
            return {}
        counts, steps = self.routed_pending[fragment].copy(), int(self.routed_steps[fragment])
        self.routed_pending[fragment], self.routed_steps[fragment] = 0, 0
        k = self.config.moe.num_experts_per_token
        sums = counts.sum(axis=1)
        if steps * self.tokens_per_step != tokens:
            logging.warning("island %s: the routed counts of fragment %d cover %d of its contribution's %d steps "
                            "(steps before a resume); it is sent without them", self.name, fragment, steps,
                            tokens // max(self.tokens_per_step, 1))
            return {}
        if not sums[0] or (sums != sums[0]).any() or sums[0] % k:
            return {}
        return dict(routed_counts=counts, unrouted_tokens=tokens - int(sums[0]) // k)

    def reset_routed_counts(self) -> None:
        """Every fragment's routed counts start from zero here (its tokens count from the island's current step)."""
        if self.routed_pending is not None:
            self.routed_pending[...] = 0
            self.routed_steps[...] = 0

    def set_routing_probe(self, batch: tuple[np.ndarray, int] | None, tokens: int) -> None:
        """The fixed probe batch the island routes at the end of each round (`route_probe`): the first
        `data.eval_batches` batch of the shared held-out set, (windows, how many are real), of which the first
        `tokens` tokens are kept; None or 0 tokens: no probe. Compiles the probe's program now (every process of
        an island calls this together), so that no round's clock counts XLA."""
        if batch is None or tokens <= 0 or self.routed_pending is None:
            self._probe = None
            return
        windows, real = batch
        seq_len, devices = windows.shape[-1] - 1, self.mesh.devices.size
        holding = min(-(-tokens // seq_len), real)  # the windows that hold the probe's first tokens
        rows = min(len(windows), -(-holding // devices) * devices)  # a whole row per device: the batch is split
        windows, real = windows[:rows], min(real, rows)
        mask = np.zeros((rows, seq_len), np.float32)
        mask[:real] = 1.0
        self._probe = (windows, mask, min(tokens, real * seq_len), step_lib.build_probe_step(self._graphdef))
        self.route_probe()

    def route_probe(self) -> np.ndarray | None:
        """The experts this island's routers choose, with its current parameters, for the probe's first tokens:
        uint8 (uint16 past 256 experts) [MoE layers, tokens, k]; None without a probe (`set_routing_probe`)."""
        if self._probe is None:
            return None
        windows, mask, tokens, probe = self._probe
        rows = self.shardings.local_rows(len(windows))
        with self.device_lock, jax.set_mesh(self.mesh):
            inputs, _, segments = self.shardings.batch_of(windows[rows], len(windows))
            mask = self.shardings.rows_of(mask[rows], len(windows))
            top = probe(self.params, inputs, mask) if segments is None else probe(self.params, inputs, mask, segments)
            top = np.asarray(self.shardings.to_host(top))
        layers, _, _, k = top.shape
        dtype = np.uint8 if self.config.moe.num_experts <= 256 else np.dtype("<u2")
        return top.reshape(layers, -1, k)[:, :tokens].astype(dtype)

    def mfu(self, step_seconds: float) -> float:
        """Model FLOPs utilization of an inner step of `step_seconds` s: FLOPs per token x tokens per step /
        (peak FLOP/s x step_seconds) (`model.flops`; 0 for a step of no seconds)."""
        return self.flops_per_token * self.tokens_per_step / (self.peak_flops * step_seconds) if step_seconds > 0 else 0.0

    def host_shards(self, tree) -> Any:
        """This process's shards of a parameter-shaped tree of arrays (the island's form: on its devices, or NumPy),
        copied to the host as the per-layer form's tree of `shards.HostLeaf`s (`OuterLeaves`): what
        `model.init.checksum` reads without gathering anything whole."""
        with jax.set_mesh(self.mesh):
            leaves = self.outer.of(tree)
        return jax.tree.unflatten(self.outer.treedef, [shards_lib.HostLeaf.of(layout, x)
                                                       for layout, x in zip(self.layouts, leaves)])

    def replica_digests(self) -> dict[str, str]:
        """SHA-256 (16 hex digits) of each shard of the global parameters that this process holds and another
        process holds too ({"leaf,shard": digest}), for the processes to compare."""
        out = {}
        for i, (layout, leaf) in enumerate(zip(self.layouts, jax.tree.leaves(self.global_params))):
            for k in layout.mine:
                if len(layout.holders[k]) > 1:
                    out[f"{i},{k}"] = hashlib.sha256(np.ascontiguousarray(leaf.shards[k]).tobytes()).hexdigest()[:16]
        return out

    @property
    def global_checksum(self) -> str:
        """`model.init.checksum` of the global parameters (the anchors), computed when first asked for."""
        if self._global_checksum is None:
            self._global_checksum = checksum(self.global_params)
        return self._global_checksum

    def agree(self, value) -> list:
        """Every process's `value` (JSON), in process order (`distributed.allgather_json`, a collective on the
        training thread); [value] for an island of one process."""
        return distributed.allgather_json(value) if self.multi_process else [value]

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self, batches: Sequence[tuple[np.ndarray, int]], global_params: bool = False) -> np.ndarray:
        """Cross-entropy per held-out window (nats per token), of the island's parameters or (with
        `global_params`) of the global ones, its anchors (the same once every update is applied without overlap).

        Args:
          batches: `data.eval_batches`: (uint8 [B, S + 1] byte windows or int32 [B, 2, S + 1] packed records,
            how many of its first rows are windows) each.

        Returns:
          float32 [windows]: each window's mean loss over its S targets (over its documents' targets for packed
          records), in the batches' order; the padded
          rows of a batch are left out.
        """
        params = self.anchor if global_params else self.params
        with self.device_lock, jax.set_mesh(self.mesh):
            # One batch in flight at a time, as in train_round (XLA:CPU rendezvous).
            rows = self.shardings.local_rows(len(batches[0][0])) if batches else slice(None)
            losses = []
            for b, real in batches:
                mask = np.zeros((len(b), b.shape[-1] - 1), np.float32)
                mask[:real] = 1.0  # padded rows take no expert slot
                inputs, targets, segments = self.shardings.batch_of(b[rows], len(b))
                mask = self.shardings.rows_of(mask[rows], len(b))
                loss = (self._eval_step(params, inputs, targets, mask) if segments is None
                        else self._eval_step(params, inputs, targets, mask, segments))
                losses.append(np.asarray(self.shardings.to_host(loss), np.float32)[:real])
            return np.concatenate(losses) if losses else np.zeros(0, np.float32)
