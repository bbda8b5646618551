"""The bandwidth budget of a run across islands: compute utilization, and the link it needs, before it runs.

  python -m island_jax.plan --config=experiments/configs/two_islands.py --step_seconds=0.19
  python -m island_jax.plan --total_params=671e9 --active_params=37e9 --layers=61 \\
      --island=name=us,hardware=h100,devices=1024,batch=2048,seq_len=4096 \\
      --island=name=eu,hardware=h100,devices=1024,batch=2048,seq_len=4096 --gbps=25 --rtt_ms=150
  python -m island_jax.plan --workdir=WORKDIR      # a finished run: predicted against measured

`plan(model, islands, outer, coordinator)` returns a `Plan`: per island and
per round the compute seconds, the bytes each way, the transfer and exposed
communication seconds and the compute utilization; the lowest link rate that
keeps every island at 90/95/99% utilization; the coordinator's memory, CPU
seconds and bytes per day; and a data-parallel baseline beside it.
`predict(workdir)` sets a finished run's measured utilization beside the
plan of its recorded step times and link settings. docs/planner.md gives the
equations and sets them beside published runs.

The model (seconds per round, P the contribution's payload bytes, F fragments, K islands):
  step       t_i = 6 x active params x tokens per step / (devices x peak x MFU),
             or a measured step time (Kaplan et al. 2020, C = 6ND).
  compute    C_i = H_i x t_i (sync "steps"; "auto": H_i = H_ref x t_ref / t_i; "time": a round
             lasts round_seconds and H_i = (round_seconds - X_i) / busy step_i).
  rate       r_i = min(link Gbit/s, connections x one window per RTT) (`comm.link.steady_gbps`),
             divided among the K islands when they share one link, and at most the
             coordinator's Gbit/s / K.
  transfer   U_i = (P / F) x 8 / r_i up and D_i = (P' / F) x 8 / r_i down, each fragment (P' the
             update's bytes: `codec.update_kind`, P' = P when it is the contributions' codec).
  merge      m = params x (fixed + per_island x K) ns / coordinator cores, m / F per fragment.
  exchange   S = (max_j U_j, m / F, D_i), the three stages of a fragment's exchange;
             E_i = sum(S) + L + L_i                              (not pipelined)
             E_i = max(S) + (sum(S) - max(S)) / n + L + L_i      (comm.pipeline: the stages
             overlap chunk by chunk, n chunks of at most comm.chunk_bytes)
             E = 2 (K - 1) / K x (P / F) x 8 / min_j r_j + 2 (K - 1) L   (a ring all-reduce)
             with L_i island i's one-way latency (RTT / 2) and L = max_j L_j.
  exposed    X_i = F x (max(0, E_i - (tau + b) x t_i) + fragment overhead), b the fraction
             of a step that hides the exchange before tau's steps (2/3 from the backward
             pass; 0 for island_jax); tau "auto" = ceil(E_i / t_i) + 1, at most H_i - 1.
  round      W = max over islands of (H_i x busy step_i + X_i), at least F x max(U_i, m / F)
             (busy step: a measured mean step with the exchange beside it, else t_i);
             compute utilization_i = C_i / W.
  DP         a ring all-reduce across the K islands every step: 2 (K - 1) / K x params
             x (2 or 4) bytes each way, overlapped with the backward pass (2/3 of a step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence

import ml_collections

from island_jax.comm.link import steady_gbps
from island_jax.config import update_kind
from island_jax.hardware import lookup
from island_jax.outer import codec as codec_lib
from island_jax.outer.fragments import auto_overlap_steps
from island_jax.planning import scaled_inner_steps

SECONDS_PER_DAY = 86400.0
TARGETS = (0.90, 0.95, 0.99)  # compute utilizations the required link rate is given for
TOPOLOGIES = ("coordinator", "ring")  # values of Outer.topology
DP_BYTES = {"bf16": 2, "fp32": 4}  # bytes per gradient element of the data-parallel baseline
BACKWARD_FRACTION = 2.0 / 3.0  # of a step: the backward pass (4 of the 6 N FLOPs per token) a reduction hides in
# The coordinator's CPU per round in ns per parameter, params x (fixed + per_island x K), fitted by
# benchmarks/merge.py on the machine of docs/benchmarks.md#the-coordinators-merge (int8, block 256).
MERGE_FIXED_NS = 11.5
MERGE_PER_ISLAND_NS = 4.2
_GBPS_RANGE = (1e-6, 1e9)  # Gbit/s searched for a required rate


class PlanError(ValueError):
    """An input of the planner is invalid; the message names it and what to give instead."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One island's path to the coordinator.

    Attributes:
      gbps: rate each way, Gbit/s (`math.inf`: not a constraint).
      rtt_ms: round trip, ms.
      connections: parallel connections (gRPC channels) the exchange streams over.
      window_bytes: bytes in flight per connection, like a TCP window (0: no window).
    """

    gbps: float = 25.0
    rtt_ms: float = 0.0
    connections: int = 16
    window_bytes: int = 0

    def rate_gbps(self) -> float:
        """The steady rate its connections reach, Gbit/s (`comm.link.steady_gbps`)."""
        return steady_gbps(self.gbps, self.rtt_ms / 1e3, self.window_bytes, self.connections)


@dataclasses.dataclass(frozen=True)
class Model:
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
class Island:
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
    link: Link = Link()
    busy_step_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def seconds_per_step(self, model: Model) -> float:
        """`step_seconds`, else training FLOPs per token x tokens per step / (devices x peak x MFU), seconds.

        Raises:
          KeyError: hardware outside the catalog.
        """
        if self.step_seconds > 0:
            return self.step_seconds
        flops = self.num_devices * lookup(self.hardware).peak_tflops * 1e12 * self.mfu
        return model.train_flops_per_token * self.tokens_per_step / flops


@dataclasses.dataclass(frozen=True)
class Outer:
    """The outer loop and the exchange.

    Attributes:
      codec: `codec.kind` (none, bf16, int8, int4, topk); block_size: elements per scale.
      update_codec: `codec.update_kind`, the update's codec ("": `codec`'s).
      topk_group, topk_k: topk's group and values kept per group (`codec.topk_group`, `codec.topk_k`).
      bytes_per_param: bytes on the wire per parameter up (0: from the codec: int8 1 + 4 / block);
        update_bytes_per_param: down (0: from the update's codec, or `bytes_per_param` when it is the same).
        The coordinator's merge constants were measured for int8; other codecs use them as they are.
      sync: "steps" (each island's H), "auto" (H scaled by step time from the reference island's), "time".
      reference_island: under "auto", the island whose H is kept ("": the first).
      round_seconds: with sync "time", the wall-clock seconds of every round (the exchange's exposed
        seconds come out of its steps).
      fragments: F (Streaming DiLoCo); overlap_steps: tau, an int or "auto".
      pipeline: `comm.pipeline` (the update flows back while contributions arrive).
      chunk_bytes: `comm.chunk_bytes`, the largest chunk of a payload: a pipelined exchange
        overlaps its stages chunk by chunk (`pipelined_seconds`).
      shared_link: the islands share one link (each island's rate is divided among the K).
      fragment_overhead_seconds: training-thread seconds per fragment exchanged (its pseudo-gradient,
        the update's placement and mixing), added per fragment whatever tau hides.
      backward_overlap: steps (a fraction) that hide an exchange before tau's: 2/3 where the exchange
        starts with the backward pass of the step it follows, as the published simulators assume; 0 for
        island_jax, whose islands contribute after the step.
      topology: "coordinator" (island_jax: every island sends its payload up and takes the update down)
        or "ring" (an all-reduce among the islands, no coordinator: each moves 2 (K - 1) / K of the
        payload each way and waits 2 (K - 1) one-way latencies, as DiLoCo's papers and INTELLECT-1 do).
    """

    codec: str = "int8"
    block_size: int = 256
    bytes_per_param: float = 0.0
    update_codec: str = ""
    topk_group: int = 4096
    topk_k: int = 64
    update_bytes_per_param: float = 0.0
    sync: str = "steps"
    reference_island: str = ""
    round_seconds: float = 0.0
    fragments: int = 1
    overlap_steps: int | str = 0
    pipeline: bool = True
    chunk_bytes: int = 1 << 20
    shared_link: bool = False
    fragment_overhead_seconds: float = 0.0
    backward_overlap: float = 0.0
    topology: str = "coordinator"

    def _codec(self, kind: str) -> "codec_lib.Codec":
        return codec_lib.Codec(kind, self.block_size, self.topk_group, self.topk_k)

    def wire_bytes_per_param(self) -> float:
        """Bytes per parameter of a contribution (`bytes_per_param`, else the codec's for a long leaf)."""
        if self.bytes_per_param > 0:
            return self.bytes_per_param
        return codec_lib.bytes_per_element(self._codec(self.codec))

    def update_wire_bytes_per_param(self) -> float:
        """Bytes per parameter of an update (`update_bytes_per_param`, else the update codec's for a long leaf, or
        the contribution's when the two codecs are one)."""
        if self.update_bytes_per_param > 0:
            return self.update_bytes_per_param
        if self.update_codec in ("", self.codec):
            return self.wire_bytes_per_param()
        return codec_lib.bytes_per_element(self._codec(self.update_codec))

    @property
    def codecs(self) -> str:
        """The codecs both ways, e.g. "topk" or "topk up, int8 down"."""
        down = self.update_codec or self.codec
        return self.codec if down == self.codec else f"{self.codec} up, {down} down"


@dataclasses.dataclass(frozen=True)
class Coordinator:
    """Attributes: gbps (its own link each way, Gbit/s, which all islands' traffic crosses; `math.inf`:
    not a constraint); cores (CPU cores its merge spreads over); fixed_ns_per_param and
    per_island_ns_per_param (its CPU per round, params x (fixed + per_island x K) ns, from
    benchmarks/merge.py); momentum (the outer optimizer keeps a momentum buffer)."""

    gbps: float = math.inf
    cores: int = 64
    fixed_ns_per_param: float = MERGE_FIXED_NS
    per_island_ns_per_param: float = MERGE_PER_ISLAND_NS
    momentum: bool = True


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
class DataParallel:
    """The baseline: a ring all-reduce of the gradients across the islands every step."""

    bytes_per_step: float  # each way, per island
    step_seconds: float  # the balanced step (`_data_parallel`)
    comm_seconds: float
    exposed_seconds: float
    compute_utilization: float
    required_gbps: dict[float, float | None]  # target -> Gbit/s (0.0: any rate; None: no rate reaches it)
    bytes_per_day: float  # both ways, per island


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` returns; `str(plan)` (`format`) is what the command line prints."""

    model: Model
    outer: Outer
    coordinator: Coordinator
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
        """The coordinator's CPU seconds per round spread over its cores."""
        return self.coordinator_cpu_seconds / self.coordinator.cores

    def __str__(self) -> str:
        return format_plan(self)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(model: Model, islands: Sequence[Island], outer: Outer, coordinator: Coordinator, targets) -> None:
    """Raises PlanError naming the first invalid input (KeyError: hardware outside the catalog)."""

    def need(ok, message):
        if not ok:
            raise PlanError(message)

    need(_finite(model.total_params) and model.total_params > 0,
         f"total_params is {model.total_params}; give the model's parameters (> 0)")
    need(_finite(model.active_params) and 0 <= model.active_params <= model.total_params,
         f"active_params is {model.active_params}; give 0 (all active) or up to total_params")
    need(len(islands) > 0, "no islands; give at least one (--island=name=a,...)")
    names = [i.name for i in islands]
    need(len(set(names)) == len(names), f"two islands share a name in {names}; give each its own")
    need(outer.sync in ("steps", "auto", "time"), f"sync is {outer.sync!r}; choose steps, auto or time")
    need(outer.sync != "time" or (_finite(outer.round_seconds) and outer.round_seconds > 0),
         f"sync is 'time' and round_seconds is {outer.round_seconds}; give round_seconds > 0")
    need(not outer.reference_island or outer.reference_island in names,
         f"reference_island is {outer.reference_island!r}, not one of {names}")
    need(outer.codec in codec_lib.KINDS, f"codec is {outer.codec!r}; choose one of {codec_lib.KINDS}")
    need(outer.update_codec in ("", *codec_lib.KINDS),
         f"update_codec is {outer.update_codec!r}; choose one of {codec_lib.KINDS} (or '' for codec's)")
    need(isinstance(outer.topk_group, int) and isinstance(outer.topk_k, int) and 1 <= outer.topk_k <= outer.topk_group,
         f"topk_group {outer.topk_group} and topk_k {outer.topk_k}: give 1 <= topk_k <= topk_group")
    need(_finite(outer.update_bytes_per_param) and outer.update_bytes_per_param >= 0,
         f"update_bytes_per_param is {outer.update_bytes_per_param}; give 0 (from the codec) or bytes > 0")
    from_codec = outer.bytes_per_param == 0 or (outer.update_codec not in ("", outer.codec)
                                                and outer.update_bytes_per_param == 0)
    need(not from_codec or (isinstance(outer.block_size, int) and outer.block_size >= 1),
         f"block_size is {outer.block_size}; give elements per scale >= 1 (or bytes_per_param)")
    need(_finite(outer.bytes_per_param) and outer.bytes_per_param >= 0,
         f"bytes_per_param is {outer.bytes_per_param}; give 0 (from the codec) or bytes > 0")
    need(isinstance(outer.fragments, int) and outer.fragments >= 1, f"fragments is {outer.fragments}; give 1 or more")
    need(isinstance(outer.chunk_bytes, int) and outer.chunk_bytes >= 1, f"chunk_bytes is {outer.chunk_bytes}; give >= 1")
    tau = outer.overlap_steps
    need(tau == "auto" or (isinstance(tau, int) and tau >= 0), f"overlap_steps is {tau!r}; give an int >= 0 or 'auto'")
    need(outer.topology in TOPOLOGIES, f"topology is {outer.topology!r}; choose one of {TOPOLOGIES}")
    for name in ("backward_overlap", "fragment_overhead_seconds"):
        need(_finite(getattr(outer, name)) and getattr(outer, name) >= 0, f"{name} is {getattr(outer, name)}; give >= 0")
    need(coordinator.gbps > 0, f"the coordinator's gbps is {coordinator.gbps}; give a rate > 0 Gbit/s (inf: unlimited)")
    need(isinstance(coordinator.cores, int) and coordinator.cores >= 1,
         f"the coordinator's cores is {coordinator.cores}; give 1 or more")
    need(all(_finite(x) and x >= 0 for x in (coordinator.fixed_ns_per_param, coordinator.per_island_ns_per_param)),
         "the coordinator's merge ns per parameter must be >= 0")
    need(all(_finite(t) and 0 < t <= 1 for t in targets), f"targets are {tuple(targets)}; give utilizations in (0, 1]")
    for isl in islands:
        p, link = f"island {isl.name!r}", isl.link
        need(link.gbps > 0, f"{p}: link gbps is {link.gbps}; give a rate > 0 Gbit/s (inf: unlimited)")
        need(_finite(link.rtt_ms) and link.rtt_ms >= 0, f"{p}: rtt_ms is {link.rtt_ms}; give a round trip >= 0 ms")
        need(isinstance(link.window_bytes, int) and link.window_bytes >= 0,
             f"{p}: window_bytes is {link.window_bytes}; give 0 (no window) or bytes > 0")
        need(isinstance(link.connections, int) and link.connections >= 1,
             f"{p}: connections is {link.connections}; give 1 or more")
        need(isinstance(isl.inner_steps, int) and isl.inner_steps >= 1, f"{p}: inner_steps is {isl.inner_steps}; give H >= 1")
        for name in ("step_seconds", "busy_step_seconds"):
            need(_finite(getattr(isl, name)) and getattr(isl, name) >= 0,
                 f"{p}: {name} is {getattr(isl, name)}; give measured seconds > 0 (0: none)")
        if isl.step_seconds == 0:
            lookup(isl.hardware)
            need(isinstance(isl.num_devices, int) and isl.num_devices >= 1 and _finite(isl.mfu) and 0 < isl.mfu <= 1
                 and isl.tokens_per_step > 0,
                 f"{p}: without step_seconds give devices >= 1, 0 < mfu <= 1, batch and seq_len > 0")
        if outer.sync == "steps":  # as island_jax's config refuses them (config._check_island_rounds)
            need(isl.inner_steps >= outer.fragments,
                 f"{p}: inner_steps is {isl.inner_steps} but fragments is {outer.fragments}; every fragment "
                 "needs its own inner step of the round")
            need(tau == "auto" or tau < isl.inner_steps,
                 f"overlap_steps is {tau} but {p} has inner_steps {isl.inner_steps}; a fragment's update must "
                 "land before its next contribution: give fewer overlap steps than H, or 'auto'")


def _planned_steps(islands: Sequence[Island], steps: list[float], outer: Outer) -> list[float]:
    """H per island under sync "steps" or "auto" (under "time" the round's seconds set it, `_rounds`)."""
    if outer.sync != "auto":
        return [float(i.inner_steps) for i in islands]
    # auto: the reference island keeps its H, the others take as many steps as fit in its round
    ref = next((k for k, i in enumerate(islands) if i.name == outer.reference_island), 0)
    return [float(scaled_inner_steps(islands[ref].inner_steps, 1.0 / t, 1.0 / steps[ref])) for t in steps]


def pipelined_seconds(stages: Sequence[float], chunks: int) -> float:
    """Seconds for `chunks` equal chunks to pass stages that each take `stages[s]` seconds for the whole
    payload, one chunk per stage at a time: the slowest stage's whole time, plus the other stages' time for
    one chunk (the pipeline filling and draining). 1 chunk: the stages one after the other."""
    slowest = max(stages)
    return slowest + (sum(stages) - slowest) / max(chunks, 1)


def _links(islands: Sequence[Island], gbps: float | None) -> list[Link]:
    """The islands' links, each at `gbps` when given."""
    return [i.link if gbps is None else dataclasses.replace(i.link, gbps=gbps) for i in islands]


def _seconds(nbytes: float, gbps: float) -> float:
    """Seconds to move `nbytes` at `gbps` (0 at an unlimited rate)."""
    return nbytes * 8 / (gbps * 1e9) if math.isfinite(gbps) else 0.0


def _coordinator_cpu(model: Model, k: int, coordinator: Coordinator) -> float:
    """The coordinator's CPU seconds per round: params x (fixed + per_island x K) ns."""
    return model.total_params * (coordinator.fixed_ns_per_param + coordinator.per_island_ns_per_param * k) * 1e-9


def _rounds(model, islands, outer, coordinator, payload, update, gbps=None):
    """The islands' rounds and the round's wall seconds W, every island's link at `gbps` when given
    (`payload`, `update`: bytes of a contribution and of an update)."""
    k, f = len(islands), outer.fragments
    ring, timed = outer.topology == "ring", outer.sync == "time"
    moved = payload * (2 * (k - 1) / k if ring else 1.0)  # up, per island per round
    back = moved if ring else update  # down
    steps = [i.seconds_per_step(model) for i in islands]
    busy = [i.busy_step_seconds or t for i, t in zip(islands, steps)]
    planned = _planned_steps(islands, steps, outer)
    links = _links(islands, gbps)
    rates = []
    for link in links:
        rate = link.rate_gbps() / (k if outer.shared_link else 1)
        rates.append(rate if ring else min(rate, coordinator.gbps / k))
    seconds = [_seconds(moved / f, r) for r in rates]
    down = [_seconds(back / f, r) for r in rates]
    one_way = [link.rtt_ms / 2e3 for link in links]
    merge = 0.0 if ring else _coordinator_cpu(model, k, coordinator) / coordinator.cores / f
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


def _required(utilization, target: float) -> float | None:
    """The lowest Gbit/s at which `utilization(gbps)` reaches `target`, by bisection in log rate: 0.0 where
    even the lowest rate searched (1e-6 Gbit/s) does, None where no rate does."""
    lo, hi = _GBPS_RANGE
    if utilization(hi) < target:
        return None
    if utilization(lo) >= target:
        return 0.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if utilization(mid) < target else (lo, mid)
        if hi / lo < 1 + 1e-6:
            break
    return hi


def _data_parallel(model, islands, outer, dp_bytes, targets) -> DataParallel:
    """The ring all-reduce baseline. Its global batch is every island's tokens per step, split so that every
    island's share takes the same time: the step is sum(tokens) / sum(tokens_i / t_i). With `shared_link`
    the islands share their link here too."""
    k = len(islands)
    steps = [i.seconds_per_step(model) for i in islands]
    tokens = [i.tokens_per_step or 1 for i in islands]
    step = sum(tokens) / sum(n / t for n, t in zip(tokens, steps))
    nbytes = 2 * (k - 1) / k * model.total_params * dp_bytes
    share = k if outer.shared_link else 1

    def at(gbps=None):
        if k == 1:
            return 0.0, 0.0, 1.0
        comm = max(_seconds(nbytes, link.rate_gbps() / share) + 2 * (k - 1) * link.rtt_ms / 2e3
                   for link in _links(islands, gbps))
        exposed = max(0.0, comm - BACKWARD_FRACTION * step)
        return comm, exposed, step / (step + exposed)

    comm, exposed, util = at()
    return DataParallel(
        bytes_per_step=nbytes, step_seconds=step, comm_seconds=comm, exposed_seconds=exposed,
        compute_utilization=util, required_gbps={t: _required(lambda g: at(g)[2], t) for t in targets},
        bytes_per_day=2 * nbytes * SECONDS_PER_DAY / (step + exposed),
    )


def plan(
    model: Model,
    islands: Sequence[Island],
    outer: Outer = Outer(),
    coordinator: Coordinator = Coordinator(),
    dp_dtype: str = "bf16",
    targets: Sequence[float] = TARGETS,
) -> Plan:
    """The round of `islands` training `model` under `outer` (the model is in this module's docstring).

    Args:
      model: parameter counts and layers.
      islands: each island's hardware, step and link.
      outer: the outer loop and the exchange (codec, H or sync, fragments, tau, pipeline, shared link).
      coordinator: its link, cores and merge cost (left out of a ring).
      dp_dtype: "bf16" or "fp32" gradients for the data-parallel baseline.
      targets: compute utilizations in (0, 1] to give the required link rate for.

    Returns:
      A `Plan` (seconds per round, bytes, Gbit/s; memory in bytes).

    Raises:
      PlanError: an input is invalid (the message names it and what to give).
      KeyError: an island's hardware is not in the catalog.
    """
    _check(model, islands, outer, coordinator, targets)
    if dp_dtype not in DP_BYTES:
        raise PlanError(f"dp_dtype is {dp_dtype!r}; choose one of {sorted(DP_BYTES)}")
    payload = model.total_params * outer.wire_bytes_per_param()
    update = model.total_params * outer.update_wire_bytes_per_param()
    rounds, wall = _rounds(model, islands, outer, coordinator, payload, update)

    def utilization(gbps):
        return min(r.compute_utilization for r in _rounds(model, islands, outer, coordinator, payload, update, gbps)[0])

    k, ring = len(islands), outer.topology == "ring"
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
    cpu = 0.0 if ring else _coordinator_cpu(model, k, coordinator)
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
    required = {t: _required(utilization, t) for t in targets}
    if any(g is None for g in required.values()):
        notes.append(
            f"with unlimited island links compute utilization stops at {utilization(_GBPS_RANGE[1]):.4f}: what "
            "the links cannot change caps it (the coordinator's link and merge, windows, per-fragment overhead, "
            "islands of unequal rounds, steps slowed by the exchange beside them)"
        )
    return Plan(
        model=model, outer=outer, coordinator=coordinator, payload_bytes=payload, update_bytes=update, islands=rounds,
        wall_seconds=wall,
        required_gbps=required, coordinator_memory=memory, coordinator_cpu_seconds=cpu,
        coordinator_bytes_per_day=0.0 if ring else
        k * (payload + update) * SECONDS_PER_DAY / wall,
        dp=_data_parallel(model, islands, outer, DP_BYTES[dp_dtype], targets), notes=notes,
    )


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _gbps(value: float | None) -> str:
    return "unreachable" if value is None else "any" if value == 0 else f"{value:.3g}"


def format_plan(p: Plan) -> str:
    """The plan as the command line prints it: a line on the model and the exchange, a table of the
    islands' rounds, then the required link rates, the coordinator and the data-parallel baseline."""
    o = p.outer
    head = (
        f"model: {_si(p.model.total_params, '')}parameters ({_si(p.model.active, '')}active); {o.codecs} at "
        + (f"{o.wire_bytes_per_param():.6g} bytes/parameter: {_si(p.payload_bytes, 'B')} each way per island per round; "
           if p.update_bytes == p.payload_bytes else
           f"{o.wire_bytes_per_param():.6g} and {o.update_wire_bytes_per_param():.6g} bytes/parameter: "
           f"{_si(p.payload_bytes, 'B')} up and {_si(p.update_bytes, 'B')} down per island per round; ") +
        f"F={o.fragments}, tau={o.overlap_steps}, pipeline={'on' if o.pipeline else 'off'}, sync={o.sync}, "
        f"topology={o.topology}" + (", one shared link" if o.shared_link else "")
    )
    columns = ("island", "H", "step s", "compute s", "up", "down", "Gbit/s", "transfer s", "tau", "exposed s",
               "utilization", "bytes/day")
    table = [columns] + [
        (r.name, f"{r.inner_steps:.4g}", f"{r.step_seconds:.4g}", f"{r.compute_seconds:.4g}", _si(r.bytes_up, "B"),
         _si(r.bytes_down, "B"), f"{r.rate_gbps:.4g}", f"{r.transfer_up_seconds:.4g}", str(r.overlap_steps),
         f"{r.exposed_seconds:.4g}", f"{r.compute_utilization:.4f}", _si(r.bytes_per_day, "B"))
        for r in p.islands
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = [head, "per round:"] + ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    req = ", ".join(f"{t:.0%} {_gbps(g)}" for t, g in p.required_gbps.items())
    dreq = ", ".join(f"{t:.0%} {_gbps(g)}" for t, g in p.dp.required_gbps.items())
    mem = ", ".join(f"{k.replace('_', ' ')} {_si(v, 'B')}" for k, v in p.coordinator_memory.items() if k != "total")
    d, c = p.dp, p.coordinator
    lines += [
        f"round: {p.wall_seconds:.4g} s; compute utilization {p.compute_utilization:.4f} (the lowest island)",
        f"link Gbit/s each way, on every island's link, for compute utilization {req}",
        "coordinator: none (a ring all-reduce among the islands)" if o.topology == "ring" else
        f"coordinator: memory {_si(p.coordinator_memory['total'], 'B')} ({mem}); CPU {p.coordinator_cpu_seconds:.4g} "
        f"s/round (params x ({c.fixed_ns_per_param:g} + {c.per_island_ns_per_param:g} x K) ns, the merge rate "
        f"benchmarks/merge.py measured), {p.merge_seconds:.4g} s over {c.cores} cores; "
        f"{_si(p.coordinator_bytes_per_day, 'B')}/day",
        f"data parallel (ring all-reduce across the {len(p.islands)} island{'s' if len(p.islands) > 1 else ''} "
        "every step): "
        f"{_si(d.bytes_per_step, 'B')} each way per step, {d.comm_seconds:.4g} s against a {d.step_seconds:.4g} s "
        f"step ({d.exposed_seconds:.4g} s exposed); compute utilization {d.compute_utilization:.4f}; "
        f"link Gbit/s for {dreq}; {_si(d.bytes_per_day, 'B')}/day",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# -- from a config, and against a finished run ---------------------------------------------------------


def model_of(config: ml_collections.ConfigDict) -> Model:
    """The parameter counts of `config.model` / `config.moe`, from the shapes alone (`model.flops.model_size`).

    Active parameters count k of the E routed experts of each MoE layer.
    """
    from island_jax.model.flops import model_size

    size = model_size(config)
    return Model(float(size.total_params), float(size.active_params), size.num_layers, size.flops_per_token)


def link_of(config: ml_collections.ConfigDict) -> Link:
    """Every island's link as `config.comm` emulates it (`comm.link`, `comm.connections`); a link not
    emulated (0 Gbit/s) is unlimited."""
    c = config.comm
    return Link(c.link.bandwidth_gbps or math.inf, 2 * c.link.latency_ms, c.connections, c.link.window_bytes)


def from_config(
    config: ml_collections.ConfigDict,
    step_seconds: dict | None = None,
    mfu: float = 0.4,
    link: Link | None = None,
    busy_step_seconds: dict | None = None,
) -> tuple[Model, list[Island], Outer, Coordinator]:
    """The planner's inputs for a run's config (island_jax/config.py).

    Args:
      config: the run's config: model, islands (hardware, devices, batch, H), codec, outer, comm.
      step_seconds: {island: measured seconds per step}; islands not in it take the catalog and `mfu`.
      mfu: the MFU of catalog step times.
      link: every island's link; None: `link_of(config)`.
      busy_step_seconds: {island: measured mean step seconds with the exchange beside it}.

    Returns:
      (model, islands, outer, coordinator) for `plan`.

    Raises:
      PlanError: `step_seconds` or `busy_step_seconds` names an island the config does not have.
    """
    step_seconds, busy_step_seconds = step_seconds or {}, busy_step_seconds or {}
    names = list(config.islands.keys())
    for given in (step_seconds, busy_step_seconds):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise PlanError(f"step seconds for {unknown}, which the config has no island of; its islands are {names}")
    o = config.outer
    outer = Outer(
        codec=config.codec.kind, block_size=config.codec.block_size, update_codec=update_kind(config.codec),
        topk_group=config.codec.topk_group, topk_k=config.codec.topk_k, sync=o.sync,
        reference_island=o.reference_island, round_seconds=o.round_seconds if o.sync == "time" else 0.0,
        fragments=o.fragments, overlap_steps=o.overlap_steps, pipeline=bool(config.comm.pipeline),
        chunk_bytes=config.comm.chunk_bytes,
    )
    link = link or link_of(config)
    islands = [
        Island(name=name, num_devices=isl.num_devices, hardware=isl.hardware, mfu=mfu,
               step_seconds=step_seconds.get(name, 0.0), batch_size=isl.batch_size, seq_len=config.model.seq_len,
               inner_steps=isl.inner_steps, link=link, busy_step_seconds=busy_step_seconds.get(name, 0.0))
        for name, isl in config.islands.items()
    ]
    return model_of(config), islands, outer, Coordinator(momentum=o.momentum > 0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A finished run's compute utilization per island: `predicted` by `plan` from the run's recorded step
    times, payload and link settings, beside what its accounting measured over the same rounds: in its
    median round (`measured`, what a plan of one steady round is compared with; a one-off stall, such as
    a collector pause, moves it little) and over all of them (`measured_overall`, ideal compute / wall)."""

    plan: Plan
    predicted: dict[str, float]  # island -> compute utilization
    measured: dict[str, float]  # island -> compute utilization of its median round
    measured_overall: dict[str, float]  # island -> ideal compute seconds / wall seconds over the rounds
    rounds: list[int]  # the rounds compared (1-based)

    def __str__(self) -> str:
        rows = [f"{'island':>8} {'predicted':>10} {'measured':>10} {'difference':>11} {'all rounds':>11}"]
        for name in self.predicted:
            p, m = self.predicted[name], self.measured[name]
            rows.append(f"{name:>8} {p:10.4f} {m:10.4f} {p - m:+11.4f} {self.measured_overall[name]:11.4f}")
        return f"rounds {self.rounds[0]}..{self.rounds[-1]} (measured: the median round):\n" + "\n".join(rows)


def predict(workdir: str, fragment_overhead_seconds: float = 0.0) -> Prediction:
    """Predicts a finished run's compute utilization per island and reads the measured one beside it.

    The prediction takes from the run only its config (model, H or sync, codec, fragments, tau, link
    settings: `comm.link` and `comm.connections`), whether its transport pipelined (the islands'
    `exchange` records), each island's recorded step times (the median over the rounds of
    `clean_step_seconds`, the step with no exchange in flight, and of the mean step, `compute_seconds` /
    `inner_steps`), its recorded steps per round and the payload bytes; never its utilization, wall or
    blocked seconds. Rounds compared: every round after the first (the islands' start) and before the
    last (which waits for the final update), or all of them in a run of fewer than 3 rounds; the measured
    figure is the median round's `compute_utilization`, with the figure over all of them beside it.

    Args:
      workdir: the run's workdir (island_jax/workdir.py).
      fragment_overhead_seconds: training-thread seconds per fragment exchanged, for the plan (`Outer`).

    Raises:
      FileNotFoundError: the workdir holds no island's config.json or metrics.jsonl.
      ValueError: the islands share no recorded round, or no exchange was applied in those compared.
    """
    from island_jax.metrics import read_jsonl
    from island_jax.workdir import island_dir

    folder = os.path.join(workdir, "islands")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not names:
        raise FileNotFoundError(f"{folder} holds no island; give the workdir of a finished run")
    with open(os.path.join(island_dir(workdir, names[0]), "config.json"), encoding="utf-8") as f:
        config = ml_collections.ConfigDict(json.load(f))
    records, pipelined = {}, []
    for name in config.islands.keys():
        latest = {}
        for rec in read_jsonl(os.path.join(island_dir(workdir, name), "metrics.jsonl")):
            if rec.get("kind") == "round":
                latest[rec["round"]] = rec
            elif rec.get("kind") == "exchange":
                pipelined.append(rec["pipelined"])
        records[name] = latest
    common = sorted(set.intersection(*(set(r) for r in records.values())))
    if not common:
        raise ValueError(f"{workdir}: the islands share no recorded round (metrics.jsonl); nothing to compare")
    chosen = common[1:-1] if len(common) >= 3 else common
    clean, busy, steps = {}, {}, {}
    for name, latest in records.items():
        recs = [latest[r] for r in chosen]
        clean[name] = statistics.median(r["clean_step_seconds"] for r in recs)
        busy[name] = statistics.median(r["compute_seconds"] / r["inner_steps"] for r in recs)
        steps[name] = statistics.median(r["inner_steps"] for r in recs)
    model, islands, outer, coordinator = from_config(config, step_seconds=clean, busy_step_seconds=busy)
    islands = [dataclasses.replace(i, inner_steps=max(1, round(steps[i.name]))) for i in islands]
    recs = [latest[r] for latest in records.values() for r in chosen]
    exchanges = sum(r["exchanges"] for r in recs)
    if not exchanges:
        raise ValueError(f"{workdir}: no exchange was applied in rounds {chosen}; nothing to predict")
    per_round = sum(r["payload_bytes"] for r in recs) / exchanges * outer.fragments  # the whole payload
    outer = dataclasses.replace(  # the steps each round took are recorded: no plan of them is needed
        outer, sync="time" if config.outer.sync == "time" else "steps", bytes_per_param=per_round / model.total_params,
        # the update in the measured contribution's proportion to the codecs' rates
        update_bytes_per_param=per_round / model.total_params * outer.update_wire_bytes_per_param()
        / outer.wire_bytes_per_param(),
        fragment_overhead_seconds=fragment_overhead_seconds, pipeline=all(pipelined) if pipelined else outer.pipeline,
    )
    p = plan(model, islands, outer, coordinator)
    measured = {name: statistics.median(latest[r]["compute_utilization"] for r in chosen)
                for name, latest in records.items()}
    overall = {
        name: sum(latest[r]["ideal_compute_seconds"] for r in chosen) / sum(latest[r]["wall_seconds"] for r in chosen)
        for name, latest in records.items()
    }
    return Prediction(p, {r.name: r.compute_utilization for r in p.islands}, measured, overall, chosen)


# -- the command line ----------------------------------------------------------------------------------

_ISLAND_KEYS = {  # --island=KEY=VALUE,... : Island fields, and the Link fields of its path
    "name": str, "hardware": str, "devices": int, "mfu": float, "step_seconds": float, "batch": int,
    "seq_len": int, "inner_steps": int, "gbps": float, "rtt_ms": float, "connections": int, "window_bytes": int,
}
_RENAMED = {"devices": "num_devices", "batch": "batch_size"}
_LINK_KEYS = ("gbps", "rtt_ms", "connections", "window_bytes")
_OUTER_FLAGS = ("codec", "block_size", "update_codec", "topk_group", "topk_k", "bytes_per_param", "sync", "reference_island", "round_seconds", "fragments",
                "overlap_steps", "pipeline", "chunk_bytes", "shared_link", "fragment_overhead_seconds", "backward_overlap",
                "topology")  # flags named as Outer's fields
_PLAN_FLAGS = (*_OUTER_FLAGS, *_LINK_KEYS, "total_params", "active_params", "layers", "island", "step_seconds",
               "mfu", "inner_steps", "coordinator_gbps", "coordinator_cores", "merge_fixed_ns",
               "merge_per_island_ns", "dp_dtype")


def _number(text: str, kind: type, what: str):
    """`text` as a `kind` (int: a whole number written as such, e.g. 64 or 64e3)."""
    try:
        value = float(text)
        if kind is int:
            if not value.is_integer():
                raise ValueError
            return int(value)
        return value
    except (ValueError, OverflowError):
        raise PlanError(f"{what}: {text!r} is not {'a whole number' if kind is int else 'a number'}") from None


def parse_island(text: str, link: Link) -> Island:
    """An `Island` from `--island=name=a,hardware=h100,devices=64,...` (keys: `_ISLAND_KEYS`); link keys
    missing from it come from `link`.

    Raises:
      PlanError: an unknown key, a value of the wrong type, or no name.
    """
    fields, link_fields = {}, {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _ISLAND_KEYS:
            raise PlanError(f"--island={text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(_ISLAND_KEYS)}")
        kind = _ISLAND_KEYS[key]
        parsed = value if kind is str else _number(value, kind, f"--island={text!r}, {key}")
        (link_fields if key in _LINK_KEYS else fields)[_RENAMED.get(key, key)] = parsed
    if "name" not in fields:
        raise PlanError(f"--island={text!r} has no name=; give each island one")
    return Island(**fields, link=dataclasses.replace(link, **link_fields))


def _per_island(text: str, names: Sequence[str]) -> dict[str, float]:
    """{island: seconds} from --step_seconds: "0.2" (every island), "a=0.2,b=0.4", or "" (none).

    Raises:
      PlanError: a value that is not a number, or a name not among `names`.
    """
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(names, _number(text, float, "--step_seconds"))
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in names:
            raise PlanError(f"--step_seconds names {name!r}, which is not one of the islands {list(names)}")
        out[name] = _number(value, float, f"--step_seconds, {name}")
    return out


def _main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    given = {name for name in f if f[name].present}
    if f.workdir:
        extra = sorted(given & set(_PLAN_FLAGS) - {"fragment_overhead_seconds"})
        if extra:
            raise PlanError(f"--workdir plans the run as it was; leave out {', '.join('--' + e for e in extra)}")
        prediction = predict(f.workdir, f.fragment_overhead_seconds)
        print(prediction.plan)
        print(f"predicted against measured compute utilization ({f.workdir}):")
        print(prediction)
        return 0
    link_flags = {k: getattr(f, k) for k in _LINK_KEYS if k in given}
    if f.config is not None:
        if f.island:
            raise PlanError("--island describes islands the config already has; give one or the other")
        config = f.config
        if config.comm.link.bandwidth_gbps:
            link = dataclasses.replace(link_of(config), **link_flags)
        else:
            link = dataclasses.replace(link_of(config), gbps=f.gbps, **link_flags)
            print(f"note: the config emulates no link (comm.link.bandwidth_gbps = 0); planned on {link.gbps:g} "
                  "Gbit/s (--gbps)")
        model, islands, outer, coordinator = from_config(
            config, step_seconds=_per_island(f.step_seconds, list(config.islands.keys())), mfu=f.mfu, link=link)
        model = Model(*(getattr(f, k) if k in given else getattr(model, a) for k, a in
                        (("total_params", "total_params"), ("active_params", "active_params"), ("layers", "num_layers"))),
                      # the config's FLOPs per token, unless the flags changed the parameter counts
                      flops_per_token=0.0 if {"total_params", "active_params"} & set(given) else model.flops_per_token)
    elif f.island:
        link = Link(f.gbps, f.rtt_ms, f.connections, f.window_bytes)
        model = Model(f.total_params, f.active_params, f.layers)
        islands = [parse_island(text, link) for text in f.island]
        steps = _per_island(f.step_seconds, [i.name for i in islands])
        islands = [i if i.step_seconds or i.name not in steps else dataclasses.replace(i, step_seconds=steps[i.name])
                   for i in islands]
        outer, coordinator = Outer(), Coordinator()
    else:
        raise PlanError("give --config=CONFIG, --workdir=WORKDIR, or the model and islands "
                        "(--total_params=... --island=name=a,hardware=h100,devices=64,batch=512,seq_len=4096)")
    if "inner_steps" in given:
        islands = [dataclasses.replace(i, inner_steps=f.inner_steps) for i in islands]
    changes = {name: getattr(f, name) for name in _OUTER_FLAGS if name in given or f.config is None}
    if changes.get("overlap_steps", "auto") != "auto":
        changes["overlap_steps"] = _number(changes["overlap_steps"], int, "--overlap_steps (or auto)")
    outer = dataclasses.replace(outer, **changes)
    coordinator = dataclasses.replace(
        coordinator, gbps=f.coordinator_gbps or math.inf, cores=f.coordinator_cores,
        fixed_ns_per_param=f.merge_fixed_ns, per_island_ns_per_param=f.merge_per_island_ns,
    )
    print(plan(model, islands, outer, coordinator, dp_dtype=f.dp_dtype))
    if f.config is not None:
        print(memory_lines(f.config))
    return 0


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


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "A run's config (its model, islands, codec, outer loop, link).")
    flags.DEFINE_string("workdir", "", "A finished run's workdir: predict its utilization and print it beside the measured.")
    flags.DEFINE_float("total_params", 1e9, "Parameters of the model (what the exchange moves).")
    flags.DEFINE_float("active_params", 0.0, "Parameters active per token (what a step computes; 0: total).")
    flags.DEFINE_integer("layers", 0, "Layers of the model (fragments hold whole layers; 0: unknown).")
    flags.DEFINE_multi_string("island", [], "name=NAME,hardware=KIND,devices=N,mfu=F,step_seconds=S,batch=B,"
                              "seq_len=T,inner_steps=H,gbps=G,rtt_ms=R,connections=C,window_bytes=W (repeat per island).")
    flags.DEFINE_string("step_seconds", "", "Measured seconds per step: S (every island) or a=S,b=S.")
    flags.DEFINE_float("mfu", 0.4, "MFU of step times computed from the catalog peak.")
    flags.DEFINE_integer("inner_steps", 100, "H of every island.")
    flags.DEFINE_float("gbps", 25.0, "Every island's link, Gbit/s each way (inf: unlimited).")
    flags.DEFINE_float("rtt_ms", 0.0, "Every island's round trip, ms.")
    flags.DEFINE_integer("connections", 16, "Parallel connections per island.")
    flags.DEFINE_integer("window_bytes", 0, "Bytes in flight per connection (0: no window).")
    flags.DEFINE_enum("sync", "steps", ["steps", "auto", "time"], "Round planning (outer.sync).")
    flags.DEFINE_string("reference_island", "", "With --sync=auto: the island whose H is kept ('': the first).")
    flags.DEFINE_float("round_seconds", 0.0, "With --sync=time: compute seconds per round.")
    flags.DEFINE_enum("codec", "int8", list(codec_lib.KINDS), "Codec of the pseudo-gradients (and the updates).")
    flags.DEFINE_enum("update_codec", "", ["", *codec_lib.KINDS], "Codec of the updates ('': --codec's).")
    flags.DEFINE_integer("topk_group", 4096, "topk: elements per group.")
    flags.DEFINE_integer("topk_k", 64, "topk: values kept per group.")
    flags.DEFINE_integer("block_size", 256, "Elements per scale of int8 / int4.")
    flags.DEFINE_float("bytes_per_param", 0.0, "Bytes on the wire per parameter (0: from --codec).")
    flags.DEFINE_integer("fragments", 1, "F, Streaming DiLoCo fragments.")
    flags.DEFINE_string("overlap_steps", "0", "tau: inner steps an update may arrive late, or auto.")
    flags.DEFINE_bool("pipeline", True, "comm.pipeline: the update flows back while contributions arrive.")
    flags.DEFINE_integer("chunk_bytes", 1 << 20, "comm.chunk_bytes: the largest chunk a pipelined exchange overlaps.")
    flags.DEFINE_bool("shared_link", False, "The islands share one link (each gets 1/K of its rate).")
    flags.DEFINE_enum("topology", "coordinator", list(TOPOLOGIES), "coordinator (island_jax) or ring (all-reduce).")
    flags.DEFINE_float("backward_overlap", 0.0, "Steps that hide an exchange's start (2/3: from the backward pass).")
    flags.DEFINE_float("fragment_overhead_seconds", 0.0, "Training-thread seconds per fragment exchanged.")
    flags.DEFINE_float("coordinator_gbps", 0.0, "The coordinator's own link, Gbit/s each way (0: unlimited).")
    flags.DEFINE_float("merge_fixed_ns", MERGE_FIXED_NS, "The coordinator's CPU ns per parameter per round.")
    flags.DEFINE_float("merge_per_island_ns", MERGE_PER_ISLAND_NS, "... and per contributing island.")
    flags.DEFINE_integer("coordinator_cores", 64, "CPU cores the coordinator's merge spreads over.")
    flags.DEFINE_enum("dp_dtype", "bf16", sorted(DP_BYTES), "Gradient dtype of the data-parallel baseline.")


def _run(argv):
    try:
        return _main(argv)
    except (PlanError, KeyError, FileNotFoundError, ValueError) as e:  # bad input: say what to give, no traceback
        sys.exit(f"island_jax.plan: {e}")


if __name__ == "__main__":
    from absl import app

    from island_jax.cli import parse_flags

    _define_flags()
    app.run(_run, flags_parser=parse_flags)
