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

from island_jax.plan import BACKWARD_FRACTION, CoordinatorSpec, IslandSpec, LinkSpec, ModelSpec, OuterSpec, plan

NO_COORDINATOR = CoordinatorSpec(fixed_ns_per_param=0.0, per_island_ns_per_param=0.0)  # a ring: no merge on a CPU


TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)  # the published tables' columns


@dataclasses.dataclass(frozen=True)
class Case:
    """One published row and the planner's inputs for it.

    Attributes:
      source, row: where it is published, and which row.
      assumptions: the publication's assumptions, as the planner takes them.
      published: Gbit/s per target utilization (`TARGETS`; None: beyond the table's 1000 Gbit/s).
      model, islands, outer, coordinator: the planner's inputs.
      baseline: the row is the data-parallel baseline, not the outer loop.
    """

    source: str
    row: str
    assumptions: str
    published: tuple
    model: ModelSpec
    islands: tuple
    outer: OuterSpec
    coordinator: CoordinatorSpec
    baseline: bool = False

    def planned(self) -> dict:
        """{target: the planner's required Gbit/s} (math.inf where no rate reaches it)."""
        p = plan(self.model, self.islands, self.outer, self.coordinator, targets=TARGETS)
        rates = (p.dp if self.baseline else p).required_gbps
        return {t: math.inf if g is None else g for t, g in rates.items()}


def _workers(k: int, step: float, h: int, rtt_ms: float = 0.0) -> tuple:
    return tuple(IslandSpec(f"w{i}", step_seconds=step, inner_steps=h, link=LinkSpec(1.0, rtt_ms)) for i in range(k))


def _ring(**fields) -> OuterSpec:
    """An all-reduce among the workers, each reduction starting with the backward pass (the simulators')."""
    return OuterSpec(backward_overlap=BACKWARD_FRACTION, topology="ring", **fields)


_STREAMING = dict(source="Streaming DiLoCo, Table 4", model=ModelSpec(1e9, num_layers=24), coordinator=NO_COORDINATOR,
                  islands=_workers(2, 0.1, 100))
_SCALING = dict(source="Scaling Laws for DiLoCo, Table 6", model=ModelSpec(671e9, 37e9, 61), coordinator=NO_COORDINATOR)

PUBLISHED = (
    Case(row="1B, Data-Parallel", published=(86.8, 152.6, 184.2, 222.3, 569.0),
         assumptions="bf16 gradients every 0.1 s step, 2 workers, reduced during the backward pass",
         outer=_ring(bytes_per_param=2.0), baseline=True, **_STREAMING),
    Case(row="1B, DiLoCo", published=(1.4, 6.2, 13.3, 23.3, 86.8),
         assumptions="H=100, F=1, tau=0, bf16, 2 workers, all-reduce from the backward pass",
         outer=_ring(bytes_per_param=2.0), **_STREAMING),
    Case(row="1B, Streaming DiLoCo", published=(1.4, 5.2, 9.1, 16.0, 28.1),
         assumptions="F=8 (3 of 24 layers each), tau=0, bf16", outer=_ring(bytes_per_param=2.0, fragments=8),
         **_STREAMING),
    Case(row="1B, Streaming DiLoCo w/ overlapped com.", published=(1.4, 4.3, 6.2, 9.1, 11.0),
         assumptions="F=8, tau=1, bf16", outer=_ring(bytes_per_param=2.0, fragments=8, overlap_steps=1),
         **_STREAMING),
    Case(row="1B, Streaming DiLoCo w/ overlapped FP4 com.", published=(0.4, 0.9, 1.7, 2.0, 3.0),
         assumptions="F=8, tau=1, FP4 E3M0 (0.5 B/param)",
         outer=_ring(bytes_per_param=0.5, fragments=8, overlap_steps=1), **_STREAMING),
    Case(row="671B MoE, Data-Parallel", published=(323.8, 569.0, 686.6, 686.6, None),
         assumptions="DeepSeek-V3 (37B active), all 671B as bf16 gradients every 20 s step, 2 workers",
         outer=_ring(bytes_per_param=2.0), baseline=True, islands=_workers(2, 20.0, 100), **_SCALING),
    *(
        Case(row=f"671B MoE, DiLoCo H={h}", published=published, islands=_workers(2, 20.0, h),
             assumptions=f"H={h}, F=1, tau=0, all 671B as bf16, 2 workers, all-reduce from the backward pass",
             outer=_ring(bytes_per_param=2.0), **_SCALING)
        for h, published in (
            (10, (49.4, 152.6, 268.3, 390.7, 686.6)), (50, (7.5, 33.9, 72.0, 126.5, 390.7)),
            (100, (4.3, 16.0, 41.0, 72.0, 268.3)), (300, (1.7, 6.2, 13.3, 28.1, 126.5)),
        )
    ),
)

# INTELLECT-1: 14 nodes in a ring of int8 pseudo-gradients (1 B/param; its 256-entry float32 lookup table per
# chunk left out), H = 100 inner steps in 38 minutes, the all-reduce blocking; RTT 100 ms assumed.
INTELLECT = dict(model=ModelSpec(10e9, num_layers=42), islands=_workers(14, 2280.0 / 100, 100, rtt_ms=100.0),
                 outer=OuterSpec(bytes_per_param=1.0, topology="ring", pipeline=False), coordinator=NO_COORDINATOR)
INTELLECT_MEASURED = (("USA", 103.0, 0.957), ("USA and Europe", 382.0, 0.856), ("global", 469.0, 0.830))


def _rate(g: float | None) -> str:
    return "1000+" if g is None or g > 1000 else f"{g:.3g}"


def published_table() -> str:
    """Markdown: each published row, the planner's row, and their ratio per target."""
    head = " | ".join(f"{t:.0%}" for t in TARGETS)
    rows = [f"| source | row | assumptions (the planner's inputs) | | {head} |",
            "|---|---|---|---|" + "---|" * len(TARGETS)]
    for case in PUBLISHED:
        planned = case.planned()
        rows.append(f"| {case.source} | {case.row} | {case.assumptions} | published | "
                    + " | ".join(_rate(g) for g in case.published) + " |")
        rows.append("| | | | planner | " + " | ".join(_rate(planned[t]) for t in TARGETS) + " |")
        rows.append("| | | | planner / published | " + " | ".join(
            "-" if g is None else f"{planned[t] / g:.2f}" for t, g in zip(TARGETS, case.published)) + " |")
    return "\n".join(rows)


def intellect_table() -> str:
    """INTELLECT-1's ring: the planner across its measured bandwidth range, and the rate its measured
    utilizations imply."""
    rows = ["| link Gbit/s | all-reduce s (planner) | compute utilization (planner) |", "|---|---|---|"]
    for gbps in (0.5, 1.0, 2.0, 4.0):
        islands = tuple(dataclasses.replace(i, link=dataclasses.replace(i.link, gbps=gbps)) for i in INTELLECT["islands"])
        p = plan(INTELLECT["model"], islands, INTELLECT["outer"], INTELLECT["coordinator"])
        rows.append(f"| {gbps:g} | {p.islands[0].exposed_seconds:.0f} | {p.compute_utilization:.3f} |")
    rows += ["", "| setting | measured median all-reduce | measured utilization | planner's rate for it |",
             "|---|---|---|---|"]
    for setting, seconds, utilization in INTELLECT_MEASURED:
        p = plan(**INTELLECT, targets=(utilization,))
        rows.append(f"| {setting} | {seconds:.0f} s | {utilization:.1%} | {p.required_gbps[utilization]:.3g} Gbit/s |")
    return "\n".join(rows)


# The seed's setting: one DeepSeek-V3-shaped MoE (671B total, 37B active, 61 layers) on two islands of
# 1024 H100 each, on two continents, 2048 sequences of 4096 tokens per island step at 40% MFU, each on a
# 25 Gbit/s link to the coordinator (16 connections, no window limit), the coordinator's own link 100
# Gbit/s and its merge spread over 512 cores (the cores of docs/cluster.md's 16 coordinator shards of 32).
SEED_MODEL = ModelSpec(671e9, 37e9, 61)
SEED_COORDINATOR = CoordinatorSpec(gbps=100.0, cores=512)


WINDOW = 16 << 20  # bytes: a TCP window of 16 MiB per connection, as WAN-tuned hosts allow


def seed_islands(h: int, rtt_ms: float, gbps: float = 25.0, window_bytes: int = 0) -> tuple:
    return tuple(
        IslandSpec(name, num_devices=1024, hardware="h100", mfu=0.4, batch_size=2048, seq_len=4096, inner_steps=h,
               link=LinkSpec(gbps, rtt_ms, 16, window_bytes))
        for name in ("us", "eu")
    )


def seed_table() -> str:
    """Utilization at 25 Gbit/s and the rate for 95%, by codec (both ways), F, H and RTT."""
    rows = ["| codec | F, tau | H | compute s/round | RTT 100 ms: exposed s, utilization | RTT 200 ms: exposed s, "
            "utilization | RTT 200 ms, 16 MiB windows: utilization | Gbit/s for 95% (RTT 200 ms) |",
            "|---|---|---|---|---|---|---|---|"]
    for kind, update in (("int8", ""), ("int4", ""), ("topk", "int8"), ("topk", "topk")):
        for f, tau in ((1, 0), (4, "auto")):
            for h in (30, 100, 300):
                outer = OuterSpec(codec=kind, update_codec=update, fragments=f, overlap_steps=tau)
                near = plan(SEED_MODEL, seed_islands(h, 100.0), outer, SEED_COORDINATOR)
                far = plan(SEED_MODEL, seed_islands(h, 200.0), outer, SEED_COORDINATOR)
                windowed = plan(SEED_MODEL, seed_islands(h, 200.0, window_bytes=WINDOW), outer, SEED_COORDINATOR)
                need = far.required_gbps[0.95]
                rows.append(
                    f"| {f'{kind} up, {update} down' if update else kind} | F={f}, tau={tau} | {h} | {near.islands[0].compute_seconds:.0f} | "
                    f"{near.islands[0].exposed_seconds:.1f}, {near.compute_utilization:.3f} | "
                    f"{far.islands[0].exposed_seconds:.1f}, {far.compute_utilization:.3f} | "
                    f"{windowed.compute_utilization:.3f} | {'unreachable' if need is None else f'{need:.3g}'} |"
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
    print(plan(SEED_MODEL, seed_islands(100, 200.0), OuterSpec(fragments=4, overlap_steps="auto"), SEED_COORDINATOR))


if __name__ == "__main__":
    app.run(main)
