"""An island: one JAX mesh training a full replica of the model on its own data.

Per round (DiLoCo, arXiv 2311.08105, Algorithm 1): H jitted inner AdamW steps
from the anchor (the global parameters of the round's start), then the
pseudo-gradient anchor - params over `nnx.Param`s, fragment by fragment
(Streaming DiLoCo, arXiv 2501.18512, Algorithm 1; one fragment is plain
DiLoCo), encoded for the wire. When the coordinator's update of a fragment
arrives, the island applies it to its host copy of the global parameters with
the shared `codec.decode_and_apply`, and those exact bits become the
fragment's new anchor and, without overlap, its new local parameters. The
AdamW state is kept across rounds, as DiLoCo does. The programs are in
`step.py`; the schedule that calls these methods is `outer_loop.StreamingSync`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax import data as data_lib
from island_jax import distributed
from island_jax.checkpoint import CheckpointError
from island_jax.config import ConfigError, error_feedback
from island_jax.hardware import CATALOG, kind_of, peak_flops
from island_jax.island import shards as shards_lib
from island_jax.island import step as step_lib
from island_jax.mesh import BATCH_AXES, island_mesh
from island_jax.model.flops import model_size
from island_jax.model.init import checksum
from island_jax.model.moe import LAYER_METRICS, check_dispatch
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib
from island_jax.outer.inner_steps import plan_inner_steps


@dataclasses.dataclass(frozen=True)
class FragmentLeaves:
    """Streaming DiLoCo's fragments as leaf indices of the parameter tree.

    Attributes:
      treedef: the parameter tree's structure.
      partition: per fragment, its leaf indices in `jax.tree.leaves` order (`outer.fragments.partition`).
    """

    treedef: Any
    partition: list[list[int]]

    def take(self, tree, fragment: int) -> list:
        """The fragment's leaves of `tree` (a parameter-shaped pytree), in order."""
        leaves = jax.tree.leaves(tree)
        return [leaves[i] for i in self.partition[fragment]]

    def put(self, tree, fragment: int, new_leaves: Sequence) -> Any:
        """`tree` with the fragment's leaves replaced by `new_leaves` (a new tree; `tree` is unchanged)."""
        leaves = jax.tree.leaves(tree)
        for i, leaf in zip(self.partition[fragment], new_leaves):
            leaves[i] = leaf
        return jax.tree.unflatten(self.treedef, leaves)


class Shardings:
    """Where an island's arrays live on its mesh: parameters by their partition specs, batches split over
    `mesh.BATCH_AXES`.

    On a mesh that spans several processes (a multi-process island) every process places only the shards its
    own devices hold (`jax.make_array_from_callback`, no communication, so it is safe on any thread), and
    reads arrays back whole through a jitted all-gather over the island's interconnect (`to_host`, a
    collective: the training thread only, at the same point on every process).

    Attributes:
      multi_process: the mesh spans devices of other processes.
    """

    def __init__(self, mesh: jax.sharding.Mesh, specs: dict, shapes: dict | None = None):
        self.params = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        self.leaves = jax.tree.leaves(self.params)
        # the shapes of the parameter leaves that are split over devices: never gathered whole (`to_host`)
        self._split_shapes = set() if shapes is None else {
            tuple(np.shape(x)) for x, s in zip(jax.tree.leaves(shapes), self.leaves) if not s.is_fully_replicated
        }
        self.batch = NamedSharding(mesh, P(BATCH_AXES))
        self.multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        self._replicate = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))

    def _put(self, tree, shardings, copy: bool = False):
        alias = False if copy else None  # a jax.Array already placed is itself unless a copy is asked for
        if not self.multi_process:
            return jax.device_put(tree, shardings, may_alias=alias)

        def put(x, sharding):
            if isinstance(x, jax.Array):  # drawn or restored onto the devices already
                return jax.device_put(x, sharding, may_alias=alias)
            return jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index])

        return jax.tree.map(put, tree, shardings)

    def place(self, params: dict, copy: bool = False) -> dict:
        """The parameters on the devices, sharded: NumPy arrays (whole on every process), or `jax.Array`s (drawn
        sharded, `init_params` on a mesh, or restored), which are returned as they are when already placed so,
        unless `copy`."""
        return self._put(params, self.params, copy)

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a [batch_size, ...] batch that this process's devices hold (all of them in one process).

        Raises:
          ValueError: they are not contiguous (a mesh whose devices are not grouped by process).
        """
        spans = sorted({(i[0].start or 0, batch_size if i[0].stop is None else i[0].stop)
                        for i in self.batch.addressable_devices_indices_map((batch_size, 1)).values()})
        lo, hi = spans[0][0], spans[-1][1]
        if sum(b - a for a, b in spans) != hi - lo:
            raise ValueError(f"this process's rows of the batch are not contiguous: {spans}")
        return slice(lo, hi)

    def batch_of(self, windows: np.ndarray, batch_size: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """A batch on the devices: (inputs, targets) int32 [B, S] each, and the segment ids int32 [B, S + 1] of
        packed records (None for byte windows).

        Args:
          windows: uint8 [b, S + 1] byte windows, or int32 [b, 2, S + 1] packed records (tokens, then segment
            ids: `prepared.PreparedDataset`); this process's rows (`local_rows`) of a batch of `batch_size`
            (default: b, one process holds all).
        """
        windows = np.asarray(windows).astype(np.int32)
        segments = None
        if windows.ndim == 3:
            windows, segments = windows[:, 0], self.rows_of(windows[:, 1], batch_size)
        return self.rows_of(windows[:, :-1], batch_size), self.rows_of(windows[:, 1:], batch_size), segments

    def rows_of(self, rows: np.ndarray, batch_size: int | None = None) -> jax.Array:
        """[b, S] rows (this process's, `local_rows`, of a batch of `batch_size`) on the devices, split as a batch."""
        if not self.multi_process:
            return jax.device_put(rows, self.batch)
        return jax.make_array_from_process_local_data(self.batch, rows, (batch_size or len(rows), rows.shape[1]))

    def to_host(self, tree):
        """Every leaf whole, as NumPy (a collective on a multi-process mesh unless the leaves are replicated): for
        metrics and losses.

        Raises:
          ValueError: on a multi-process mesh, a leaf shaped like a parameter that is split over the devices (no
            process holds more of the model than its shards; `shards.HostLeaf` is a process's host copy).
        """
        if not self.multi_process:
            return jax.device_get(tree)
        leaves, treedef = jax.tree.flatten(tree)
        spread = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_replicated]
        for i in spread:
            if tuple(leaves[i].shape) in self._split_shapes:
                raise ValueError(f"to_host of an array shaped like a parameter split over the island's processes "
                                 f"({tuple(leaves[i].shape)}) would hold it whole on every host; read this process's "
                                 "shards instead (shards.HostLeaf)")
        for i, x in zip(spread, self._replicate([leaves[i] for i in spread]) if spread else ()):
            leaves[i] = x
        host = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x) for x in leaves]
        return jax.tree.unflatten(treedef, host)


_LAYOUT_BYTES = 64  # `Island.layout_name` in a checkpoint, zero-padded


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


class Island:
    """One island: its mesh, parameters, AdamW state, anchor and data shard.

    Parameters, anchor and optimizer state live on the island's devices,
    sharded by `specs`; `global_params` is this process's host copy of its shards (`shards.HostLeaf`) of the global
    view, the anchor's exact bits.

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
        # Where each leaf's elements are over the island's processes, and this process's host copy of the global view
        # (the anchor's bits): its own shards of every leaf (`shards.HostLeaf`).
        self.layouts = [shards_lib.LeafLayout(np.shape(x), x.dtype, sharding)
                        for x, sharding in zip(jax.tree.leaves(params), self.shardings.leaves)]
        self.global_params = jax.tree.unflatten(jax.tree.structure(params), [
            shards_lib.HostLeaf.of(layout, x) for layout, x in zip(self.layouts, jax.tree.leaves(params))
        ])
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
        # Error feedback's memory of what the codec lost, of the pieces this process owns: {(fragment, leaf, first
        # element): float32 [piece elements]}, made as the pieces are first encoded.
        self.residual: dict[tuple[int, int, int], np.ndarray] = {}
        self.codec = codec.Codec.of(config.codec)  # the contributions'
        self.update_codec = codec.Codec.of(config.codec, update=True)  # the coordinator's updates'
        self.partition = fragments_lib.partition(fragments_lib.leaf_bytes(params), config.outer.fragments)
        self.fragments = FragmentLeaves(jax.tree.structure(params), self.partition)
        chunk_bytes = config.comm.chunk_bytes
        # per fragment: the contribution's chunk plan, and the update's (the same elements, in its codec's bytes)
        self.fragment_plans = [
            codec.chunk_plan(self.fragments.take(params, f), self.codec, None, chunk_bytes, self.update_codec)
            for f in range(len(self.partition))
        ]
        self.update_plans = [
            codec.chunk_plan(self.fragments.take(params, f), self.update_codec, None, chunk_bytes, self.codec)
            for f in range(len(self.partition))
        ]
        # per fragment: which process owns each chunk, and what travels over the island's interconnect
        self.ownerships = [
            shards_lib.Ownership(plan, [self.layouts[i] for i in self.partition[f]], self.parts, update)
            for f, (plan, update) in enumerate(zip(self.fragment_plans, self.update_plans))
        ]

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
                a, p = self.fragments.take(self.anchor, f), self.fragments.take(self.params, f)
                jax.block_until_ready(step_lib.pseudo_gradient(a, p))
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
          MoE layer), `expert_load` of the last step [num_moe_layers, E], and
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

    def mfu(self, step_seconds: float) -> float:
        """Model FLOPs utilization of an inner step of `step_seconds` s: FLOPs per token x tokens per step /
        (peak FLOP/s x step_seconds) (`model.flops`; 0 for a step of no seconds)."""
        return self.flops_per_token * self.tokens_per_step / (self.peak_flops * step_seconds) if step_seconds > 0 else 0.0

    def host_shards(self, tree) -> Any:
        """This process's shards of a parameter-shaped tree of arrays on the island's devices, copied to the host
        (`shards.HostLeaf` each): what `model.init.checksum` reads without gathering anything whole."""
        layouts = jax.tree.unflatten(jax.tree.structure(self.global_params), self.layouts)
        return jax.tree.map(shards_lib.HostLeaf.of, layouts, tree)

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

    # -- fragments (Streaming DiLoCo) ------------------------------------------------------------------

    def fragment_pseudo_gradient(self, fragment: int) -> shards_lib.OwnedValues:
        """anchor - params (float32, each leaf's shape and sharding) over the fragment's leaves, computed on the
        island's devices, as the values of the chunks this process owns (`shards.Ownership`): read from its own
        shards where it holds them, and from the other processes (a collective over the island's interconnect)
        for the few elements at shard edges that it lacks.

        Runs on the calling (training) thread and waits for the result, so the
        next inner step may take (donate) the parameters.
        """
        anchor, params = self.fragments.take(self.anchor, fragment), self.fragments.take(self.params, fragment)
        with self.device_lock, jax.set_mesh(self.mesh):
            pseudo_gradient = jax.block_until_ready(step_lib.pseudo_gradient(anchor, params))
        layouts = self.ownerships[fragment].layouts
        local: dict[tuple[int, int], np.ndarray] = {}
        for i, leaf in enumerate(pseudo_gradient):
            for shard in leaf.addressable_shards:
                key = (i, layouts[i].key_of(shard.index))
                if key not in local:  # a view of the device buffer on the CPU; the leaves stay alive with it
                    local[key] = np.asarray(shard.data).reshape(-1)

        def read(leaf: int, shard: int, _keep=pseudo_gradient) -> np.ndarray:
            return local[(leaf, shard)]

        return self.ownerships[fragment].owner_values(read)

    def encode_fragment(self, fragment: int, pseudo_gradient: shards_lib.OwnedValues) -> codec.ChunkEncoder:
        """This process's chunks of the fragment's pseudo-gradient for the wire (`codec.ChunkEncoder` over its share
        of `fragment_plans[fragment]`, in `self.codec`; its `nbytes` is the share's bytes).

        Safe on a background thread. With error feedback (`codec.error_feedback`, always for topk), what the codec
        lost last time is added first, and the residual of each piece is
        overwritten as it is encoded. Once the payload is sent, the encoder's
        `relative_error` is ||sent - intended|| / ||intended||.
        """
        residual_of = None
        if error_feedback(self.config.codec):
            kept = self.residual  # an encoder left running past a rejoin writes to the replaced dict, not the new one

            def residual_of(piece: codec.Piece) -> np.ndarray:
                key = (fragment, piece.leaf, piece.start)
                found = kept.get(key)
                return found if found is not None else kept.setdefault(key, np.zeros(piece.stop - piece.start, np.float32))

        share = self.ownerships[fragment].share
        return codec.ChunkEncoder(None, self.codec, None, share, measure=True, read=pseudo_gradient.read,
                                  residual_of=residual_of, decay=self.config.codec.error_feedback_decay)

    def fragment_checksum(self, fragment: int) -> str:
        """`model.init.checksum` of the fragment's global leaves (a list): what its contribution carries. With one
        fragment it equals `global_checksum`. Of an island of several processes, a collective (training thread)."""
        return checksum(self.fragments.take(self.global_params, fragment))

    def gather_update(self, fragment: int, payload: bytes) -> dict:
        """Where this process reads each update chunk of the fragment that it holds elements of: its own chunks in
        `payload` (what its transport fetched), the others' passed on by their owners over the island's
        interconnect (`shards.Ownership.update_sources`: a collective, on the training thread, when any chunk
        has holders besides its owner)."""
        return self.ownerships[fragment].update_sources(payload)

    def agree(self, value) -> list:
        """Every process's `value` (JSON), in process order (`distributed.allgather_json`, a collective on the
        training thread); [value] for an island of one process."""
        return distributed.allgather_json(value) if self.multi_process else [value]

    def decode_fragment(self, fragment: int, update) -> list[shards_lib.HostLeaf]:
        """The fragment's new global leaves, this process's shards of them: the update applied with the arithmetic
        of `codec.decode_and_apply`, chunk by chunk. `update`: `gather_update`'s sources, or (an island of one
        process) the fetched payload itself.

        Safe on a background thread with one process (reads only this fragment's global leaves).

        Raises:
          CodecError: if the update does not fit the fragment.
        """
        ownership = self.ownerships[fragment]
        if not isinstance(update, dict):
            expected = sum(chunk.nbytes for chunk in self.update_plans[fragment])
            if len(update) != expected:
                raise codec.CodecError(
                    f"the update of fragment {fragment} is {len(update)} bytes but its {self.update_codec} plan holds "
                    f"{expected}; the coordinator uses another model shape or codec (codec.update_kind)")
            update = ownership.update_sources(update)
        return ownership.apply(self.fragments.take(self.global_params, fragment), update, self.update_codec)

    def place_fragment(self, fragment: int, global_leaves: list[shards_lib.HostLeaf], copies: int) -> list[list[jax.Array]]:
        """`copies` placements of a fragment's new global leaves on the island's devices, for
        `apply_fragment` (one for the anchor, one more for the parameters without mixing). Safe on a
        background thread, so the training thread does not wait for the copies."""
        placed = [[leaf.place() for leaf in global_leaves] for _ in range(copies)]
        return jax.block_until_ready(placed)

    def apply_fragment(
        self, fragment: int, global_leaves: list[np.ndarray], mix_alpha: float | None = None, placed=None
    ) -> None:
        """Takes a fragment's new global leaves: they become its anchor, and its parameters become
        `mix_alpha` x local + (1 - mix_alpha) x global (Streaming DiLoCo's mixing), or exactly the
        global values when `mix_alpha` is None (no overlap). `placed`: `place_fragment`'s copies
        (two without mixing), when already made."""
        fragments = self.fragments
        self.global_params = fragments.put(self.global_params, fragment, global_leaves)
        self._global_checksum = None
        if placed is None:
            placed = self.place_fragment(fragment, global_leaves, 1 if mix_alpha is not None else 2)
        with self.device_lock, jax.set_mesh(self.mesh):
            new_anchor = placed[0]
            if mix_alpha is None:
                new_params = placed[1]
            else:  # dispatched; the next inner step waits for it
                local = fragments.take(self.params, fragment)
                new_params = step_lib.mix(local, new_anchor, np.float32(mix_alpha))
            self.anchor = fragments.put(self.anchor, fragment, new_anchor)
            self.params = fragments.put(self.params, fragment, new_params)

    def view_chunks(self, plan: list[codec.Chunk]) -> list[codec.Chunk]:
        """The chunks of the view's plan (a float32 "none" payload of every leaf) that hold elements of this
        process's shards (`shards.view_chunks`): all of them with one process."""
        return list(plan) if not self.multi_process else shards_lib.view_chunks(plan, self.layouts)

    def load_view(self, payload: bytes) -> None:
        """Replaces the global parameters with the coordinator's view, sent whole (`FragmentedCoordinator.fetch_view`,
        a float32 "none" payload); this process keeps its own shards of it, which become both anchor and
        parameters, and the error feedback starts afresh.

        Raises:
          CodecError: if the payload does not fit the model.
        """
        leaves, treedef = jax.tree.flatten(self.global_params)
        like = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        expected = codec.payload_bytes(like, "none", 1)
        if len(payload) != expected:
            raise codec.CodecError(f"the view is {len(payload)} bytes but a float32 view of these parameters is "
                                   f"{expected} bytes; the coordinator uses a different model shape")
        whole = codec.Chunk(0, 0, expected, tuple(codec.pieces(like, "none", 1)))
        ownership = shards_lib.Ownership([whole], self.layouts, self.parts)
        self.global_params = jax.tree.unflatten(treedef, ownership.apply(leaves, {0: (memoryview(payload), 0)}, codec.Codec("none"), add=False))
        self._global_checksum = None
        # what the codec lost of pseudo-gradients from the replaced anchors is no debt of the new ones
        self.residual = {}
        with jax.set_mesh(self.mesh):
            self.params = jax.tree.map(shards_lib.HostLeaf.place, self.global_params)
            self.anchor = jax.tree.map(shards_lib.HostLeaf.place, self.global_params)

    # -- checkpoints and evaluation --------------------------------------------------------------------

    def _residual_sharding(self) -> NamedSharding:
        """The error-feedback residual's sharding in a checkpoint: one row per process, split over its devices."""
        devices = np.asarray(self.mesh.devices).reshape(-1)
        rows = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(self.parts, -1)
        return NamedSharding(jax.sharding.Mesh(rows, ("process", "local")), P("process", "local"))

    def _owned_pieces(self):
        """(residual key, its place in this process's residual row, elements) of each piece this process owns, in
        fragment, chunk and piece order: the layout of `_residual_rows`."""
        at = 0
        for f, ownership in enumerate(self.ownerships):
            for chunk in ownership.share:
                for piece in chunk.pieces:
                    yield (f, piece.leaf, piece.start), at, piece.stop - piece.start
                    at += piece.stop - piece.start

    def _residual_rows(self, template: bool) -> jax.Array:
        """The error-feedback residual as float32 [processes, elements]: row p holds, in fragment, chunk and piece
        order, the residual of the pieces process p owns (zero-padded to the longest row, rounded up to a
        multiple of its devices, which hold a part of it each). Each process writes its own row; nothing is
        gathered."""
        sizes = [sum(o.residual_elements[p] for o in self.ownerships) for p in range(self.parts)]
        local = self.mesh.devices.size // self.parts
        row = np.zeros((1, -(-max(max(sizes), 1) // local) * local), np.float32)
        if not template:
            for key, at, n in self._owned_pieces():
                kept = self.residual.get(key)
                if kept is not None:
                    row[0, at : at + n] = kept
        return jax.make_array_from_callback((self.parts, row.shape[1]), self._residual_sharding(),
                                            lambda index: row[:, index[1]])

    def _load_residual(self, rows) -> None:
        """Takes this process's row of a checkpoint's `_residual_rows`."""
        self.residual = {}
        if isinstance(rows, jax.Array):  # this process's row, from the parts its devices hold
            row = np.zeros(rows.shape[1], np.float32)
            for shard in rows.addressable_shards:
                if shard.index[0].indices(self.parts)[0] == self.part:
                    row[shard.index[1]] = np.asarray(shard.data).reshape(-1)
        else:  # restored on the host (an island of one process)
            row = np.asarray(rows)[self.part]
        for key, at, n in self._owned_pieces():
            if row[at : at + n].any():
                self.residual[key] = np.array(row[at : at + n], np.float32)

    def state(self, round: int, template: bool = False) -> dict:
        """What a checkpoint holds after `round` completed rounds: `params`, `anchor`,
        `opt_state` (AdamW), `step` (inner steps taken, also the data position; int64 []) and `round` (int64
        []); with error feedback (`config.error_feedback`) also `residual` (`_residual_rows`: each process's own pieces, one row
        per process, so a resume needs the same processes and layout). A `template` is only a state to
        restore into (its residual is zeros)."""
        out = dict(
            params=self.params,
            anchor=self.anchor,
            opt_state=self.opt_state,
            step=np.asarray(self.step, np.int64),
            round=np.asarray(round, np.int64),
        )
        if error_feedback(self.config.codec):
            out["residual"] = self._residual_rows(template)
            out["residual_layout"] = self._residual_layout()
        return out

    def _residual_layout(self) -> np.ndarray:
        """uint8 [_LAYOUT_BYTES]: a digest of which process owns which pieces (16 bytes), then `layout_name`
        (zero-padded): what a checkpoint's residual rows need of the run that restores them."""
        owned = [[[c.index for c in share] for share in o.shares] for o in self.ownerships]
        digest = hashlib.sha256(repr(owned).encode()).digest()[:16]
        name = self.layout_name().encode()[: _LAYOUT_BYTES - 16]
        return np.frombuffer(digest + name.ljust(_LAYOUT_BYTES - 16, b"\0"), np.uint8)

    def layout_name(self) -> str:
        """The island's layout, which decides which process owns which chunk: e.g. "2 processes, data=1 fsdp=2
        expert=2"."""
        mesh = self.config.islands[self.name].mesh
        return f"{self.parts} process{'es' if self.parts > 1 else ''}, data={mesh.data} fsdp={mesh.fsdp} expert={mesh.expert}"

    def load_state(self, state: dict) -> int:
        """Continues from a checkpointed `state()`; returns its round (completed rounds). The parameters, anchor and
        AdamW state are placed by this run's layout, whatever the layout that saved them.

        Raises:
          CheckpointError: the state holds an error-feedback residual saved under another layout (`layout_name`).
        """
        opt_sharding = jax.tree.map(lambda x: x.sharding, self.opt_state)
        self.global_params = self.host_shards(state["anchor"])
        self._global_checksum = None
        with jax.set_mesh(self.mesh):
            self.params = self.shardings.place(state["params"])
            self.anchor = self.shardings.place(state["anchor"])
            self.opt_state = jax.device_put(state["opt_state"], opt_sharding)
        if "residual" in state:
            saved = bytes(np.asarray(state["residual_layout"], np.uint8))
            if saved[:16] != bytes(self._residual_layout()[:16]):
                raise CheckpointError(
                    f"island {self.name}'s checkpoint holds the error-feedback residual of the chunks each process "
                    f"owned under another layout ({saved[16:].rstrip(bytes(1)).decode()}) than this run's "
                    f"({self.layout_name()}); resume with that layout, or start a new --workdir")
            self._load_residual(state["residual"])
        self.step = int(state["step"])
        return int(state["round"])

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
