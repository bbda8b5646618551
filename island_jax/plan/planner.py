"""The plan of one round across islands: `plan(model, islands, outer, coordinator)`.

Per island and round: compute seconds C_i = H_i x t_i, the bytes each way, the transfer and exposed
communication seconds (tau steps and the backward pass hide an exchange; fragments split it), the round's
wall seconds W = max_i (H_i x busy step_i + X_i) and compute utilization C_i / W; then the lowest link
rate that keeps every island at 90/95/99%, the coordinator's memory, CPU and bytes (whole, and per shard of a
coordinator cut by chunk range), and the data-parallel baseline. The equations and how they compare with
published runs: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from island_jax.outer.fragments import auto_overlap_steps
from island_jax.plan.baseline import DP_BYTES, DataParallel, data_parallel
from island_jax.plan.checks import PlanError, check_inputs
from island_jax.plan.compute import CoordinatorSpec, IslandSpec, ModelSpec, coordinator_cpu_seconds, planned_steps
from island_jax.plan.memory import coordinator_memory, fewest_shards
from island_jax.plan.report import format_plan
from island_jax.plan.wire import (
    GBPS_RANGE,
    SECONDS_PER_DAY,
    OuterSpec,
    links_at,
    pipelined_seconds,
    required_gbps,
    transfer_seconds,
)

TARGETS = (0.90, 0.95, 0.99)  # compute utilizations the required link rate is given for


@dataclasses.dataclass(frozen=True)
class IslandRound:
    """One island's round: seconds are wall-clock seconds and bytes are bytes, per round unless named."""

    name: str
    step_seconds: float
    inner_steps: float  # H (fractional under sync "time": the steps round_seconds hold)
    tokens_per_round: float
    compute_seconds: float  # H x step seconds
    bytes_up: float  # contributions, island -> coordinator (a ring: what the island sends)
    bytes_down: float  # updates, coordinator -> island
    rate_gbps: float  # the rate its transfers get
    transfer_up_seconds: float
    transfer_down_seconds: float
    fragment_exchange_seconds: float  # one fragment: its contribution leaving to its update in
    overlap_steps: int  # tau
    exposed_seconds: float  # communication the steps do not hide, overheads included
    compute_utilization: float
    bytes_per_day: float  # both ways


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` returns; `str(plan)` (`format_plan`) is what the command line prints."""

    model: ModelSpec
    outer: OuterSpec
    coordinator: CoordinatorSpec
    payload_bytes: float  # a contribution, per island per round
    update_bytes: float  # an update, per island per round
    islands: list[IslandRound]
    wall_seconds: float  # one round
    required_gbps: dict[float, float | None]  # target -> Gbit/s of every island's link (0.0: any; None: none)
    # bytes: master, momentum, view, the merge's new state (their sum), buffered contributions (at most K x P), kept
    # update, total (a ring: all 0)
    coordinator_memory: dict[str, float]
    coordinator_cpu_seconds: float  # per round
    coordinator_bytes_per_day: float  # both ways
    dp: DataParallel
    notes: list[str]

    @property
    def compute_utilization(self) -> float:
        """The lowest island's."""
        return min(r.compute_utilization for r in self.islands)

    @property
    def merge_seconds(self) -> float:
        """The coordinator's CPU seconds per round spread over its cores (its shards merge side by side, each
        its share over its own cores)."""
        return self.shard_cpu_seconds / self.coordinator.cores

    # A coordinator cut into `coordinator.shards` by chunk range: each fragment's chunk plan is cut into ranges of
    # near-equal bytes, one a shard, so each shard's figures are the whole's / shards (within a chunk per fragment).

    @property
    def shard_memory(self) -> dict[str, float]:
        """Each shard's bytes, by the keys of `coordinator_memory`."""
        return {key: v / self.coordinator.shards for key, v in self.coordinator_memory.items()}

    @property
    def shard_cpu_seconds(self) -> float:
        """Each shard's CPU seconds per round."""
        return self.coordinator_cpu_seconds / self.coordinator.shards

    @property
    def shard_bytes(self) -> tuple[float, float]:
        """Bytes per round into and out of each shard over its own link: its ranges of every island's
        contribution and of every island's update (a ring: 0, 0)."""
        if self.outer.topology == "ring":
            return 0.0, 0.0
        k, n = len(self.islands), self.coordinator.shards
        return k * self.payload_bytes / n, k * self.update_bytes / n

    @property
    def shard_link_seconds(self) -> tuple[float, float]:
        """Seconds per round that `shard_bytes` take in and out on a shard's link (`coordinator.gbps` each way)."""
        return tuple(transfer_seconds(b, self.coordinator.gbps) for b in self.shard_bytes)

    @property
    def fewest_shards(self) -> int:
        """The fewest shards whose memory each fits a host (`memory.HOST_MEMORY_BYTES`)."""
        return fewest_shards(self.coordinator_memory["total"])

    def __str__(self) -> str:
        return format_plan(self)


def _rounds(model, islands, outer, coordinator, payload, update, gbps=None):
    """The islands' rounds and the round's wall seconds W, every island's link at `gbps` when given
    (`payload`, `update`: bytes of a contribution and of an update)."""
    k, f = len(islands), outer.fragments
    ring, timed = outer.topology == "ring", outer.sync == "time"
    moved = payload * (2 * (k - 1) / k if ring else 1.0)  # up, per island per round
    back = moved if ring else update  # down
    steps = [i.seconds_per_step(model) for i in islands]
    busy = [i.busy_step_seconds or t for i, t in zip(islands, steps)]
    planned = planned_steps(islands, steps, outer)
    links = links_at(islands, gbps)
    rates = []
    for link in links:
        rate = link.rate_gbps() / (k if outer.shared_link else 1)
        rates.append(rate if ring else min(rate, coordinator.gbps * coordinator.shards / k))  # a link per shard
    seconds = [transfer_seconds(moved / f, r) for r in rates]
    down = [transfer_seconds(back / f, r) for r in rates]
    one_way = [link.rtt_ms / 2e3 for link in links]
    merge = 0.0 if ring else coordinator_cpu_seconds(model, k, coordinator) / coordinator.shards / coordinator.cores / f
    chunks = max(1, math.ceil(max(payload, update) / f / outer.chunk_bytes))  # one plan, cut by the costlier codec
    exchanges, taus, exposed = [], [], []
    for t, h, s, lat in zip(steps, planned, down, one_way):
        if ring:  # a ring moves at its slowest link and waits 2 (K - 1) hops
            exchange = max(seconds) + 2 * (k - 1) * max(one_way)
        else:  # a chunk's merge waits for every island's copy of it; pipelined, the update flows back
            exchange = pipelined_seconds((max(seconds), merge, s), chunks if outer.pipeline else 1) + max(one_way) + lat
        cap = int(outer.round_seconds / t) - 1 if timed else math.ceil(h) - 1  # as the islands cap tau
        tau = auto_overlap_steps(exchange, t, max(cap, 0)) if outer.overlap_steps == "auto" else outer.overlap_steps
        exchanges.append(exchange)
        taus.append(tau)
        exposed.append(f * (max(0.0, exchange - (tau + outer.backward_overlap) * t) + outer.fragment_overhead_seconds))
    bound = f * max(max(seconds), max(down), merge)  # the busiest link direction, or the merge, every fragment
    if timed:  # a round lasts round_seconds of wall clock; what is exposed comes out of its steps
        wall = max(outer.round_seconds, *(x + b for x, b in zip(exposed, busy)), bound)
        inner = [(wall - x) / b for x, b in zip(exposed, busy)]
    else:
        inner = planned
        wall = max(bound, *(h * b + x for h, b, x in zip(inner, busy, exposed)))
    return [
        IslandRound(
            name=isl.name, step_seconds=t, inner_steps=h, tokens_per_round=h * isl.tokens_per_step,
            compute_seconds=h * t, bytes_up=moved, bytes_down=back, rate_gbps=rate, transfer_up_seconds=f * s,
            transfer_down_seconds=f * d, fragment_exchange_seconds=e, overlap_steps=tau, exposed_seconds=x,
            compute_utilization=h * t / wall, bytes_per_day=(moved + back) * SECONDS_PER_DAY / wall,
        )
        for isl, t, h, rate, s, d, e, tau, x in zip(islands, steps, inner, rates, seconds, down, exchanges, taus,
                                                     exposed)
    ], wall


def plan(
    model: ModelSpec,
    islands: Sequence[IslandSpec],
    outer: OuterSpec = OuterSpec(),
    coordinator: CoordinatorSpec = CoordinatorSpec(),
    dp_dtype: str = "bf16",
    targets: Sequence[float] = TARGETS,
) -> Plan:
    """The round of `islands` training `model` under `outer` (the equations: docs/planner.md#the-model).

    Args:
      model: parameter counts and layers.
      islands: each island's hardware, step and link.
      outer: the outer loop and the exchange (codec, H or sync, fragments, tau, pipeline, shared link).
      coordinator: its link, cores and merge cost, and its shards (left out of a ring).
      dp_dtype: "bf16" or "fp32" gradients for the data-parallel baseline.
      targets: compute utilizations in (0, 1] to give the required link rate for.

    Returns:
      A `Plan` (seconds per round, bytes, Gbit/s; memory in bytes).

    Raises:
      PlanError: an input is invalid (the message names it and what to give).
      KeyError: an island's hardware is not in the catalog.
    """
    check_inputs(model, islands, outer, coordinator, targets)
    if dp_dtype not in DP_BYTES:
        raise PlanError(f"dp_dtype is {dp_dtype!r}; choose one of {sorted(DP_BYTES)}")
    payload = model.total_params * outer.wire_bytes_per_param()
    update = model.total_params * outer.update_wire_bytes_per_param()
    rounds, wall = _rounds(model, islands, outer, coordinator, payload, update)

    def utilization(gbps):
        return min(r.compute_utilization for r in _rounds(model, islands, outer, coordinator, payload, update, gbps)[0])

    k, ring = len(islands), outer.topology == "ring"
    memory = coordinator_memory(model, k, payload, update, coordinator, ring)
    cpu = 0.0 if ring else coordinator_cpu_seconds(model, k, coordinator)
    notes = []
    if any(i.step_seconds == 0 and i.hardware == "cpu" for i in islands):
        notes.append("hardware 'cpu' has no real peak in the catalog; give a measured step time "
                     "(--step_seconds, or --workdir of a finished run) for a meaningful step")
    if model.num_layers and outer.fragments > model.num_layers:
        notes.append(f"F={outer.fragments} fragments for {model.num_layers} layers: Streaming DiLoCo's fragments "
                     "are groups of whole layers (island_jax's, of whole leaves), so some split a layer")
    for isl in islands:
        if isl.link.window_bytes and isl.link.rate_gbps() < isl.link.gbps:
            notes.append(f"island {isl.name}: {isl.link.connections} connections x a {isl.link.window_bytes}-byte "
                         f"window over {isl.link.rtt_ms:g} ms carry {isl.link.rate_gbps():.3g} Gbit/s of its "
                         f"{isl.link.gbps:g}; more connections or a larger window would raise it")
    required = {t: required_gbps(utilization, t) for t in targets}
    if any(g is None for g in required.values()):
        notes.append(
            f"with unlimited island links compute utilization stops at {utilization(GBPS_RANGE[1]):.4f}: what "
            "the links cannot change caps it (the coordinator's link and merge, windows, per-fragment overhead, "
            "islands of unequal rounds, steps slowed by the exchange beside them)"
        )
    return Plan(
        model=model, outer=outer, coordinator=coordinator, payload_bytes=payload, update_bytes=update, islands=rounds,
        wall_seconds=wall,
        required_gbps=required, coordinator_memory=memory, coordinator_cpu_seconds=cpu,
        coordinator_bytes_per_day=0.0 if ring else
        k * (payload + update) * SECONDS_PER_DAY / wall,
        dp=data_parallel(model, islands, outer, DP_BYTES[dp_dtype], targets), notes=notes,
    )
