"""An island's device mesh, the names of its axes, and the one table that maps parameters' logical axes to them.

Axes, in order (docs/island.md):
  data    splits the batch; parameters are replicated over it.
  fsdp    splits the batch, and also every parameter (with its gradient, both AdamW moments and the
          anchor) on its `embed` dimension: fully sharded data parallelism (ZeRO-3; MaxText's `fsdp`).
          A layer gathers the whole weight just before it uses it (`gathered`), and the gradient
          comes back reduce-scattered to the same shards.
  expert  holds the experts of every MoE layer (expert parallelism), and splits the batch outside them.

`data x fsdp x expert` is the island's device count; fsdp = 1 is the replicated layout of data parallelism.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"  # splits the batch
FSDP_AXIS = "fsdp"  # splits the batch and shards every parameter on its `embed` dimension
EXPERT_AXIS = "expert"  # holds the experts of every MoE layer; also splits the batch outside them
AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)  # the mesh's axes, in order
BATCH_AXES = AXES  # the batch is split over every axis

# Logical axis names a parameter's dimensions carry (`nnx.Param(..., sharding=...)`), and the mesh axis each
# maps to: the one rules table (`nnx.logical_axis_rules`). A name mapped to None is never split.
#   vocab     the vocabulary (embedding rows, output-head columns)
#   position  learned positions
#   embed     the model width D (every matrix has it): split over fsdp
#   qkv       the fused query/key/value outputs, (H + 2 K) Dh (3 D without grouped-query attention)
#   heads     the attention's concatenated heads on the way out, D
#   mlp       a SwiGLU's hidden width F (dense layers and each expert)
#   expert    the routed experts, E: split over expert
#   router    the router's output (one logit per expert), the routing bias and the shared experts' gate
#   norm      an RMSNorm's scale, D (small: replicated)
#   layers    the leading axis of `model.scan_layers`'s stacked parameters (one entry per repeat of the unit):
#             never split, so each layer's slice is sharded exactly as the unstacked parameter is
LOGICAL_RULES = (
    ("layers", None),
    ("vocab", None),
    ("position", None),
    ("embed", FSDP_AXIS),
    ("qkv", None),
    ("heads", None),
    ("mlp", None),
    ("expert", EXPERT_AXIS),
    ("router", None),
    ("norm", None),
)


def fsdp_leading(spec: P) -> P:
    """`spec` with its `FSDP_AXIS` moved to the leading dimension not split over `EXPERT_AXIS`: every parameter that
    `LOGICAL_RULES` splits over fsdp (on its `embed` dimension) is split there instead, so that what one fsdp shard
    holds of it is one run of consecutive elements (C order) per expert it holds, and a chunk of the outer loop's
    plan meets at most two shards' edges. Specs without `FSDP_AXIS` are returned unchanged.

    Each island checks that its `mesh.fsdp` divides those dimensions (`config.validate`).
    """
    entries = list(spec)
    if not any(_uses(entry, FSDP_AXIS) for entry in entries):
        return spec
    entries = [_without(entry, FSDP_AXIS) for entry in entries]
    leading = next(d for d, entry in enumerate(entries) if not _uses(entry, EXPERT_AXIS))
    entries[leading] = FSDP_AXIS if entries[leading] is None else (*_as_tuple(entries[leading]), FSDP_AXIS)
    return P(*entries)


def _as_tuple(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def spec_of(names: Sequence[str]) -> P:
    """The PartitionSpec of a parameter whose dimensions carry the logical axis `names`: each mapped by
    `LOGICAL_RULES`, then fsdp moved to the leading non-expert dimension (`fsdp_leading`) after the leading
    `layers` dimensions of a stacked parameter, which stay whole."""
    rules = dict(LOGICAL_RULES)
    stacked = next((d for d, name in enumerate(names) if name != "layers"), len(names))
    return P(*(None,) * stacked, *fsdp_leading(P(*(rules[name] for name in names[stacked:]))))


_SHARDED_INIT: contextvars.ContextVar = contextvars.ContextVar("island_jax_sharded_init", default=None)


@contextlib.contextmanager
def sharded_init(mesh: jax.sharding.Mesh):
    """Within it, `logical` initializers make each parameter directly sharded on `mesh` by `spec_of` its names:
    every device draws only its own shard (random bits are partitionable: `jax_threefry_partitionable`), so each
    process computes only its shards, and on the CPU the values are the bits of an unsharded draw."""
    token = _SHARDED_INIT.set(mesh)
    try:
        yield
    finally:
        _SHARDED_INIT.reset(token)


def logical(initializer, *names: str):
    """`initializer` whose `nnx.Param` carries the logical axis names `names`, one per dimension (names of
    `LOGICAL_RULES`). Outside `sharded_init` the value is made whole and unsharded (`eager_sharding=False`), and
    `Island` places it by `transformer.partition_specs`; within it, it is drawn sharded on the mesh."""
    from flax import nnx

    def init(key, shape, dtype=np.float32):
        mesh = _SHARDED_INIT.get()
        if mesh is None:
            return initializer(key, shape, dtype)
        return initializer(key, shape, dtype, out_sharding=jax.sharding.NamedSharding(mesh, spec_of(names)))

    return nnx.with_partitioning(init, names, eager_sharding=False)


def use_cpu_devices(count: int) -> None:
    """Gives this process `count` (at least 1) virtual CPU devices; call it before JAX starts its backend
    (the first device query). Processes on accelerators use their own devices and ignore it."""
    jax.config.update("jax_num_cpu_devices", max(count, 1))


def host_copy(x) -> np.ndarray:
    """A new NumPy array holding `x` whole: a `jax.Array` is read shard by shard, one replica of each, and
    written into one host buffer (`np.asarray` of a sharded array would also keep a whole host copy cached on
    the array for as long as it lives); anything else is copied with `np.array`.

    Raises:
      ValueError: `x` spans devices of other processes (read its shards instead).
    """
    if not isinstance(x, jax.Array):
        return np.array(x, copy=True)
    if not x.is_fully_addressable:
        raise ValueError(f"an array of shape {x.shape} spans devices of other processes; this process holds only "
                         "its shards (`addressable_shards`)")
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


def shard_runs(shape: Sequence[int], index: tuple) -> list[tuple[int, int, int]]:
    """Where a shard's elements sit in its leaf: (first flat element of the leaf, elements, first element of the
    shard), C order both, for each run of consecutive elements, in order.

    A shard holds a box of the leaf (`index`: one slice per dimension, as `Sharding.devices_indices_map` gives);
    its elements are consecutive in the leaf from the last dimension the box cuts on, so it is one run per index
    of the dimensions before that one (one run when it is whole or cut on its leading dimension only). A shard
    with no elements has one empty run.
    """
    shape = tuple(int(n) for n in shape)
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)] + [(0, n) for n in shape[len(index):]]
    extent = [hi - lo for lo, hi in bounds]
    cut = max((d for d, b in enumerate(bounds) if b != (0, shape[d])), default=0)
    run = math.prod(extent[cut:])
    if run == 0 or not shape:
        return [(int(np.ravel_multi_index([lo for lo, _ in bounds], shape)) if shape and run else 0, run, 0)]
    out = []
    for k, head in enumerate(np.ndindex(*extent[:cut])):
        position = tuple(lo + j for (lo, _), j in zip(bounds, head)) + tuple(lo for lo, _ in bounds[cut:])
        out.append((int(np.ravel_multi_index(position, shape)), run, k * run))
    return out


def index_key(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A shard's `index` (slices) as ((start, stop) per dimension): hashable, the same for every replica."""
    return tuple(s.indices(int(n))[:2] for s, n in zip(index, shape))


def without_forced_device_count(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of the environment `env` for a process that sets its own device count (`use_cpu_devices`): `XLA_FLAGS`
    keeps every flag but `--xla_force_host_platform_device_count`, and goes when none is left."""
    out = dict(env)
    flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    else:
        out.pop("XLA_FLAGS", None)
    return out


def island_mesh(data: int, expert: int, devices: Sequence[jax.Device], fsdp: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp, expert) mesh over exactly these devices, with Explicit axis types (`jax.make_mesh`, which lays
    a TPU slice's axes along its torus; where no whole physical axes fit a mesh axis, split ones).

    Args:
      data, expert: the sizes of the `DATA_AXIS` and `EXPERT_AXIS` axes.
      devices: the island's devices, exactly data x fsdp x expert of them, in mesh order (expert fastest).
      fsdp: the size of the `FSDP_AXIS` axis (1: parameters replicated).

    Raises:
      ValueError: if data x fsdp x expert differs from len(devices).
    """
    if data * fsdp * expert != len(devices):
        raise ValueError(f"a mesh of data={data} x fsdp={fsdp} x expert={expert} needs {data * fsdp * expert} "
                         f"devices, got {len(devices)}")
    types = (AxisType.Explicit,) * 3
    try:
        return jax.make_mesh((data, fsdp, expert), AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # a TPU torus whose physical axes no subset of the mesh's sizes fits whole
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh((data, fsdp, expert), devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, AXES, axis_types=types)


def platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices of the mesh in context (`jax.set_mesh`), else of JAX's
    default backend: what a program traced now is compiled for, compile-only devices of a target included."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def gathered(x: jax.Array) -> jax.Array:
    """`x` whole over the fsdp axis: its sharding with `FSDP_AXIS` taken out (an all-gather, whose gradient is a
    reduce-scatter back to the shards). Unchanged where `x` is not split over fsdp, or outside a mesh.

    The model calls it on a weight just before using it; how long the whole weight lives is XLA's choice
    (without remat it is kept for the backward pass). It knows the axis's name, never its size.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or not any(_uses(entry, FSDP_AXIS) for entry in spec):
        return x
    return jax.sharding.reshard(x, P(*(_without(entry, FSDP_AXIS) for entry in spec)))


def _uses(entry, axis: str) -> bool:
    return entry == axis or (isinstance(entry, tuple) and axis in entry)


def _without(entry, axis: str):
    if entry == axis:
        return None
    if isinstance(entry, tuple):
        rest = tuple(a for a in entry if a != axis)
        return rest if len(rest) > 1 else (rest[0] if rest else None)
    return entry
