"""The planner's inputs checked before anything is computed: `PlanError` names the first invalid one."""

from __future__ import annotations

import math
from collections.abc import Sequence

from island_jax.hardware import lookup
from island_jax.outer import codec as codec_lib
from island_jax.plan.compute import CoordinatorSpec, IslandSpec, ModelSpec
from island_jax.plan.wire import TOPOLOGIES, OuterSpec


class PlanError(ValueError):
    """An input of the planner is invalid; the message names it and what to give instead."""


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_inputs(model: ModelSpec, islands: Sequence[IslandSpec], outer: OuterSpec, coordinator: CoordinatorSpec, targets) -> None:
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
    need(isinstance(coordinator.shards, int) and coordinator.shards >= 1,
         f"the coordinator's shards is {coordinator.shards} (--coordinator_shards, or the config's coordinator.shards); "
         "give 1 (one process) or more")
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
