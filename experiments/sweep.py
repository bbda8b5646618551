"""Runs a sweep over a grid of config overrides and seeds, and prints one row per variant.

  python experiments/sweep.py --config=CONFIG.py --workdir=DIR \\
      --sweep=codec.kind=int8,int4 --sweep=outer.rounds=2,4 --seeds=0,1 --max_parallel=2

Every combination of the `--sweep` values times `--seeds` is a variant, run in
a process of its own in DIR/<variant name> (`island_jax.experiment.sweep`);
running the same command again reads finished variants back and resumes
unfinished ones. Values are parsed to the type of the config field they set
(bool: true/false; int; float; str as given). `--config.a.b=v` overrides the
base config as in train.py. Needs pandas and tqdm (`pip install island_jax[notebook]`).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).")
_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's folder: one subfolder per variant.")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,...: a dotted config path and its values (repeatable).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds of every combination, e.g. 0,1.")
_MAX_PARALLEL = flags.DEFINE_integer("max_parallel", 1, "Variants running at once.")
flags.mark_flags_as_required(["config", "workdir"])


def parse_grid(config, specs: list[str]) -> dict:
    """{key: [values]} from `KEY=V1,V2` strings.

    Raises:
      app.UsageError: a spec without `=` or values, or a key given twice.
      ConfigError: a key that names no field, or a value not of its field's type.
    """
    from island_jax import experiment

    grid = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not values:
            raise app.UsageError(f"--sweep={spec}: use KEY=V1,V2,...")
        if key in grid:
            raise app.UsageError(f"--sweep: {key} is given twice; list all its values in one --sweep")
        grid[key] = [experiment.parse_override(config, key, v) for v in values.split(",")]
    return grid


def main(argv):
    del argv
    import pandas as pd

    from island_jax import experiment
    from island_jax.config import ConfigError

    try:
        grid = parse_grid(_CONFIG.value, _SWEEP.value)
        seeds = [int(s) for s in _SEEDS.value]
        rows = experiment.sweep(_CONFIG.value, grid, _WORKDIR.value, seeds=seeds, max_parallel=_MAX_PARALLEL.value)
    except (ConfigError, ValueError) as e:
        sys.exit(str(e))
    with pd.option_context("display.max_columns", None, "display.width", 200, "display.max_colwidth", 80):
        print(rows.drop(columns=["workdir"]).to_string())
    if rows["error"].notna().any():
        sys.exit(1)


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
