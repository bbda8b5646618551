"""The planner's inputs from a run's config (`from_config`) or from the command line's `--island` text."""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from island_jax.config import update_kind
from island_jax.plan.checks import PlanError
from island_jax.plan.compute import CoordinatorSpec, IslandSpec, ModelSpec
from island_jax.plan.wire import LinkSpec, OuterSpec

ISLAND_KEYS = {  # --island=KEY=VALUE,... : IslandSpec fields, and the LinkSpec fields of its path
    "name": str, "hardware": str, "devices": int, "mfu": float, "step_seconds": float, "batch": int,
    "seq_len": int, "inner_steps": int, "gbps": float, "rtt_ms": float, "connections": int, "window_bytes": int,
}
_RENAMED = {"devices": "num_devices", "batch": "batch_size"}
LINK_KEYS = ("gbps", "rtt_ms", "connections", "window_bytes")


def model_of(config: ml_collections.ConfigDict) -> ModelSpec:
    """The parameter counts of `config.model` / `config.moe`, from the shapes alone (`model.flops.model_size`).

    Active parameters count k of the E routed experts of each MoE layer.
    """
    from island_jax.model.flops import model_size

    size = model_size(config)
    return ModelSpec(float(size.total_params), float(size.active_params), size.num_layers, size.flops_per_token)


def link_of(config: ml_collections.ConfigDict) -> LinkSpec:
    """Every island's link as `config.comm` emulates it (`comm.link`, `comm.connections`); a link not
    emulated (0 Gbit/s) is unlimited."""
    c = config.comm
    return LinkSpec(c.link.bandwidth_gbps or math.inf, 2 * c.link.latency_ms, c.connections, c.link.window_bytes)


def from_config(
    config: ml_collections.ConfigDict,
    step_seconds: dict | None = None,
    mfu: float = 0.4,
    link: LinkSpec | None = None,
    busy_step_seconds: dict | None = None,
) -> tuple[ModelSpec, list[IslandSpec], OuterSpec, CoordinatorSpec]:
    """The planner's inputs for a run's config (island_jax/config/schema.py).

    Args:
      config: the run's config: model, islands (hardware, devices, batch, H), codec, outer, comm, coordinator.
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
    outer = OuterSpec(
        codec=config.codec.kind, block_size=config.codec.block_size, update_codec=update_kind(config.codec),
        topk_group=config.codec.topk_group, topk_k=config.codec.topk_k, sync=o.sync,
        reference_island=o.reference_island, round_seconds=o.round_seconds if o.sync == "time" else 0.0,
        fragments=o.fragments, overlap_steps=o.overlap_steps, pipeline=bool(config.comm.pipeline),
        chunk_bytes=config.comm.chunk_bytes,
    )
    link = link or link_of(config)
    islands = [
        IslandSpec(name=name, num_devices=isl.num_devices, hardware=isl.hardware, mfu=mfu,
               step_seconds=step_seconds.get(name, 0.0), batch_size=isl.batch_size, seq_len=config.model.seq_len,
               inner_steps=isl.inner_steps, link=link, busy_step_seconds=busy_step_seconds.get(name, 0.0))
        for name, isl in config.islands.items()
    ]
    shards = config.coordinator.shards if "coordinator" in config else 1  # a config from before coordinator.shards
    return model_of(config), islands, outer, CoordinatorSpec(momentum=o.momentum > 0, shards=shards)


def parse_number(text: str, kind: type, what: str):
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


def parse_island(text: str, link: LinkSpec) -> IslandSpec:
    """An `IslandSpec` from `--island=name=a,hardware=h100,devices=64,...` (keys: `ISLAND_KEYS`); link keys
    missing from it come from `link`.

    Raises:
      PlanError: an unknown key, a value of the wrong type, or no name.
    """
    fields, link_fields = {}, {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ISLAND_KEYS:
            raise PlanError(f"--island={text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(ISLAND_KEYS)}")
        kind = ISLAND_KEYS[key]
        parsed = value if kind is str else parse_number(value, kind, f"--island={text!r}, {key}")
        (link_fields if key in LINK_KEYS else fields)[_RENAMED.get(key, key)] = parsed
    if "name" not in fields:
        raise PlanError(f"--island={text!r} has no name=; give each island one")
    return IslandSpec(**fields, link=dataclasses.replace(link, **link_fields))
