"""An island's memory budget per device, from shapes before anything compiles, and from XLA after it has.

One device of island NAME holds during an inner step: parameters (each leaf's bytes over the devices its
sharding splits it across), gradients, AdamW's two moments and the anchor (each as the parameters), and the
activations the backward pass keeps for the device's share of the batch. `state_bytes` counts the first four
exactly from shapes; `estimated_activation_bytes` estimates the activations from shapes (after Korthikanti et
al., arXiv 2205.05198, sec. 4; with `model.remat` "full" a block keeps only its input), and
`compiled_activation_bytes` reads XLA's temporary bytes of the compiled inner step on the island's own
devices. `check_fits` refuses a config whose shape figures exceed `islands.NAME.memory_gb` (or the hardware
catalog's) before any parameter is made (docs/island.md, "The memory budget, before compiling").
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from island_jax.config import ConfigError
from island_jax.hardware import lookup
from island_jax.mesh import AXES

GB = 1e9  # bytes; `memory_gb` and the catalog are in GB (10^9 bytes), as vendors state them


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """Bytes one device of an island holds in an inner step (module docstring). `activations_source` says where
    the activations' figure comes from: "estimate" (shapes) or "compiled" (XLA's memory analysis)."""

    params: int
    grads: int
    optimizer: int
    anchor: int
    activations: int
    activations_source: str = "estimate"

    @property
    def state(self) -> int:
        """Parameters, gradients, optimizer state and anchor, bytes."""
        return self.params + self.grads + self.optimizer + self.anchor

    @property
    def total(self) -> int:
        return self.state + self.activations


def _abstract_params(config: ml_collections.ConfigDict):
    """(leaves' ShapeDtypeStructs, their PartitionSpecs), in `jax.tree.leaves` order, of an abstract model."""
    import jax
    from flax import nnx

    from island_jax.model.transformer import Transformer, partition_specs

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return jax.tree.leaves(nnx.to_pure_dict(state)), jax.tree.leaves(partition_specs(state))


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
    leaves, specs = _abstract_params(config)
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
    projection (9 D), the attention weights of its H heads over S positions before and after the softmax
    (2 H S), the router's logits (E, float32) and, for each of the k experts a token goes to, its input and
    output (2 D) and the SwiGLU's gate, up, activation and product (4 F); a dense block has 4 x mlp_hidden_dim
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
    per_block = []
    for layer in range(m.num_layers):
        attention = 9 * m.d_model * item + 2 * m.num_heads * m.seq_len * item
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


def _device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays on one device (the first device's shard of each leaf)."""
    import jax

    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, "addressable_shards"))


def measured(island) -> DeviceBytes:
    """`DeviceBytes` of a built `Island` as its first device holds them: the parameters, optimizer state and anchor
    placed (their shards' bytes), gradients as the parameters, and the compiled inner step's temporary bytes
    (`compiled_activation_bytes`)."""
    params = _device_bytes(island.params)
    return DeviceBytes(params, params, _device_bytes(island.opt_state), _device_bytes(island.anchor),
                       compiled_activation_bytes(island), "compiled")


def dry_run(config: ml_collections.ConfigDict, names, devices) -> dict[str, tuple[DeviceBytes, DeviceBytes]]:
    """For each island in `names`: (its budget from shapes, the same measured on `devices`), without training.

    The shape budget is checked first (`check_fits`), so a config that cannot fit fails before anything is
    made. Then each island is built in turn on its own devices (`devices` dealt to `names` in order, as a run
    deals them) and its inner step is compiled, not run.

    Raises:
      ConfigError: an island that cannot fit (`check_fits`), or fewer `devices` than the islands need.
    """
    from island_jax.island.island import Island
    from island_jax.model.init import init_params

    check_fits(config, names)
    need = sum(config.islands[n].num_devices for n in names)
    if len(devices) < need:
        raise ConfigError(f"islands {names} need {need} devices; this process has {len(devices)}")
    graphdef, params, specs = init_params(config)
    out, offset = {}, 0
    for name in names:
        isl = config.islands[name]
        mine, offset = devices[offset : offset + isl.num_devices], offset + isl.num_devices
        corpus = np.zeros(config.model.seq_len * isl.batch_size + config.model.seq_len + 1, np.uint8)
        if config.data.get("prepared", ""):  # records of one document each: the step with segment ids compiles
            import grain

            record = np.stack([np.zeros(config.model.seq_len + 1, np.int32), np.ones(config.model.seq_len + 1, np.int32)])
            corpus = grain.MapDataset.source([record] * isl.batch_size)
        island = Island(name, config, mine, graphdef, params, specs, corpus, config.outer.rounds)
        out[name] = (budget(config, name), measured(island))
        del island
    return out


def table(results: dict[str, tuple[DeviceBytes, DeviceBytes]], config: ml_collections.ConfigDict) -> str:
    """`dry_run`'s results as lines of text, MB per device (10^6 bytes)."""
    rows = ["island  source     params MB  grads MB  optimizer MB  anchor MB  activations MB  total MB  of GB"]
    for name, pair in results.items():
        gb = memory_gb(config, name)
        for b in pair:
            rows.append(f"{name:<7} {b.activations_source:<9} {b.params / 1e6:10.2f} {b.grads / 1e6:9.2f} "
                        f"{b.optimizer / 1e6:13.2f} {b.anchor / 1e6:10.2f} {b.activations / 1e6:15.2f} "
                        f"{b.total / 1e6:9.2f}  {gb:g}" + ("" if gb else " (unknown)"))
    return "\n".join(rows)
