"""What a plan says of memory: the coordinator's bytes per round (float32 master, momentum and view, the merge's
new state beside them, buffered contributions, the kept update), per shard of a coordinator cut by chunk range,
against one host's, and each island's bytes per device from shapes (`island.memory.budget`) against its hardware's."""

from __future__ import annotations

import math

import ml_collections

from island_jax.plan.compute import CoordinatorSpec, ModelSpec

# One coordinator host's memory in bytes, what a shard's peak is set against. An assumption, not a measurement: a
# large two-socket CPU server (32 DIMMs of 64 GB); memory-optimized cloud hosts offer about 1.5 to 4 TB.
HOST_MEMORY_BYTES = 2e12


def coordinator_memory(model: ModelSpec, k: int, payload: float, update: float, coordinator: CoordinatorSpec,
                       ring: bool) -> dict[str, float]:
    """The coordinator's bytes for K islands, `payload` and `update` bytes per island per round: master,
    momentum, view, merged_state, buffered_contributions, kept_update and their total (a ring: all 0)."""
    state = dict(
        master=4 * model.total_params,
        momentum=4 * model.total_params if coordinator.momentum else 0.0,
        view=4 * model.total_params,
    )
    # The merge writes the round's new master, momentum and view beside the old ones, which stay until the round
    # commits: a merge restarted without an island (a new generation) starts again from them.
    memory = dict(**state, merged_state=sum(state.values()), buffered_contributions=k * payload, kept_update=update)
    memory = {key: 0.0 if ring else v for key, v in memory.items()}
    memory["total"] = sum(memory.values())
    return memory


def fewest_shards(total_bytes: float, host_bytes: float = HOST_MEMORY_BYTES) -> int:
    """The fewest coordinator shards whose memory, `total_bytes` / shards each (the chunk ranges are near-equal
    in bytes: within one chunk), fits a host of `host_bytes` (1 for a coordinator that fits one host)."""
    return max(1, math.ceil(total_bytes / host_bytes))


def memory_lines(config: ml_collections.ConfigDict) -> str:
    """Each island's memory per device from shapes alone (`island.memory.budget`, docs/island.md), against its
    `memory_gb` or the catalog's: what a config needs of hardware that is not here."""
    from island_jax.island import memory

    lines = ["memory per device, from shapes (parameters, gradients, optimizer state, anchor; activations):"]
    for name in config.islands.keys():
        b, gb = memory.budget(config, name), memory.memory_gb(config, name)
        of = f"of {gb:g} GB" if gb else "of unknown GB"
        lines.append(f"  {name}: {b.total / 1e9:.3f} GB {of} ({b.params / 1e9:.3f}, {b.grads / 1e9:.3f}, "
                     f"{b.optimizer / 1e9:.3f}, {b.anchor / 1e9:.3f}; {b.activations / 1e9:.3f})"
                     + (" DOES NOT FIT" if gb and b.total > gb * 1e9 else ""))
    return "\n".join(lines)
