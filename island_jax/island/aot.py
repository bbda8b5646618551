"""An island's programs compiled ahead of time from abstract shapes: on its own devices, or for a target it does
not run on (`--dry_run --target=NAME`), with the compiler's own memory per device.

Nothing is drawn, placed or run. The parameters are `jax.ShapeDtypeStruct`s sharded by the model's partition
specs (`model.init.abstract_params`), AdamW's state is `jax.eval_shape` of its init, and the batch is int32
shapes split over every mesh axis. Each of the island's jitted programs (the inner step with its remat, the
eval step, the pseudo-gradient of each fragment) is traced, lowered and compiled (`jit(...).lower(...).compile()`)
for the island's mesh, and `compiled.memory_analysis()` and `cost_analysis()` give its bytes per device and
FLOPs. A target's devices are compile-only devices (`jax.experimental.topologies.get_topology_desc`): a Cloud
TPU slice's through libtpu (the `tpu-aot` extra), as MaxText's `train_compile.py` does (docs/island.md,
"Compiling for a target").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.config import ConfigError
from island_jax.hardware import Target, target
from island_jax.island import step as step_lib
from island_jax.island.fragments import OuterLeaves
from island_jax.mesh import BATCH_AXES, island_mesh
from island_jax.model.init import abstract_params
from island_jax.outer import fragments as fragments_lib
from island_jax.outer.inner_steps import plan_inner_steps

PROGRAMS = ("inner_step", "eval_step", "pseudo_gradient")  # what `compile_island` compiles, in order
# XLA's description of each GPU target's kind (`<hardware>.txtpb`: a GpuTargetConfigProto, its provenance inside)
GPU_TARGETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_targets")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's bytes per device (the compiler's, `memory_analysis()`) and FLOPs.

    Attributes:
      program: one of `PROGRAMS` ("pseudo_gradient" is the fragment whose program needs the most).
      argument, output, alias, temp, code: the compiler's argument, output, aliased (donated arguments reused for
        outputs), temporary and generated-code bytes per device.
      resident: bytes of the island's state on a device that are not the program's arguments: the anchor beside
        the inner step, AdamW's state and the anchor beside the eval step, and so on (from the shardings).
      flops: the compiler's `cost_analysis()["flops"]` of the program (one device's); None where it gives none
        (compile-only GPUs).
      fragment: of "pseudo_gradient", the fragment's index.
    """

    program: str
    argument: int
    output: int
    alias: int
    temp: int
    code: int
    resident: int
    flops: float | None
    fragment: int | None = None

    @property
    def peak(self) -> int:
        """Bytes a device holds while the program runs: resident + arguments + outputs - aliased + temporaries +
        generated code."""
        return self.resident + self.argument + self.output - self.alias + self.temp + self.code


@dataclasses.dataclass(frozen=True)
class IslandPrograms:
    """`compile_island`'s result: where it compiled and what each program needs.

    Attributes:
      name: the island.
      devices: what the programs were compiled for, e.g. "8 TPU v5 (target tpu-v5p-16)" or "8 cpu".
      target: the target's name, or None (the island's own devices).
      programs: one `ProgramMemory` per program compiled, in `PROGRAMS`' order.
    """

    name: str
    devices: str
    target: str | None
    programs: list[ProgramMemory]


def per_device_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard of `x` (sharded by its `NamedSharding`; whole on every device without one), by
    hand: the shard's elements (`sharding.shard_shape`) x the dtype's size."""
    shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def compile_only_devices(t: Target) -> list[jax.Device]:
    """The compile-only devices of target `t` (`jax.experimental.topologies.get_topology_desc`): programs
    compile for them, nothing runs.

    NVIDIA GPUs: the CUDA plugin's (`_cuda_devices`). TPU: libtpu's topology `t.topology` (v4 and v5p as megacore
    chips, one device each; a single-host v5e or v6e slice of up to 8 chips on one host). Off a TPU VM, `TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES` are set
    to the target's slice and "localhost" where unset, which libtpu otherwise asks the VM's metadata for (and logs
    errors when it cannot), and `ALLOW_MULTIPLE_LIBTPU_LOAD` to 1: without a TPU to own, libtpu's lock on one (a
    file in /tmp) would keep a second process from compiling at the same time.

    Raises:
      ConfigError: the compiler for the target's platform is not installed (`pip install -e '.[tpu-aot]'`, or
        `'.[gpu-aot]'`) or refuses the topology.
    """
    from jax.experimental import topologies

    if t.platform == "cuda":
        return _cuda_devices(t)
    options = {}
    generation, shape = t.topology.split(":")
    if generation in ("v4", "v5p"):
        options["chip_config_name"] = "megacore"
    elif t.devices <= 8:
        sides = [int(n) for n in shape.split("x")]
        options["chips_per_host_bounds"] = (*sides, 1)
    if importlib.util.find_spec("libtpu") is None:  # the compiler for TPU targets (importing it starts it)
        raise ConfigError(f"target {t.name!r} needs libtpu, the TPU compiler: pip install -e '.[tpu-aot]' (about "
                          "210 MB; it runs nothing on this machine)")
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if "tpu" not in platforms.split(",") and (platforms or jax.default_backend() != "tpu"):
        # off a TPU VM: libtpu would look for its own slice, and log that it is not one
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{generation}-{t.devices * (2 if generation in ('v4', 'v5p') else 1)}")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to own: other processes may compile too
    try:
        devices = topologies.get_topology_desc(topology_name=t.topology, platform="tpu", **options).devices
    except Exception as e:  # libtpu's own error: a topology it does not know
        raise ConfigError(f"target {t.name!r}: libtpu refuses topology {t.topology!r} ({e})") from None
    if len(devices) != t.devices:
        raise ConfigError(f"target {t.name!r}: libtpu made {len(devices)} devices of topology {t.topology!r}, not "
                          f"{t.devices}")
    return list(devices)


def _cuda_devices(t: Target) -> list[jax.Device]:
    """Compile-only NVIDIA GPUs of target `t`: the CUDA plugin's topology "1 x hosts x GPUs per host" for the target
    config `gpu_targets/<hardware>.txtpb` (XLA's figures of the GPU). XLA compiles PTX with ptxas, and bfloat16
    attention through cuDNN, whose libraries must load: the `gpu-aot` extra holds all three."""
    from jax.experimental import topologies

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise ConfigError(f"target {t.name!r} needs the CUDA plugin, ptxas and cuDNN: pip install -e '.[gpu-aot]' "
                          "(about 2 GB; docs/island.md, \"Compiling for a target\")")
    with open(os.path.join(GPU_TARGETS, f"{t.hardware}.txtpb")) as f:
        spec = f.read()
    try:
        devices = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=t.topology).devices
    except NotImplementedError:
        raise ConfigError(f"target {t.name!r}: the CUDA plugin did not start; run with JAX_PLATFORMS=cpu (it then "
                          "registers without a GPU)") from None
    except Exception as e:
        raise ConfigError(f"target {t.name!r}: the CUDA plugin refuses topology {t.topology!r} ({e})") from None
    return list(devices)


def parse_targets(text: str, names) -> dict[str, Target]:
    """{island: Target} of `--target`: "NAME" (every island of `names`) or "a=NAME,b=NAME" (those islands).

    Raises:
      ConfigError: naming the target and the forms that exist, for an unknown target (`hardware.target`), or an
        island that is not in `names`.
    """
    text = text.strip()
    pairs = [part.split("=", 1) for part in text.split(",")] if "=" in text else [[n, text] for n in names]
    out = {}
    for pair in pairs:
        if len(pair) != 2 or not pair[0].strip():
            raise ConfigError(f"--target={text}: give one target (--target=tpu-v5p-16) or one per island "
                              "(--target=a=tpu-v5p-16,b=tpu-v6e-8)")
        name, value = pair[0].strip(), pair[1].strip()
        if name not in names:
            raise ConfigError(f"--target names island {name!r}, which is not one of {list(names)}")
        try:
            out[name] = target(value)
        except ValueError as e:
            raise ConfigError(f"--target: {e}") from None
    return out


def retarget(config: ml_collections.ConfigDict, targets: dict[str, Target]) -> ml_collections.ConfigDict:
    """A copy of `config` whose islands in `targets` run on their target: `hardware` the target's catalog kind,
    and `memory_gb` 0 (the catalog's figure) where the hardware changes (an island already of the target's kind
    keeps its own `memory_gb`). The config given is unchanged."""
    out = ml_collections.ConfigDict(config.to_dict())
    for name, t in targets.items():
        if out.islands[name].hardware != t.hardware:
            out.islands[name].update(hardware=t.hardware, memory_gb=0.0)
    return out


def check_target(config: ml_collections.ConfigDict, name: str, t: Target) -> None:
    """Refuses to compile island `name` for target `t` unless its `hardware` is the target's kind (`retarget` makes
    it so) and its mesh has the target's device count.

    Raises:
      ConfigError: naming the island, its hardware or mesh, and the target.
    """
    isl = config.islands[name]
    if isl.hardware != t.hardware:
        raise ConfigError(f"islands.{name}.hardware is {isl.hardware!r} but target {t.name!r} is {t.hardware!r} "
                          f"devices; give a target of {isl.hardware!r} devices, or set islands.{name}.hardware="
                          f"{t.hardware!r} (--target does so for the islands it names)")
    mesh = isl.mesh
    if mesh.data * mesh.fsdp * mesh.expert != t.devices:
        raise ConfigError(
            f"islands.{name}'s mesh data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert} is "
            f"{mesh.data * mesh.fsdp * mesh.expert} devices but target {t.name!r} has {t.devices}; choose a target of "
            f"{mesh.data * mesh.fsdp * mesh.expert} devices, or a mesh of {t.devices} "
            f"(--config.islands.{name}.num_devices={t.devices} --config.islands.{name}.mesh.data=...)"
        )


def _flops(compiled) -> float | None:
    costs = compiled.cost_analysis()
    if isinstance(costs, (list, tuple)):  # one dict per program on some versions
        costs = costs[0] if costs else None
    return float(costs["flops"]) if costs and "flops" in costs else None


def _figures(program: str, compiled, resident: int, fragment: int | None = None) -> ProgramMemory:
    m = compiled.memory_analysis()
    return ProgramMemory(program, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                         int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes),
                         resident, _flops(compiled), fragment)


def abstract_state(config: ml_collections.ConfigDict, name: str, mesh: jax.sharding.Mesh):
    """(graphdef, params, AdamW state, the inner optimizer) of island `name` on `mesh`, as sharded
    `jax.ShapeDtypeStruct`s: nothing is drawn or allocated. The optimizer is the island's (`step.inner_optimizer`
    over its planned inner steps x the run's rounds)."""
    graphdef, params, _ = abstract_params(config, mesh)
    tx = step_lib.inner_optimizer(config, plan_inner_steps(config)[name] * config.outer.rounds)
    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(tx.init, params)
    return graphdef, params, opt_state, tx


def batch_shapes(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, rows: int) -> tuple:
    """(inputs, targets, segment ids or None) of a batch of `rows` as the island's programs take it (int32 [rows, S],
    and [rows, S + 1] of prepared records), split over every mesh axis."""
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    s = config.model.seq_len
    tokens = jax.ShapeDtypeStruct((rows, s), jnp.int32, sharding=sharding)
    segments = jax.ShapeDtypeStruct((rows, s + 1), jnp.int32, sharding=sharding) if config.data.get("prepared", "") else None
    return tokens, tokens, segments


def compile_island(config: ml_collections.ConfigDict, name: str, devices=None, target_: Target | None = None,
                   programs: Sequence[str] = PROGRAMS) -> IslandPrograms:
    """Compiles island `name`'s programs from abstract shapes and reads the compiler's figures: for `target_`'s
    compile-only devices (`compile_only_devices`), or on `devices` (the island's own; the first
    `num_devices` of them are used), running nothing.

    The programs (`PROGRAMS`): the inner step (`step.build_train_step`, with `model.remat`; parameters and AdamW
    state donated) on a batch of `islands.NAME.batch_size`; the eval step (`step.build_eval_step`) on a batch of
    `eval.batch_size`; and the pseudo-gradient of each of the `outer.fragments` fragments
    (`fragments.OuterLeaves.pseudo_gradient`), of which the one that needs the most bytes is kept; those of them
    named in `programs`, in `PROGRAMS`' order. Tracing
    asks the mesh's platform (`mesh.platform`), so the MoE dispatch and the attention are the target's.

    Raises:
      ConfigError: the target does not match the island (`check_target`), its devices cannot be made
        (`compile_only_devices`), a program does not fit the target's device (the TPU compiler refuses it,
        RESOURCE_EXHAUSTED), or does not compile for it (the compiler's message).
    """
    isl = config.islands[name]
    if target_ is not None:
        check_target(config, name, target_)
        devices = compile_only_devices(target_)
        where = f"{len(devices)} {devices[0].device_kind} (target {target_.name})"
    else:
        devices = list(devices)[: isl.num_devices]
        where = f"{len(devices)} {devices[0].device_kind}"
    mesh = island_mesh(isl.mesh.data, isl.mesh.expert, devices, fsdp=isl.mesh.fsdp)
    graphdef, params, opt_state, tx = abstract_state(config, name, mesh)
    leaves = jax.tree.leaves(params)
    param_bytes = sum(per_device_bytes(x) for x in leaves)
    state = 2 * param_bytes + sum(per_device_bytes(x) for x in jax.tree.leaves(opt_state))  # + the anchor
    train_step = step_lib.build_train_step(config, graphdef, tx)
    eval_step = step_lib.build_eval_step(graphdef)
    inputs, targets, segments = batch_shapes(config, mesh, isl.batch_size)
    e_inputs, e_targets, e_segments = batch_shapes(config, mesh, config.eval.batch_size)
    mask = jax.ShapeDtypeStruct(e_inputs.shape, jnp.float32, sharding=e_inputs.sharding)
    step = jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    outer = OuterLeaves(params)
    partition = fragments_lib.partition_params(outer.layer_shapes(params), config.outer.fragments, outer.stacked)
    try:
        with jax.set_mesh(mesh):
            out = []
            if "inner_step" in programs:
                args = step_lib.batch_args((inputs, targets, segments), step)
                out.append(_figures("inner_step", train_step.lower(params, opt_state, *args).compile(), param_bytes))
            if "eval_step" in programs:
                args = (e_inputs, e_targets, mask) if e_segments is None else (e_inputs, e_targets, mask, e_segments)
                out.append(_figures("eval_step", eval_step.lower(params, *args).compile(), state - param_bytes))
            if "pseudo_gradient" in programs:
                fragments = []
                for f, indices in enumerate(partition):
                    used = sorted({outer.slots[i].leaf for i in indices})
                    passed = 2 * sum(per_device_bytes(leaves[k]) for k in used)
                    compiled = outer.lower_pseudo_gradient(params, params, indices).compile()
                    fragments.append(_figures("pseudo_gradient", compiled, state - passed, f))
                out.append(max(fragments, key=lambda p: p.peak))
    except ConfigError:
        raise
    except Exception as e:
        if "RESOURCE_EXHAUSTED" in str(e):  # the TPU compiler refuses a program that cannot fit its device
            raise ConfigError(
                f"islands.{name} does not fit {where}: the compiler says {str(e).strip()} Shard the state over "
                f"more devices (islands.{name}.mesh.fsdp, now {isl.mesh.fsdp}), recompute activations "
                f"(model.remat='full', now {config.model.remat!r}), or lower islands.{name}.batch_size (now "
                f"{isl.batch_size})") from None
        raise ConfigError(f"islands.{name} does not compile for {where}: {type(e).__name__}: {e}") from e
    return IslandPrograms(name, where, None if target_ is None else target_.name, out)

