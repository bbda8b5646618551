"""The outer step's sweep: outer lr x M x H (x the momentum warm-up) against data parallel, with paired seeds.

  python experiments/outer_sweep.py --workdir=/tmp/outer_sweep --m=1,2 --h=25 \\
      --lr=0.2,0.4,0.6,0.8,1.0 --warmup=0,20 --seeds=0,1,2

Every point is `experiments/configs/diloco_m.py:M,H` with `outer.learning_rate` and
`outer.momentum_warmup_rounds` set (Nesterov, momentum 0.9), run through
`island_jax.experiment.sweep` in WORKDIR/m{M}_h{H}; each seed's `baseline_dp` runs first, in
WORKDIR/baseline_dp, so that every DiLoCo point has its data-parallel pair (same seed: the same
initial parameters; the same held-out windows). Points run seed by seed, then in the order of the flags.
`--warmup` counts rounds: the same share of the run at another H is 20 x 25 / H (10 at H = 50).

Each finished run appends a row to `--table` (CSV, committed: experiments/notebooks/outer_sweep.csv):
`run` ("baseline_dp" or "diloco"), `m`, `h` (1 and 25 on every `baseline_dp` row, which has no rounds:
DiLoCo rows of any H pair with it), `outer_lr`, `warmup_rounds`, `seed`, `eval_loss_final`
(nats per byte), `eval_loss_final_stderr` (over the held-out windows), `eval_windows_sha256`,
`wall_seconds`, `cpu` (the CPU model: final losses differ between CPU models, so a DiLoCo row is paired
with the `baseline_dp` row of its seed on its CPU), `param_norm_final` (the L2 norm of all the final global
parameters, `param_norm`). A point already in the table is skipped (a
`baseline_dp` row only on the same CPU), so the command resumes across machines and days. Only the
final evaluation runs (`eval.every_rounds` = the rounds): the same windows and figure as every 10 rounds.

  python experiments/outer_sweep.py --summary

prints each point's mean over seeds and its paired difference to `baseline_dp` (`experiment.paired_difference`).
Needs pandas and tqdm (`pip install island_jax[notebook]`).
"""

import csv
import os

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's folder: one subfolder per run.")
_TABLE = flags.DEFINE_string("table", "experiments/notebooks/outer_sweep.csv", "CSV the finished runs go to.")
_M = flags.DEFINE_list("m", ["1", "2"], "Numbers of islands (1, 2, 4).")
_H = flags.DEFINE_list("h", ["25"], "Inner steps per round.")
_LR = flags.DEFINE_list("lr", ["0.2", "0.4", "0.6", "0.8", "1.0"], "Outer learning rates.")
_WARMUP = flags.DEFINE_list("warmup", ["0"], "Outer momentum warm-up, in rounds.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds, run one after the other.")
_SUMMARY = flags.DEFINE_bool("summary", False, "Print the table's points against baseline_dp (paired by seed and CPU) "
                             "and run nothing.")

COLUMNS = ("run", "m", "h", "outer_lr", "warmup_rounds", "seed", "eval_loss_final", "eval_loss_final_stderr",
           "eval_windows_sha256", "wall_seconds", "cpu", "param_norm_final")


def key(row: dict) -> tuple:
    """What identifies a run in the table: a baseline_dp run by seed and CPU, a DiLoCo run by its point and seed."""
    if row["run"] == "baseline_dp":
        return ("baseline_dp", int(row["seed"]), row["cpu"])
    return ("diloco", int(row["m"]), int(row["h"]), float(row["outer_lr"]), int(row["warmup_rounds"]),
            int(row["seed"]))


def param_norm(workdir: str) -> float:
    """The L2 norm over every element of a finished run's final global parameters (island a's last checkpoint,
    `model.load.from_workdir`), in float64."""
    import jax
    import numpy as np

    from island_jax.model.load import from_workdir

    _, params, _ = from_workdir(workdir)
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(params))))


def read_table(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def append_row(path: str, row: dict) -> None:
    new = not os.path.exists(path)
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def summary(path: str):
    """The table's DiLoCo points against `baseline_dp`, paired by seed and CPU (`experiment.paired_difference`),
    one row per (m, h, warmup_rounds, outer_lr)."""
    import pandas as pd

    from island_jax import experiment

    table = pd.read_csv(path)
    diloco = table[table["run"] == "diloco"].astype({"warmup_rounds": int})
    dp = table[table["run"] == "baseline_dp"]
    return experiment.paired_difference(diloco, dp, ["m", "h", "warmup_rounds", "outer_lr"], on=("seed", "cpu"))


def run_one(config, grid: dict, folder: str, seed: int, row: dict, table: str) -> None:
    """Runs one variant through `experiment.sweep` and appends its row to `table`."""
    from island_jax import experiment

    config.eval.every_rounds = config.outer.rounds  # the final evaluation only (and round 0's)
    rows = experiment.sweep(config, grid, folder, seeds=[seed])
    result = rows.iloc[0]
    if result["error"] is not None:
        raise SystemExit(f"{row}: {result['error']}")
    figures = experiment.Result.load(result["workdir"]).summary.iloc[0]
    append_row(table, {**row, "eval_loss_final": repr(float(figures["eval_loss_final"])),
                       "eval_loss_final_stderr": repr(float(figures["eval_loss_final_stderr"])),
                       "eval_windows_sha256": figures["eval_windows_sha256"],
                       "wall_seconds": f"{figures['wall_seconds']:.1f}",
                       "param_norm_final": f"{param_norm(result['workdir']):.4f}"})
    print(f"{row} -> {figures['eval_loss_final']:.6f}", flush=True)


def main(argv):
    del argv
    from island_jax.config import load_config
    from island_jax.provenance import cpu_model

    if _SUMMARY.value:
        print(summary(_TABLE.value).round(4).to_string(index=False))
        return
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required to run the sweep")

    cpu = cpu_model()
    done = {key(r) for r in read_table(_TABLE.value)}
    for seed in (int(s) for s in _SEEDS.value):
        row = dict(run="baseline_dp", m=1, h=25, outer_lr="", warmup_rounds="", seed=seed, cpu=cpu)
        if key(row) not in done:
            run_one(load_config("experiments/configs/baseline_dp.py"), {}, os.path.join(_WORKDIR.value, "baseline_dp"),
                    seed, row, _TABLE.value)
        for m in (int(v) for v in _M.value):
            for h in (int(v) for v in _H.value):
                for warmup in (int(v) for v in _WARMUP.value):
                    for lr in (float(v) for v in _LR.value):
                        row = dict(run="diloco", m=m, h=h, outer_lr=lr, warmup_rounds=warmup, seed=seed, cpu=cpu)
                        if key(row) in done:
                            continue
                        grid = {"outer.learning_rate": [lr], "outer.momentum_warmup_rounds": [warmup]}
                        run_one(load_config(f"experiments/configs/diloco_m.py:{m},{h}"), grid,
                                os.path.join(_WORKDIR.value, f"m{m}_h{h}"), seed, row, _TABLE.value)


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
