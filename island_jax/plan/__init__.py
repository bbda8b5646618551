"""The bandwidth budget of a run across islands: compute utilization, and the link it needs, before it runs.

`plan(model, islands, outer, coordinator)` takes the planner's specs (`ModelSpec`, `IslandSpec` with its
`LinkSpec`, `OuterSpec`, `CoordinatorSpec`) and returns a `Plan`: per island and round the compute seconds,
the bytes each way, the transfer and exposed communication seconds and the compute utilization; the lowest
link rate that keeps every island at 90/95/99% utilization; the coordinator's memory, CPU seconds and bytes
per day, whole and per shard of a coordinator cut by chunk range; and a data-parallel baseline beside it.
`from_config(config)` builds the specs of a run's config; `predict(workdir)` sets a finished run's measured
utilization beside the plan of its recorded step times. The command line is `python -m island_jax.plan`
(`__main__`); docs/planner.md gives the equations and sets them beside published runs.
"""

from island_jax.plan.baseline import BACKWARD_FRACTION, DP_BYTES, DataParallel, data_parallel
from island_jax.plan.checks import PlanError, check_inputs
from island_jax.plan.compute import (
    MERGE_FIXED_NS,
    MERGE_PER_ISLAND_NS,
    CoordinatorSpec,
    IslandSpec,
    ModelSpec,
    coordinator_cpu_seconds,
    planned_steps,
)
from island_jax.plan.inputs import from_config, link_of, model_of, parse_island
from island_jax.plan.memory import HOST_MEMORY_BYTES, coordinator_memory, fewest_shards, memory_lines
from island_jax.plan.planner import TARGETS, IslandRound, Plan, plan
from island_jax.plan.prediction import Prediction, predict
from island_jax.plan.report import format_plan
from island_jax.plan.wire import (
    SECONDS_PER_DAY,
    TOPOLOGIES,
    LinkSpec,
    OuterSpec,
    pipelined_seconds,
    required_gbps,
    transfer_seconds,
)

__all__ = [
    "BACKWARD_FRACTION", "DP_BYTES", "HOST_MEMORY_BYTES", "MERGE_FIXED_NS", "MERGE_PER_ISLAND_NS", "SECONDS_PER_DAY",
    "TARGETS", "TOPOLOGIES", "CoordinatorSpec", "DataParallel", "IslandRound", "IslandSpec", "LinkSpec", "ModelSpec",
    "OuterSpec", "Plan", "PlanError", "Prediction", "check_inputs", "coordinator_cpu_seconds", "coordinator_memory",
    "data_parallel", "fewest_shards", "format_plan", "from_config", "link_of", "memory_lines", "model_of",
    "parse_island", "pipelined_seconds", "plan", "planned_steps", "predict", "required_gbps", "transfer_seconds",
]
