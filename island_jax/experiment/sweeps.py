"""A sweep: every combination of a grid of overrides (dotted config paths) times seeds, one `run` and workdir per
variant, tabulated one row per variant (`sweep`), the rows' mean over seeds (`over_seeds`), and groups against a baseline with
paired seeds (`paired_difference`)."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import queue
import re
import subprocess
from collections.abc import Sequence
from typing import Any

import ml_collections

from island_jax import config as config_lib
from island_jax.experiment.runner import ExperimentError, kill_running, run

# The columns of a sweep's rows after the grid keys and `seed`.
ROW_COLUMNS = ("eval_loss_final", "eval_bits_per_byte_final", "wall_seconds", "bytes_per_round", "error")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One point of a sweep: `overrides` ({grid key: value}, in grid order) and `seed`."""

    overrides: tuple[tuple[str, Any], ...]
    seed: int

    def describe(self) -> str:
        """E.g. `codec.kind=int4, seed=1`."""
        return ", ".join([*(f"{k}={v}" for k, v in self.overrides), f"seed={self.seed}"])

    @property
    def name(self) -> str:
        """A stable, filesystem-safe folder name, e.g. `codec.kind=int4,seed=1`. Characters other than
        letters, digits and `._=,+-` become `_`; then (or past 120 characters) a hash of the exact overrides
        is appended, so that different variants never share a folder."""
        raw = ",".join([*(f"{k}={v}" for k, v in self.overrides), f"seed={self.seed}"])
        safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", raw)
        if safe != raw or len(safe) > 120:
            digest = hashlib.sha1(json.dumps([self.overrides, self.seed], default=repr).encode()).hexdigest()[:10]
            safe = f"{safe[:100]}-{digest}"
        return safe

    def config(self, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `base` with the overrides and seed applied and validated.

        Raises:
          ConfigError: naming the variant and the invalid key.
        """
        config = copy.deepcopy(base)
        try:
            for key, value in self.overrides:
                config_lib.apply_override(config, key, value)
            config.seed = self.seed
            config_lib.validate(config)
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"variant {self.describe()}: {e.args[0]}") from e
        return config


def grid_keys(grid: dict) -> list[str]:
    """The config keys a grid sets, in order: a tuple key (keys set together) contributes each of its keys."""
    return [k for key in grid for k in (key if isinstance(key, tuple) else (key,))]


def variants(grid: dict, seeds: Sequence[int] = (0,)) -> list[Variant]:
    """Every combination of the grid's values (in the grid's key order, the last key varying fastest) times seeds.

    A key is a dotted config path with a list of values, or a tuple of paths
    whose values are tuples set together (not combined), e.g.
    `{("outer.inner_steps", "outer.rounds"): [(5, 60), (25, 12)]}` for H at equal steps.

    Raises:
      ValueError: "seed" is a grid key (pass `seeds`), a field is set by two keys, a key has no
        values, a tuple key's value has another length, or no seeds are given.
    """
    if "seed" in grid_keys(grid):
        raise ValueError("pass seeds with seeds=..., not as the grid key 'seed'")
    keys = grid_keys(grid)
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"grid keys {twice} are set more than once (directly or in a tuple key); set each once")
    for key, values in grid.items():
        if len(values) == 0:
            raise ValueError(f"grid key {key} has no values")
        if isinstance(key, tuple):
            for value in values:
                if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(key):
                    raise ValueError(f"grid key {key} sets {len(key)} fields together; {value!r} is not {len(key)} values")
    if len(seeds) == 0:
        raise ValueError("seeds is empty; pass at least one seed")

    def pairs(key, value):
        return tuple(zip(key, value)) if isinstance(key, tuple) else ((key, value),)

    keys = list(grid)
    return [
        Variant(tuple(p for key, value in zip(keys, combo) for p in pairs(key, value)), int(seed))
        for combo in itertools.product(*(grid[k] for k in keys))
        for seed in seeds
    ]


def sweep(
    base_config: ml_collections.ConfigDict,
    grid: dict,
    workdir: str,
    seeds: Sequence[int] = (0,),
    max_parallel: int = 1,
    timeout: float | None = None,
):
    """Runs every combination of `grid` times `seeds`, each in its own process and folder, and tabulates them.

    Every variant's config (a copy of `base_config` with its overrides and
    `seed`) is built and validated before anything runs. Variant V runs with
    `run` in `WORKDIR/<V.name>`: one whose folder holds a finished run is read
    back (no process starts), an unfinished one resumes from its checkpoints.
    A variant that fails while running gets a row with its `error` and the
    others still run. Running variants `max_parallel` at a time changes
    nothing in their results (each run is deterministic on its own devices),
    only the wall-clock time. A `tqdm.auto` bar counts the variants done, and
    one bar under it per running variant counts that variant's rounds.

    Args:
      base_config: the config every variant starts from (not changed).
      grid: {dotted config path: values}, e.g. {"codec.kind": ["int8", "int4"]};
        `islands.*.FIELD` sets FIELD of every island, and a tuple of
        paths with tuples of values sets those fields together (`variants`).
      workdir: the sweep's folder (created); one subfolder per variant.
      seeds: values of `seed` (parameter initialisation and data order) per combination.
      max_parallel: variants running at once (each in a process with the devices it needs).
      timeout: seconds one variant's process may run; None for no limit.

    Returns:
      A pandas DataFrame, one row per variant in `variants` order: the grid keys (`grid_keys`),
      `seed`, `eval_loss_final` (nats per byte; per token on prepared records), `eval_bits_per_byte_final` (bits
      per byte of the held-out text, `data.bits_per_byte`: runs of different tokenizers compare by it),
      `wall_seconds` (the run's, seconds; of its last part when it was resumed), `bytes_per_round` (mean bytes
      an island sent per round), `error` (None, or why the run failed; then the others are NaN), and
      `workdir` (the variant's folder).

    Raises:
      ConfigError: a variant's config is invalid; the message names the variant and the key.
      ValueError: `max_parallel` below 1, or a grid `variants` refuses (an empty value list or
        seeds, "seed" as a grid key, a field set twice, a tuple value of the wrong length).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if max_parallel < 1:
        raise ValueError(f"max_parallel is {max_parallel}; use 1 or more")
    points = variants(grid, seeds)
    configs = [v.config(base_config) for v in points]  # every ConfigError before anything runs
    os.makedirs(workdir, exist_ok=True)
    rows: list[dict | None] = [None] * len(points)

    lines = queue.SimpleQueue()  # the bar lines under the sweep's bar free for a running variant's rounds
    for line in range(1, max_parallel + 1):
        lines.put(line)

    def one(i: int) -> dict:
        folder = os.path.join(workdir, points[i].name)
        row = {**dict(points[i].overrides), "seed": points[i].seed}
        line = lines.get()
        try:
            result = run(configs[i], folder, timeout=timeout, position=line)
        except (ExperimentError, config_lib.ConfigChangeError, FileExistsError, subprocess.TimeoutExpired, OSError) as e:
            return {**row, **{k: math.nan for k in ROW_COLUMNS[:-1]}, "error": str(e), "workdir": folder}
        finally:
            lines.put(line)
        summary = result.summary.iloc[0]
        return {
            **row,
            "eval_loss_final": _float(summary.get("eval_loss_final")),
            "eval_bits_per_byte_final": _float(summary.get("eval_bits_per_byte_final")),
            "wall_seconds": _float(summary.get("wall_seconds")),
            "bytes_per_round": result.bytes_per_round,
            "error": None,
            "workdir": folder,
        }

    with tqdm(total=len(points), desc="sweep", unit="variant") as bar:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_parallel)
        try:
            futures = {pool.submit(one, i): i for i in range(len(points))}
            for future in concurrent.futures.as_completed(futures):
                rows[futures[future]] = future.result()
                bar.update(1)
        except BaseException:  # an interrupt (a notebook's stop button): no variant starts, the running stop
            pool.shutdown(wait=False, cancel_futures=True)
            kill_running()
            raise
        pool.shutdown()
    table = pd.DataFrame(rows, columns=[*grid_keys(grid), "seed", *ROW_COLUMNS, "workdir"])
    table["error"] = pd.Series([r["error"] for r in rows], dtype=object)  # None, not NaN, when fine
    return table


def over_seeds(rows, by: Sequence[str], value: str = "eval_loss_final"):
    """Mean, standard deviation (ddof 1; NaN for one seed) and seed count of `value` per group of a sweep's rows.

    Args:
      rows: a `sweep` DataFrame (rows with an `error` are left out).
      by: the columns that make a group (e.g. the grid keys).
      value: the column to aggregate.

    Returns:
      A DataFrame, one row per group in order of first appearance: `by`, then `mean`, `std`, `seeds`.
    """
    ok = rows[rows["error"].isna()] if "error" in rows else rows
    groups = ok.groupby(list(by), sort=False, dropna=False)[value]
    return groups.agg(mean="mean", std="std", seeds="count").reset_index()


def paired_difference(rows, baseline, by: Sequence[str], on: Sequence[str] = ("seed",),
                      value: str = "eval_loss_final"):
    """Each group of `rows` against `baseline` with paired seeds: the relative difference per pair, its mean and
    standard error over pairs (Student's paired design: the pairs share `on`, e.g. the seed, so their common
    part cancels).

    Args:
      rows: runs (a DataFrame with the `by` and `on` columns and `value`); rows with an `error` are left out.
      baseline: the runs compared against, one per value of `on` (e.g. data parallel, one run per seed).
      by: the columns that make a group (e.g. M and the outer learning rate).
      on: the columns a run and its baseline share; a run without a baseline is left out.
      value: the column compared (lower is better, e.g. the final eval loss).

    Returns:
      A DataFrame, one row per group in order of first appearance: `by`, `mean` and `std` (ddof 1; NaN for one
      pair) of `value`, `seeds` (pairs), `baseline_mean` (of the paired baselines), `diff_pct` (the mean over
      pairs of 100 x (value / baseline - 1), in %) and `diff_pct_stderr` (its standard error: the pairs'
      standard deviation / sqrt(pairs); NaN for one pair).

    Raises:
      ValueError: `baseline` holds two runs with the same `on`.
    """
    import pandas as pd

    ok = rows[rows["error"].isna()] if "error" in rows else rows
    base = baseline[baseline["error"].isna()] if "error" in baseline else baseline
    if base.duplicated(list(on)).any():
        raise ValueError(f"baseline holds two runs with the same {list(on)}; keep one per pair")
    merged = ok.merge(base[[*on, value]].rename(columns={value: "_baseline"}), on=list(on), how="inner")
    merged["_diff"] = 100.0 * (merged[value] / merged["_baseline"] - 1.0)
    groups = merged.groupby(list(by), sort=False, dropna=False)
    out = groups.agg(mean=(value, "mean"), std=(value, "std"), seeds=(value, "count"),
                     baseline_mean=("_baseline", "mean"), diff_pct=("_diff", "mean"), _sd=("_diff", "std"))
    out["diff_pct_stderr"] = out["_sd"] / out["seeds"] ** 0.5
    return pd.DataFrame(out.drop(columns="_sd")).reset_index()


def _float(value) -> float:
    return math.nan if value is None else float(value)
