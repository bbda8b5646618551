"""What a step and a merge cost: the model's parameter counts, each island's seconds per inner step and H,
and the coordinator's CPU per round.

  step   t_i = training FLOPs per token x tokens per step / (devices x peak x MFU), FLOPs per token
         6 x active parameters where nothing better is known (Kaplan et al. 2020, C = 6ND), or a
         measured step time;
  H      each island's inner steps (sync "auto": H_i = H_ref x t_ref / t_i, `outer.inner_steps`);
  merge  params x (fixed + per_island x K) ns of CPU per round, fitted by benchmarks/merge.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from island_jax.hardware import lookup
from island_jax.outer.inner_steps import scaled_inner_steps
from island_jax.plan.wire import LinkSpec, OuterSpec

# The coordinator's CPU per round in ns per parameter, params x (fixed + per_island x K), fitted by
# benchmarks/merge.py on the machine of docs/benchmarks.md#the-coordinators-merge (int8, block 256).
MERGE_FIXED_NS = 11.5
MERGE_PER_ISLAND_NS = 4.2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Attributes: total_params (all parameters, what the exchange moves); active_params (per token, what
    a step computes; 0: total_params); num_layers (Streaming DiLoCo's fragments are groups of whole
    layers: a plan with more fragments than layers says so; 0: unknown); flops_per_token (training FLOPs
    per token, `model.flops.train_flops_per_token`; 0: 6 x active, what parameter counts alone give)."""

    total_params: float
    active_params: float = 0.0
    num_layers: int = 0
    flops_per_token: float = 0.0

    @property
    def active(self) -> float:
        return self.active_params or self.total_params

    @property
    def train_flops_per_token(self) -> float:
        from island_jax.model.flops import train_flops_per_token

        return self.flops_per_token or train_flops_per_token(self.active)


@dataclasses.dataclass(frozen=True)
class IslandSpec:
    """One island: its hardware, its step and its link.

    Attributes:
      name: the island's name.
      num_devices: accelerators in its mesh.
      hardware: a kind of island_jax/hardware.py's catalog (its dense bf16 peak, TFLOP/s per device).
      mfu: model FLOPs utilization, of that peak, the step time is computed with.
      step_seconds: a measured seconds per inner step (0: from the catalog and `mfu`).
      batch_size: sequences per inner step; seq_len: tokens per sequence.
      inner_steps: H, inner steps per round (the reference island's H under sync "auto").
      link: its path to the coordinator.
      busy_step_seconds: a measured mean step time with the exchange running beside it, where the
        exchange's host work slows the steps (0: `step_seconds`); utilization counts the steps at
        `step_seconds`, as an island's accounting does.
    """

    name: str
    num_devices: int = 8
    hardware: str = "h100"
    mfu: float = 0.4
    step_seconds: float = 0.0
    batch_size: int = 256
    seq_len: int = 4096
    inner_steps: int = 100
    link: LinkSpec = LinkSpec()
    busy_step_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def seconds_per_step(self, model: ModelSpec) -> float:
        """`step_seconds`, else training FLOPs per token x tokens per step / (devices x peak x MFU), seconds.

        Raises:
          KeyError: hardware outside the catalog.
        """
        if self.step_seconds > 0:
            return self.step_seconds
        flops = self.num_devices * lookup(self.hardware).peak_tflops * 1e12 * self.mfu
        return model.train_flops_per_token * self.tokens_per_step / flops


@dataclasses.dataclass(frozen=True)
class CoordinatorSpec:
    """Attributes: gbps (its own link each way, Gbit/s, which all islands' traffic crosses; `math.inf`:
    not a constraint); cores (CPU cores its merge spreads over); fixed_ns_per_param and
    per_island_ns_per_param (its CPU per round, params x (fixed + per_island x K) ns, from
    benchmarks/merge.py); momentum (the outer optimizer keeps a momentum buffer); shards (the processes
    it is cut into by chunk range, `coordinator.shards`, each on its own host: `gbps` and `cores` are
    then each shard's, and each shard holds, merges and moves 1/shards of the coordinator's bytes)."""

    gbps: float = math.inf
    cores: int = 64
    fixed_ns_per_param: float = MERGE_FIXED_NS
    per_island_ns_per_param: float = MERGE_PER_ISLAND_NS
    momentum: bool = True
    shards: int = 1


def planned_steps(islands: Sequence[IslandSpec], steps: list[float], outer: OuterSpec) -> list[float]:
    """H per island under sync "steps" or "auto" (under "time" the round's seconds set it, `planner`)."""
    if outer.sync != "auto":
        return [float(i.inner_steps) for i in islands]
    # auto: the reference island keeps its H, the others take as many steps as fit in its round
    ref = next((k for k, i in enumerate(islands) if i.name == outer.reference_island), 0)
    return [float(scaled_inner_steps(islands[ref].inner_steps, 1.0 / t, 1.0 / steps[ref])) for t in steps]


def coordinator_cpu_seconds(model: ModelSpec, k: int, coordinator: CoordinatorSpec) -> float:
    """The coordinator's CPU seconds per round, all its shards together: params x (fixed + per_island x K) ns."""
    return model.total_params * (coordinator.fixed_ns_per_param + coordinator.per_island_ns_per_param * k) * 1e-9
