"""An island's memory budget per device, from shapes before anything compiles, and from the compiler (`dry_run`).

One device of island NAME holds during an inner step: parameters (each leaf's bytes over the devices its
sharding splits it across), gradients, AdamW's two moments and the anchor (each as the parameters), and the
activations the backward pass keeps for the device's share of the batch. `state_bytes` counts the first four
exactly from shapes; `estimated_activation_bytes` estimates the activations from shapes (after Korthikanti et
al., arXiv 2205.05198, sec. 4; with `model.remat` "full" a block keeps only its input), and
`compiled_activation_bytes` reads XLA's temporary bytes of a built island's compiled inner step. `check_fits`
refuses a config whose shape figures exceed `islands.NAME.memory_gb` (or the hardware catalog's) before any
parameter is made (docs/island.md, "The memory budget, before compiling"). `dry_run` compiles every program of
an island from abstract shapes, on its own devices or for a target's (`island.aot`), and `check_compiled`
refuses what the compiler says does not fit.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from island_jax.config import ConfigError
from island_jax.hardware import kind, lookup
from island_jax.mesh import AXES

MB = 1e6  # bytes, as the tables print them
GB = 1e9  # bytes; `memory_gb` and the catalog are in GB (10^9 bytes), as vendors state them


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """Bytes one device of an island holds in an inner step (module docstring), from shapes."""

    params: int
    grads: int
    optimizer: int
    anchor: int
    activations: int

    @property
    def state(self) -> int:
        """Parameters, gradients, optimizer state and anchor, bytes."""
        return self.params + self.grads + self.optimizer + self.anchor

    @property
    def total(self) -> int:
        return self.state + self.activations


def mesh_sizes(isl: ml_collections.ConfigDict) -> dict[str, int]:
    """{mesh axis: size} of an island's entry."""
    return {axis: int(isl.mesh[axis]) for axis in AXES}


def state_bytes(config: ml_collections.ConfigDict, name: str) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer state, anchor) bytes on one device of island `name`, from shapes.

    A leaf split over mesh axes of sizes n1, n2, ... holds ceil(its elements / (n1 x n2 ...)) elements per
    device. The optimizer state is AdamW's first and second moments, each shaped and typed like the parameters
    (optax keeps them in the parameters' dtype), and its step count (a few bytes, left out).
    """
    sizes = mesh_sizes(config.islands[name])
    import jax

    from island_jax.model.init import abstract_params

    _, params, specs = abstract_params(config)
    leaves, specs = jax.tree.leaves(params), jax.tree.leaves(specs)
    params = 0
    for leaf, spec in zip(leaves, specs, strict=True):
        split = math.prod(sizes[a] for entry in spec if entry is not None
                          for a in (entry if isinstance(entry, tuple) else (entry,)))
        params += math.ceil(int(np.prod(leaf.shape)) / split) * np.dtype(leaf.dtype).itemsize
    return params, params, 2 * params, params


def estimated_activation_bytes(config: ml_collections.ConfigDict, name: str) -> int:
    """Activation bytes one device of island `name` keeps for the backward pass of an inner step, from shapes.

    Per token of the device's share of the batch (batch_size x seq_len / num_devices tokens), in the compute
    dtype: each of L blocks keeps its norms' inputs and outputs, q, k, v, the attention's output and its
    projection (9 D); of its H heads' scores over S positions, the softmax's float32 output (4 H S bytes:
    `jax.nn.dot_product_attention` computes and normalizes the scores in float32) and two more H S in the compute
    dtype, the probabilities and one more that XLA keeps (2 H S; the TPU compiler's temporaries of `ladder_1b`,
    docs/island.md, "Compiling for a target"), or, on GPU hardware in a 16-bit compute dtype, where cuDNN's fused
    attention keeps no scores, its float32 log-sum-exp (4 H bytes); the router's logits (E, float32); and, for each of the k experts
    a token goes to, its input and output (2 D) and the SwiGLU's gate, up, activation and product (4 F); a dense block has 4 x mlp_hidden_dim
    and no router. With `model.remat` = "full" (or "nothing_saveable", the same policy), a block keeps its input
    alone (D) and one block's worth is recomputed at a time; with `model.scan_layers` too, the remat is per
    scanned unit of n = `moe.every_n_layers` blocks: each of the U units and T unrolled blocks keeps its input and
    one unit's worth is recomputed at a time (`transformer.scan_unit`); the policies that save some tensors ("dots_saveable"
    and the like) are estimated as "none", an upper bound. The head adds its logits, their softmax and their
    gradient in float32 (3 V).
    """
    from island_jax.model.transformer import is_moe_layer, scan_unit

    isl, m, moe = config.islands[name], config.model, config.moe
    tokens = isl.batch_size * m.seq_len / isl.num_devices
    item = np.dtype(m.compute_dtype).itemsize
    # cuDNN's fused attention (GPU, 16-bit activations: `transformer.attention_implementation`) keeps no scores
    fused = kind(isl.hardware) == "gpu" and item == 2
    scores = 4 * m.num_heads if fused else m.num_heads * m.seq_len * (4 + 2 * item)
    per_block = []
    for layer in range(m.num_layers):
        attention = 9 * m.d_model * item + scores
        if is_moe_layer(layer, moe.every_n_layers):
            ffn = 4 * moe.num_experts + moe.num_experts_per_token * (2 * m.d_model + 4 * moe.expert_hidden_dim) * item
            ffn += 4 * moe.num_shared_experts * moe.expert_hidden_dim * item
        else:
            ffn = 4 * m.mlp_hidden_dim * item
        per_block.append(attention + ffn)
    if getattr(m, "remat", "none") in ("full", "nothing_saveable") and m.get("scan_layers", False):
        n, repeats, tail = scan_unit(m.num_layers, moe.every_n_layers)
        kept = (repeats + tail) * m.d_model * item + max(sum(per_block[:n]), max(per_block[n * repeats:], default=0))
    elif getattr(m, "remat", "none") in ("full", "nothing_saveable"):  # both recompute everything
        kept = m.num_layers * m.d_model * item + max(per_block, default=0)
    else:
        kept = sum(per_block)
    return int(tokens * (kept + 3 * m.vocab_size * 4))


def budget(config: ml_collections.ConfigDict, name: str) -> DeviceBytes:
    """`DeviceBytes` of island `name` from shapes alone: `state_bytes` and `estimated_activation_bytes`."""
    return DeviceBytes(*state_bytes(config, name), estimated_activation_bytes(config, name))


def memory_gb(config: ml_collections.ConfigDict, name: str) -> float:
    """GB per device of island `name`: `islands.NAME.memory_gb` when set (> 0), else the catalog's figure for
    its hardware; 0 means unknown."""
    isl = config.islands[name]
    return float(isl.memory_gb) or lookup(isl.hardware).memory_gb


def check_fits(config: ml_collections.ConfigDict, names=None) -> None:
    """Refuses islands whose shape-based budget (`budget`) exceeds their devices' memory (`memory_gb`), before any
    parameter is made or anything compiles. An island of unknown memory (0 GB) is not checked.

    Args:
      config: a validated config.
      names: the islands to check (default: all).

    Raises:
      ConfigError: naming the island, the bytes needed and available, and what to change.
    """
    for name in names if names is not None else list(config.islands.keys()):
        available = memory_gb(config, name) * GB
        if available <= 0:
            continue
        need = budget(config, name)
        if need.total > available:
            isl = config.islands[name]
            raise ConfigError(
                f"islands.{name} needs {need.total / GB:.2f} GB per device but its devices have "
                f"{available / GB:.2f} GB (islands.{name}.memory_gb, or the catalog's for {isl.hardware!r}): "
                f"parameters {need.params / GB:.2f}, gradients {need.grads / GB:.2f}, optimizer state "
                f"{need.optimizer / GB:.2f}, anchor {need.anchor / GB:.2f} and activations {need.activations / GB:.2f} "
                f"GB (estimated from shapes). Shard the state over more devices (islands.{name}.mesh.fsdp, now "
                f"{isl.mesh.fsdp}), recompute activations (model.remat='full'), or lower islands.{name}.batch_size "
                f"(now {isl.batch_size})"
            )


def compiled_activation_bytes(island) -> int:
    """XLA's temporary bytes per device of `island`'s compiled inner step (`compiled.memory_analysis()`): the
    activations and every other buffer the step makes and frees, on the island's own devices. Lowering and
    compiling take as long as the first step's compilation; nothing runs."""
    import jax

    from island_jax.island.step import batch_args

    with jax.set_mesh(island.mesh):
        batch = island.shardings.batch_of(island.dataset[0], island.batch_size)
        compiled = island._train_step.lower(island.params, island.opt_state, *batch_args(batch, 0)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


SHAPES_ONLY_ABOVE = 64  # without a target, an island of more devices is dry-run from shapes alone (no CPU compile)


@dataclasses.dataclass(frozen=True)
class DryRun:
    """One island's dry run (`dry_run`).

    Attributes:
      name: the island.
      hardware: its `hardware` (a target's kind once retargeted).
      memory_gb: GB per device (`memory_gb`; 0 unknown).
      estimate: the budget from shapes (`budget`).
      compiled: the compiler's figures of its programs (`aot.compile_island`), or None for an island dry-run from
        shapes alone (more than `SHAPES_ONLY_ABOVE` devices and no target).
    """

    name: str
    hardware: str
    memory_gb: float
    estimate: DeviceBytes
    compiled: object | None


def dry_run(config: ml_collections.ConfigDict, names, devices=(), targets=None, programs=None) -> dict[str, DryRun]:
    """For each island in `names`: its budget from shapes and its programs compiled from abstract shapes
    (`aot.compile_island`: all of them, or those named in `programs`), without drawing a parameter or running
    anything.

    An island in `targets` ({island: `hardware.Target`}) is retargeted (`aot.retarget`: its hardware becomes the
    target's kind, its memory the catalog's) and compiled for the target's compile-only devices; the others are
    compiled on `devices` (each island on the first `num_devices` of them), or, above `SHAPES_ONLY_ABOVE` devices,
    estimated from shapes alone. The shape budget of the islands without a target is checked first
    (`check_fits`), so a config that cannot fit fails before anything compiles; a targeted island is judged by the
    compiler's figures (`check_compiled`).

    Raises:
      ConfigError: an island that cannot fit (`check_fits`), fewer `devices` than an island needs, or a target that
        does not match its island or cannot be compiled for (`aot.compile_island`).
    """
    from island_jax.island import aot

    targets, programs = targets or {}, programs or aot.PROGRAMS
    config = aot.retarget(config, targets)
    check_fits(config, [n for n in names if n not in targets])
    out = {}
    for name in names:
        isl, t = config.islands[name], targets.get(name)
        compiled = None
        if t is not None:
            compiled = aot.compile_island(config, name, target_=t, programs=programs)
        elif isl.num_devices <= SHAPES_ONLY_ABOVE:
            if len(devices) < isl.num_devices:
                raise ConfigError(f"islands.{name} needs {isl.num_devices} devices; this process has {len(devices)}")
            compiled = aot.compile_island(config, name, devices, programs=programs)
        out[name] = DryRun(name, isl.hardware, memory_gb(config, name), budget(config, name), compiled)
    return out


def check_compiled(results: dict[str, DryRun]) -> None:
    """Refuses an island compiled for a target (`dry_run`) whose program needs more bytes per device than the
    target's devices have, by the compiler's figures (`aot.ProgramMemory.peak`).

    Raises:
      ConfigError: naming the island, the target, the program, its bytes (the compiler's parts and the state beside
        them) and the device's, and what to change.
    """
    for r in results.values():
        if r.compiled is None or r.compiled.target is None or not r.memory_gb:
            continue
        worst = max(r.compiled.programs, key=lambda p: p.peak)
        if worst.peak > r.memory_gb * GB:
            raise ConfigError(
                f"islands.{r.name} compiled for {r.compiled.target} needs {worst.peak / GB:.2f} GB per device in its "
                f"{worst.program} but its devices have {r.memory_gb:g} GB (islands.{r.name}.memory_gb, or the catalog's "
                f"for {r.hardware!r}): the compiler's "
                f"arguments {worst.argument / GB:.2f}, outputs {(worst.output - worst.alias) / GB:.2f} (not aliased), "
                f"temporaries {worst.temp / GB:.2f} and code {worst.code / GB:.2f} GB, and "
                f"{worst.resident / GB:.2f} GB of the island's state beside them. Shard the state over more devices "
                f"(islands.{r.name}.mesh.fsdp), recompute activations (model.remat='full'), or lower "
                f"islands.{r.name}.batch_size"
            )


def table(results: dict[str, DryRun], config: ml_collections.ConfigDict) -> str:
    """`dry_run`'s results as lines of text: per island, a line saying what it was compiled for, then one row per
    program of the compiler's bytes per device (MB, 10^6 bytes; `peak` is what a device holds while the program
    runs, `aot.ProgramMemory.peak`) and FLOPs (GFLOP, 10^9, the compiler's cost analysis of one device's program), and a last row of the shape
    estimate (`budget`), each against the device's GB with whether it fits (`?` of unknown memory)."""
    def fits(total: float, gb: float) -> str:
        return "?" if not gb else "yes" if total <= gb * GB else "NO"

    rows = []
    for r in results.values():
        isl = config.islands[r.name]
        of = f"{r.memory_gb:g} GB per device" if r.memory_gb else "memory unknown"
        where = r.compiled.devices if r.compiled is not None else (
            f"shapes alone ({isl.num_devices} devices: more than {SHAPES_ONLY_ABOVE} are not compiled without a target)")
        rows.append(f"island {r.name}: {where}, mesh data={isl.mesh.data} x fsdp={isl.mesh.fsdp} x "
                    f"expert={isl.mesh.expert}, {r.hardware}: {of}")
        rows.append("  program           argument MB  output MB  aliased MB  temporary MB  code MB  resident MB  "
                    "peak MB      GFLOP  fits")
        for p in r.compiled.programs if r.compiled is not None else ():
            flops = f"{p.flops / 1e9:10.4g}" if p.flops is not None else f"{'n/a':>10}"
            rows.append(f"  {p.program:<16} {p.argument / MB:12.2f} {p.output / MB:10.2f} {p.alias / MB:11.2f} "
                        f"{p.temp / MB:13.2f} {p.code / MB:8.2f} {p.resident / MB:12.2f} {p.peak / MB:8.2f} "
                        f"{flops}  {fits(p.peak, r.memory_gb)}")
        e = r.estimate
        rows.append(f"  estimate (shapes): parameters {e.params / MB:.2f} + gradients {e.grads / MB:.2f} + optimizer "
                    f"{e.optimizer / MB:.2f} + anchor {e.anchor / MB:.2f} + activations {e.activations / MB:.2f} = "
                    f"{e.total / MB:.2f} MB  {fits(e.total, r.memory_gb)}")
    return "\n".join(rows)
