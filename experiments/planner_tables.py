"""The planner beside published runs, and the seed's own setting: the tables of docs/planner.md.

  python experiments/planner_tables.py

Each published row is given with that publication's assumptions as the
planner's inputs (`PUBLISHED`); the printed tables are markdown.
  Streaming DiLoCo (arXiv 2501.18512), Table 4, 1B: step 0.1 s, H = 100, two
    workers, fragments of 3 of the 24 layers (F = 8), tau = 1, the exchange
    starting with the backward pass, FP4 (E3M0) outer gradients, an all-reduce
    between the workers; data parallel: bf16 gradients every step.
  Scaling Laws for DiLoCo (arXiv 2503.09799), Table 6, DeepSeek-V3 671B
    (37B active, 61 layers): step 20 s, H = 100, all 671B exchanged as bf16,
    two workers, with Streaming DiLoCo's simulator (its reductions start with
    the backward pass).
  INTELLECT-1 (arXiv 2412.01152): 10B (42 layers), 14 nodes of 8 H100 in a
    ring all-reduce of int8 pseudo-gradients, H = 100 inner steps in 38
    minutes, the all-reduce blocking (no overlap); measured 95.7% (USA),
    85.6% (USA and Europe) and 83.0% (global) compute utilization with median
    all-reduces of 103, 382 and 469 s over links of 0.5 to 4 Gbit/s.
"""

from __future__ import annotations

import dataclasses
import math

from absl import app

from island_jax.plan import Coordinator, Island, Link, Model, Outer, plan

NO_COORDINATOR = Coordinator(fixed_ns_per_param=0.0, per_island_ns_per_param=0.0)  # a ring: no merge on a CPU
BACKWARD = 2.0 / 3.0  # the published simulators start each reduction with the backward pass


@dataclasses.dataclass(frozen=True)
class Case:
    """One published figure and the planner's inputs for it.

    Attributes:
      source, row: where it is published, and which row and column.
      assumptions: the publication's assumptions, as the planner takes them.
      published: the published figure (Gbit/s for a required rate; a fraction for a utilization).
      model, islands, outer, coordinator: the planner's inputs.
      target: the utilization the required rate is for.
      baseline: the data-parallel baseline's rate, not the outer loop's.
    """

    source: str
    row: str
    assumptions: str
    published: float
    model: Model
    islands: tuple
    outer: Outer
    coordinator: Coordinator
    target: float
    baseline: bool = False

    def planned(self) -> float:
        """The planner's required Gbit/s for `target` (math.inf where no rate reaches it)."""
        p = plan(self.model, self.islands, self.outer, self.coordinator, targets=(self.target,))
        rate = (p.dp if self.baseline else p).required_gbps[self.target]
        return math.inf if rate is None else rate


def _workers(k: int, step: float, h: int, rtt_ms: float = 0.0) -> tuple:
    return tuple(Island(f"w{i}", step_seconds=step, inner_steps=h, link=Link(1.0, rtt_ms)) for i in range(k))


_STREAMING = dict(
    source="Streaming DiLoCo, Table 4", model=Model(1e9, num_layers=24), islands=_workers(2, 0.1, 100),
    coordinator=NO_COORDINATOR, target=0.95,
)
_SCALING = dict(
    source="Scaling Laws for DiLoCo, Table 6", model=Model(671e9, 37e9, 61), islands=_workers(2, 20.0, 100),
    coordinator=NO_COORDINATOR, target=0.95,
)
_INTELLECT = dict(
    source="INTELLECT-1", model=Model(10e9, num_layers=42), islands=_workers(14, 2280.0 / 100, 100, rtt_ms=100.0),
    coordinator=NO_COORDINATOR,
    outer=Outer(bytes_per_param=1.0, topology="ring", pipeline=False),
)

PUBLISHED = (
    Case(row="1B, Streaming DiLoCo w/ overlapped FP4 com., 95%", published=2.0,
         assumptions="step 0.1 s, H=100, F=8 (3 of 24 layers), tau=1, FP4 (0.5 B/param), 2 workers, "
                     "all-reduce, from the backward pass",
         outer=Outer(bytes_per_param=0.5, fragments=8, overlap_steps=1, backward_overlap=BACKWARD,
                     topology="ring"), **_STREAMING),
    Case(row="1B, Streaming DiLoCo w/ overlapped com., 95%", published=9.1,
         assumptions="as above, bf16 (2 B/param)",
         outer=Outer(bytes_per_param=2.0, fragments=8, overlap_steps=1, backward_overlap=BACKWARD,
                     topology="ring"), **_STREAMING),
    Case(row="1B, Streaming DiLoCo (no overlap), 95%", published=16.0,
         assumptions="F=8, tau=0, bf16, from the backward pass",
         outer=Outer(bytes_per_param=2.0, fragments=8, backward_overlap=BACKWARD, topology="ring"), **_STREAMING),
    Case(row="1B, DiLoCo, 95%", published=23.3, assumptions="H=100, F=1, tau=0, bf16, from the backward pass",
         outer=Outer(bytes_per_param=2.0, backward_overlap=BACKWARD, topology="ring"), **_STREAMING),
    Case(row="1B, Data-Parallel, 95%", published=222.3,
         assumptions="bf16 gradients every 0.1 s step, all-reduce overlapped with the backward pass",
         outer=Outer(bytes_per_param=2.0, backward_overlap=BACKWARD, topology="ring"), baseline=True,
         **_STREAMING),
    Case(row="671B MoE (DeepSeek-V3), DiLoCo H=100, 95%", published=72.0,
         assumptions="step 20 s, H=100, all 671B as bf16, 2 workers, all-reduce, from the backward pass",
         outer=Outer(bytes_per_param=2.0, backward_overlap=BACKWARD, topology="ring"), **_SCALING),
    Case(row="671B MoE (DeepSeek-V3), Data-Parallel, 95%", published=686.6,
         assumptions="bf16 gradients every 20 s step, overlapped with the backward pass",
         outer=Outer(bytes_per_param=2.0, backward_overlap=BACKWARD, topology="ring"), baseline=True, **_SCALING),
    Case(row="10B, USA: 95.7% measured", published=0.957, target=0.957,
         assumptions="14 nodes in a ring, int8 (1 B/param), H=100 in 38 min, blocking all-reduce, RTT 100 ms",
         **_INTELLECT),
    Case(row="10B, global: 83.0% measured", published=0.83, target=0.83,
         assumptions="as above", **_INTELLECT),
)


def published_table() -> str:
    """The markdown table of `PUBLISHED`: assumptions, published figure, planner's figure, ratio."""
    rows = ["| source | row | assumptions (the planner's inputs) | published | planner | planner / published |",
            "|---|---|---|---|---|---|"]
    for case in PUBLISHED:
        planned = case.planned()
        if case.published < 1:  # a measured utilization: the planner gives the rate it needs
            rows.append(f"| {case.source} | {case.row} | {case.assumptions} | {case.published:.1%} at 0.5-4 Gbit/s "
                        f"(median all-reduce) | needs {planned:.3g} Gbit/s | - |")
        else:
            rows.append(f"| {case.source} | {case.row} | {case.assumptions} | {case.published:g} Gbit/s | "
                        f"{planned:.3g} Gbit/s | {planned / case.published:.3f} |")
    return "\n".join(rows)


def intellect_table() -> str:
    """INTELLECT-1's ring at the ends of its measured bandwidth range."""
    rows = ["| link Gbit/s | all-reduce s (planner) | compute utilization (planner) |", "|---|---|---|"]
    case = PUBLISHED[-1]
    for gbps in (0.5, 1.0, 2.0, 4.0):
        islands = tuple(dataclasses.replace(i, link=dataclasses.replace(i.link, gbps=gbps)) for i in case.islands)
        p = plan(case.model, islands, case.outer, case.coordinator)
        rows.append(f"| {gbps:g} | {p.islands[0].exposed_seconds:.0f} | {p.compute_utilization:.3f} |")
    return "\n".join(rows)


# The seed's setting: one DeepSeek-V3-shaped MoE (671B total, 37B active, 61 layers) on two islands of
# 1024 H100 each, on two continents, 2048 sequences of 4096 tokens per island step at 40% MFU, each on a
# 25 Gbit/s link to the coordinator (16 connections, no window limit), the coordinator's own link 100
# Gbit/s and its merge spread over 512 cores (a coordinator sharded by chunk range over 8 hosts).
SEED_MODEL = Model(671e9, 37e9, 61)
SEED_COORDINATOR = Coordinator(gbps=100.0, cores=512)


def seed_islands(h: int, rtt_ms: float, gbps: float = 25.0) -> tuple:
    return tuple(
        Island(name, num_devices=1024, hardware="h100", mfu=0.4, batch_size=2048, seq_len=4096, inner_steps=h,
               link=Link(gbps, rtt_ms, 16, 0))
        for name in ("us", "eu")
    )


def seed_table() -> str:
    """Utilization at 25 Gbit/s and the rate for 95%, by codec, F, H and RTT."""
    rows = ["| codec | F, tau | H | round compute s | exposed s (100 ms) | utilization (100 ms) | exposed s (200 ms) "
            "| utilization (200 ms) | Gbit/s for 95% (200 ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("int8", "int4"):
        for f, tau in ((1, 0), (4, "auto")):
            for h in (30, 100, 300):
                outer = Outer(codec=kind, fragments=f, overlap_steps=tau)
                near = plan(SEED_MODEL, seed_islands(h, 100.0), outer, SEED_COORDINATOR)
                far = plan(SEED_MODEL, seed_islands(h, 200.0), outer, SEED_COORDINATOR)
                need = far.required_gbps[0.95]
                rows.append(
                    f"| {kind} | F={f}, tau={tau} | {h} | {near.islands[0].compute_seconds:.0f} | "
                    f"{near.islands[0].exposed_seconds:.1f} | {near.compute_utilization:.3f} | "
                    f"{far.islands[0].exposed_seconds:.1f} | {far.compute_utilization:.3f} | "
                    f"{'unreachable' if need is None else f'{need:.3g}'} |"
                )
    return "\n".join(rows)


def main(argv):
    del argv
    print("## Beside published runs\n")
    print(published_table())
    print("\n## INTELLECT-1's ring across its bandwidth range\n")
    print(intellect_table())
    print("\n## The seed's setting\n")
    print(seed_table())
    print("\nOne plan of the seed's setting (int8, F=4, tau=auto, H=100, RTT 200 ms):\n")
    print(plan(SEED_MODEL, seed_islands(100, 200.0), Outer(fragments=4, overlap_steps="auto"), SEED_COORDINATOR))


if __name__ == "__main__":
    app.run(main)
