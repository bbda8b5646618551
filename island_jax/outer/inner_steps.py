"""How many inner steps (H) each island takes per round, for `outer.sync`.

  steps  every island takes its own `islands.NAME.inner_steps`.
  auto   the island named by `outer.reference_island` keeps its H; every other
         island gets round(H_ref x (devices x peak) / (devices_ref x peak_ref)),
         peaks from the hardware catalog (Async Local-SGD, arXiv 2401.09135).
         With `outer.auto_from = "measured"`, from round 1 on the ratio of the
         median step times measured in round 0 replaces the ratio of peaks
         (`plan_from_step_times`, which the coordinator calls).
  time   every island trains for `outer.round_seconds` of wall clock; its
         `inner_steps` is then the expected steps per round (the learning-rate
         schedule's length).

Both sides use it: the islands (their H) and the coordinator (a measured plan).
docs/heterogeneity.md says when to use which.
"""

from __future__ import annotations

import ml_collections

from island_jax.hardware import lookup


def plan_inner_steps(config: ml_collections.ConfigDict) -> dict[str, int]:
    """{island name: inner steps per round} for `config.outer.sync` (with "time": the expected steps).

    Raises:
      KeyError: an island names hardware outside the catalog.
    """
    islands = config.islands
    if config.outer.sync in ("steps", "time"):
        return {name: isl.inner_steps for name, isl in islands.items()}
    ref_name = config.outer.reference_island or next(iter(islands.keys()))
    ref = islands[ref_name]
    ref_speed = ref.num_devices * lookup(ref.hardware).peak_tflops
    return {
        name: scaled_inner_steps(ref.inner_steps, isl.num_devices * lookup(isl.hardware).peak_tflops, ref_speed)
        for name, isl in islands.items()
    }


def scaled_inner_steps(h_ref: int, speed: float, ref_speed: float) -> int:
    """max(1, round(h_ref x speed / ref_speed)): the inner steps of an island `speed / ref_speed` times as fast
    as the reference island (speeds in any one unit, e.g. devices x catalog TFLOP/s), so that both finish
    a round together."""
    return max(1, round(h_ref * speed / ref_speed))


def plan_from_step_times(config: ml_collections.ConfigDict, step_seconds: dict[str, float]) -> dict[str, int]:
    """{island: round(H_ref x t_ref / t_island)}: equal wall clock per round from measured step times.

    Args:
      config: the run's config (`outer.reference_island`, the reference's `inner_steps`).
      step_seconds: median seconds per inner step of each island that reported one.
        Islands that did not report keep their catalog plan.

    Raises:
      KeyError: an island names hardware outside the catalog.
    """
    plan = plan_inner_steps(config)
    ref_name = config.outer.reference_island or next(iter(config.islands.keys()))
    if ref_name not in step_seconds:
        return plan
    h_ref, t_ref = config.islands[ref_name].inner_steps, step_seconds[ref_name]
    plan.update({name: scaled_inner_steps(h_ref, 1.0 / t, 1.0 / t_ref) for name, t in step_seconds.items() if t > 0})
    return plan
