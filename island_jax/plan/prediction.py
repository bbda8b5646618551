"""A finished run's compute utilization per island, predicted by `plan` from its recorded step times and
link settings, beside what its accounting measured (`predict`)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import ml_collections

from island_jax.plan.inputs import from_config
from island_jax.plan.planner import Plan, plan


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
      fragment_overhead_seconds: training-thread seconds per fragment exchanged, for the plan (`OuterSpec`).

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
