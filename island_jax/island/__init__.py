"""An island: its jitted programs (`step`), the island itself (`island.Island`, with its placement on the mesh in
`placement`, its fragments' exchange in `fragments`, its checkpointed state in `state`, and its shards in
`shards`), its outer loop (`outer_loop.StreamingSync`, Streaming DiLoCo arXiv 2501.18512; plain DiLoCo arXiv
2311.08105 with one fragment and no overlap), its memory budget (`memory`) and where its seconds go
(`accounting`)."""

from island_jax.island.accounting import ACCOUNTING_FIELDS, BETWEEN_ROUNDS, EventLog
from island_jax.island.island import Island
from island_jax.island.outer_loop import OuterLoopIsland, StreamingSync
from island_jax.island.step import STEP_METRICS, cross_entropy, inner_optimizer, loss_fn

__all__ = [
    "ACCOUNTING_FIELDS",
    "BETWEEN_ROUNDS",
    "EventLog",
    "Island",
    "OuterLoopIsland",
    "STEP_METRICS",
    "StreamingSync",
    "cross_entropy",
    "inner_optimizer",
    "loss_fn",
]
