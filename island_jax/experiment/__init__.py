"""Runs and sweeps from Python (a notebook, a script): `run(config, workdir)` and `sweep(base, grid, workdir)`.

  runner     `run`: one config trained in a process of its own (`python -m island_jax.experiment _run
             WORKDIR`), resumed from its checkpoints or read back when finished
  result     `Result`: what a finished run wrote, as pandas DataFrames
  sweeps     `sweep`: every combination of a grid of overrides times seeds, one row per variant;
             `over_seeds`: the mean and spread over seeds; `paired_difference`: against a baseline, paired seeds

`load_config`, `apply_override` and `parse_override` live in island_jax.config (config/overrides.py) and are
exported here too, for notebooks.

pandas and tqdm are needed here (`pip install island_jax[notebook]`).
"""

from island_jax.config import apply_override, load_config, parse_override
from island_jax.config.overrides import REPO_ROOT
from island_jax.experiment.result import Result
from island_jax.experiment.runner import (
    LOG_FILE,
    POLL_SECONDS,
    STDERR_TAIL_LINES,
    VARIANT_FILE,
    ExperimentError,
    kill_running,
    run,
)
from island_jax.experiment.sweeps import (
    ROW_COLUMNS,
    Variant,
    grid_keys,
    over_seeds,
    paired_difference,
    sweep,
    variants,
)

__all__ = [
    "LOG_FILE", "POLL_SECONDS", "REPO_ROOT", "ROW_COLUMNS", "STDERR_TAIL_LINES", "VARIANT_FILE", "ExperimentError",
    "Result", "Variant", "apply_override", "grid_keys", "kill_running", "load_config", "over_seeds",
    "paired_difference", "parse_override", "run", "sweep", "variants",
]
