"""Runs and sweeps from Python (a notebook, a script): `run(config, workdir)` and `sweep(base, grid, workdir)`.

Each run trains in a process of its own (`python -m island_jax.experiment _run
WORKDIR`, every role of the run in that process, as `run_in_process`), so that
JAX there gets exactly the virtual CPU devices the config asks for and a failed
or stopped run leaves the caller untouched. The config travels as
`WORKDIR/variant.json` (`ConfigDict.to_json_best_effort`); what the run writes
is the usual workdir (`island_jax.workdir`), and `Result` reads it back as
pandas DataFrames. A run stopped halfway resumes from its checkpoints when run
again with the same workdir; a finished one is read back, not run again.

`sweep` runs every combination of a grid of overrides (dotted config paths)
times seeds, one workdir per variant, and returns one row per variant.
pandas and tqdm are needed here (`pip install island_jax[notebook]`).
"""

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
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import ml_collections

from island_jax import config as config_lib

VARIANT_FILE = "variant.json"  # the config a run's process trains, in its workdir
LOG_FILE = "run.log"  # the run process's stdout and stderr (absl logs), in its workdir
STDERR_TAIL_LINES = 20  # lines of a failed run's log its error quotes

# The columns of a sweep's rows after the grid keys and `seed`.
ROW_COLUMNS = ("eval_loss_final", "eval_bits_per_byte_final", "wall_seconds", "bytes_per_round", "error")

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = _PACKAGE_ROOT  # the folder island_jax sits in (a clone's root with `pip install -e .`)


class ExperimentError(RuntimeError):
    """A run's process failed; the message names its workdir and quotes the end of its log.

    Attributes:
      workdir: the run's folder.
      returncode: the process's exit status.
      tail: the last `STDERR_TAIL_LINES` lines of its stdout and stderr (`WORKDIR/run.log`).
    """

    def __init__(self, workdir: str, returncode: int, tail: str):
        self.workdir, self.returncode, self.tail = workdir, returncode, tail
        super().__init__(f"the run in {workdir} failed (exit status {returncode}); the end of its log:\n{tail}")


@dataclasses.dataclass
class Result:
    """What a finished run wrote, as pandas DataFrames (`Result.load`).

    Attributes:
      workdir: the run's folder.
      summary: one row, `WORKDIR/summary.json` with nested dicts flattened with dots
        (e.g. `islands.a.bytes_sent`); losses in nats per byte (per token on prepared records), times in seconds,
        bytes in bytes.
      rounds: one row per round record (kind "round") of the coordinator and every island,
        `role` ("coordinator" or "island"), `island` (the island's name; None for the
        coordinator), then the record's fields flattened with dots (e.g. `weights.a`).
        A round logged twice (a resumed run trains it again) appears once, with its latest record.
      steps: one row per inner-step record (kind "inner") of every island, with an `island`
        column; a step logged twice appears once, with its latest record.
    """

    workdir: str
    summary: Any  # pandas.DataFrame
    rounds: Any  # pandas.DataFrame
    steps: Any  # pandas.DataFrame

    @classmethod
    def load(cls, workdir: str) -> Result:
        """Reads a finished run's workdir.

        Raises:
          FileNotFoundError: `WORKDIR/summary.json` is missing (the run did not finish).
        """
        import pandas as pd

        from island_jax.metrics import read_jsonl
        from island_jax.workdir import coordinator_dir, island_dir

        with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
            summary = pd.json_normalize(json.load(f), sep=".")
        rounds, steps = [], []
        coordinator = os.path.join(coordinator_dir(workdir), "metrics.jsonl")
        if os.path.exists(coordinator):
            rounds += _latest(
                [dict(role="coordinator", island=None, **r) for r in read_jsonl(coordinator) if r.get("kind") == "round"],
                "round",
            )
        islands = os.path.join(workdir, "islands")
        for name in sorted(os.listdir(islands)) if os.path.isdir(islands) else []:
            path = os.path.join(island_dir(workdir, name), "metrics.jsonl")
            if not os.path.exists(path):
                continue
            records = read_jsonl(path)
            rounds += _latest([dict(role="island", island=name, **r) for r in records if r.get("kind") == "round"], "round")
            steps += _latest([dict(island=name, **r) for r in records if r.get("kind") == "inner"], "step")
        return cls(workdir, summary, pd.json_normalize(rounds, sep="."), pd.json_normalize(steps, sep="."))

    def sample(self, prompt: str = "\n", max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, num_samples: int = 1, round: int | None = None) -> list[str]:
        """Text the run's model writes after `prompt`: `island_jax.sample.continue_text` (the run's tokenizer,
        as `python -m island_jax.sample`) on the global parameters of the checkpoint of `round` (None: the
        newest), in this process, on its first device.

        Args:
          prompt: the text to continue (encoded with the run's tokenizer: `sample.run_tokenizer`).
          max_new_tokens: tokens to generate; with the prompt's, at most `model.seq_len`.
          temperature, top_k, top_p, seed, num_samples: as `sample.generate`.
          round: completed rounds of a kept checkpoint; None: the newest.

        Returns:
          `num_samples` continuations as text, the prompt left out (`sample.Continuation.new_text`: the
          tokenizer's decoding of the prompt's ids and the new ones together, past the prompt's text).

        Raises:
          FileNotFoundError, model.load.LoadError: no checkpoint (of `round`) to read.
          sample.SampleError: an empty prompt, too many positions, bad settings, or no readable tokenizer.
        """
        from island_jax import sample
        from island_jax.model import load

        config, params, _ = load.from_workdir(self.workdir, round)
        samples = sample.continue_text(config, params, prompt, None, max_new_tokens, temperature, top_k, top_p,
                                       seed, num_samples)
        return [s.new_text for s in samples]

    @property
    def bytes_per_round(self) -> float:
        """Mean bytes an island sent per round (its round records' `bytes_sent`); NaN without any."""
        if "bytes_sent" not in self.rounds:
            return math.nan
        sent = self.rounds.loc[self.rounds["role"] == "island", "bytes_sent"]
        return float(sent.mean()) if len(sent) else math.nan


def load_config(path: str) -> ml_collections.ConfigDict:
    """The config of an experiment file's `get_config()` (e.g. "experiments/configs/two_islands.py").

    A relative path is looked up from the working directory, then from the
    repository this package sits in, so a notebook finds the configs from any folder.

    Raises:
      FileNotFoundError: no such file in either place.
      AttributeError: the file defines no `get_config`.
    """
    import importlib.util

    found = next((p for p in (path, os.path.join(_PACKAGE_ROOT, path)) if os.path.isfile(p)), None)
    if found is None:
        raise FileNotFoundError(f"no config file {path} (looked in {os.getcwd()} and {_PACKAGE_ROOT})")
    spec = importlib.util.spec_from_file_location(f"_island_jax_config_{abs(hash(found))}", found)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{found} defines no get_config(); an experiment config file returns its config from it")
    return module.get_config()


def _latest(records: list[dict], key: str) -> list[dict]:
    """Records with one per `key` value (the latest logged), in order of that value."""
    by_key = {r[key]: r for r in records}
    return [by_key[k] for k in sorted(by_key)]


def run(
    config: ml_collections.ConfigDict, workdir: str, timeout: float | None = None,
    progress: bool = True, position: int = 0, allow_config_change: bool = False,
) -> Result:
    """Trains `config` in a process of its own, with every role of the run in it, and reads back what it wrote.

    The config is written to `WORKDIR/variant.json` and the process
    (`python -m island_jax.experiment _run WORKDIR`) gets one virtual CPU
    device per device the islands need; its output goes to `WORKDIR/run.log`.
    An unfinished run of the same config in `workdir` resumes from its
    checkpoints (the fields of `config.RESUME_MAY_CHANGE` may differ); one
    of another config is refused as the launcher refuses it, with the same
    message, unless `allow_config_change`. A finished run of the same config
    is read back without running anything. While it
    runs, a `tqdm.auto` bar counts its rounds (read from the islands'
    metrics.jsonl, as the launcher's progress lines are).

    Args:
      config: the run's config (see `island_jax.config`).
      workdir: the run's folder (created).
      timeout: seconds the process may run; None for no limit.
      progress: show the bar over rounds (needs tqdm); False for none.
      position: the bar's line (`tqdm`'s position), for bars of runs side by side.
      allow_config_change: resume an unfinished run under a changed config, recording the change in
        every role's folder (`workdir.open_role`).

    Returns:
      The run's `Result`.

    Raises:
      ConfigError: an invalid config (checked here, before the process starts).
      ConfigChangeError: `workdir` holds an unfinished run of another config (without `allow_config_change`).
      FileExistsError: `workdir` holds a finished run of another config.
      ExperimentError: the process failed; the message names `workdir` and quotes the end of its log.
      subprocess.TimeoutExpired: it ran past `timeout` (it is killed).
    """
    config_lib.validate(config)
    os.makedirs(workdir, exist_ok=True)
    text = config.to_json_best_effort(indent=2, sort_keys=True)
    variant = os.path.join(workdir, VARIANT_FILE)
    if os.path.exists(os.path.join(workdir, "summary.json")):
        if os.path.exists(variant) and not _changes(variant, config):  # only fields that may change on resume
            return Result.load(workdir)
        raise FileExistsError(
            f"{workdir} holds a finished run of another config (or of one not started by island_jax.experiment); "
            "pass a new workdir, or move that one away first"
        )
    from island_jax.workdir import check_resume

    check_resume(config, workdir, allow_config_change)  # as the launcher and every role check it
    with open(variant, "w", encoding="utf-8") as f:
        f.write(text)
    log = os.path.join(workdir, LOG_FILE)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "island_jax.experiment", "_run", os.path.abspath(workdir),
             *(["--allow_config_change"] if allow_config_change else [])],
            stdout=out, stderr=subprocess.STDOUT, env=_child_env(),
        )
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            returncode = _wait(proc, config, workdir, timeout, progress, position)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
            if proc.poll() is None:  # a timeout, or the caller interrupted (a notebook's stop button)
                proc.kill()
                proc.wait()
    if returncode != 0:
        raise ExperimentError(workdir, returncode, _tail(log, STDERR_TAIL_LINES))
    return Result.load(workdir)


POLL_SECONDS = 0.5  # how often `run` looks at its process and the islands' metrics
_RUNNING: set = set()  # the run processes of this process's `run` calls, killed when a sweep is interrupted
_RUNNING_LOCK = threading.Lock()


def _wait(proc: subprocess.Popen, config, workdir: str, timeout, progress: bool, position: int) -> int:
    """Waits for the run's process, moving a bar over its rounds; its exit status.

    Raises:
      subprocess.TimeoutExpired: it ran past `timeout` seconds.
    """
    import time

    from island_jax.progress import Progress

    deadline = None if timeout is None else time.monotonic() + timeout
    rounds = bar = None
    if progress:
        from tqdm.auto import tqdm

        rounds = Progress(workdir, list(config.islands.keys()), config.outer.rounds)
        bar = tqdm(
            total=config.outer.rounds, desc=os.path.basename(os.path.normpath(workdir)), unit="round",
            position=position, leave=False,
        )
    try:
        while True:
            try:
                returncode = proc.wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                returncode = None
            if bar is not None and rounds.poll():
                bar.update(rounds.next_round - 1 - bar.n)
            if returncode is not None:
                return returncode
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        if bar is not None:
            bar.close()


def _changes(path: str, config: ml_collections.ConfigDict) -> list:
    """`config.config_changes` between the config in `path` and `config` (`RESUME_MAY_CHANGE` left out)."""
    with open(path, encoding="utf-8") as f:
        return config_lib.config_changes(json.load(f), config)


def _child_env() -> dict:
    """This process's environment, without a forced host device count (the run process sets its own)
    and with this package importable."""
    from island_jax.mesh import without_forced_device_count

    env = without_forced_device_count(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _tail(path: str, lines: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()


def _fields(config: ml_collections.ConfigDict, key: str) -> list[tuple[ml_collections.ConfigDict, str]]:
    """(parent, name) of every field the dotted path `key` names (`*` stands for every entry of a dict, e.g.
    `islands.*.inner_steps` for every island's).

    Raises:
      ConfigError: `key` names no field of the config (`config.unknown_field`: with the nearest field).
    """
    found = []

    def walk(node, parts, done):
        head, rest = parts[0], parts[1:]
        if head == "*":
            if not isinstance(node, ml_collections.ConfigDict) or not len(node):
                raise config_lib.ConfigError(f"{key}: {'.'.join(done) or 'the config'} has no entries for '*'")
            for name in node.keys():
                walk(node, [name, *rest], done)
            return
        if not isinstance(node, ml_collections.ConfigDict) or head not in node:
            raise config_lib.unknown_field(config, ".".join([*done, *parts]))
        if rest:
            walk(node[head], rest, [*done, head])
        else:
            found.append((node, head))

    walk(config, key.split("."), [])
    return found


def apply_override(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets the field at dotted path `key` (with `*` for every entry of a dict) in place.

    Raises:
      ConfigError: `key` names no field of the config, or `value` has the wrong type for it.
    """
    for node, name in _fields(config, key):
        try:
            setattr(node, name, value)
        except (TypeError, ValueError) as e:
            raise config_lib.ConfigError(f"{key}={value!r}: {e}") from e


def parse_override(config: ml_collections.ConfigDict, key: str, text: str) -> Any:
    """`text` (from a command line) as the value `--config.KEY=TEXT` would give the field(s) `key` names.

    The parser is the one ml_collections' config flags pick for the field's type (`config_path.get_type`):
    absl's bool (true/false, 1/0), int and float parsers, a str as given, a tuple as a Python literal, and
    for a field of any type (a `FieldReference` of `object`, such as `outer.overlap_steps`) a Python literal,
    else the text as a str: `0` is the int 0, `auto` the str "auto".

    Raises:
      ConfigError: `key` names no field, or `text` is not a value of the field's type.
    """
    import ast

    from absl import flags
    from ml_collections.config_flags import config_path

    node, name = _fields(config, key)[0]  # every field `*` names holds the same setting, of one type
    field_type = config_path.get_type(name, node)
    parsers = {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser()}
    try:
        if field_type in parsers:
            return parsers[field_type].parse(text)
        if field_type is tuple:
            value = ast.literal_eval(text)
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if field_type is str:
            return text
        try:  # object (or a type without a parser of its own): a literal where it is one, else the text
            return ast.literal_eval({"true": "True", "false": "False"}.get(text, text))
        except (SyntaxError, ValueError):
            return text
    except (ValueError, SyntaxError) as e:
        raise config_lib.ConfigError(f"{key}={text}: {e}") from e


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
                apply_override(config, key, value)
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
            with _RUNNING_LOCK:
                for proc in _RUNNING:
                    proc.kill()
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


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _main(argv: list[str]) -> int:
    """`python -m island_jax.experiment _run WORKDIR [--allow_config_change]`: trains WORKDIR/variant.json with
    every role in this process."""
    allow = argv[2:] == ["--allow_config_change"]
    if len(argv) not in (2, 3) or argv[0] != "_run" or (len(argv) == 3 and not allow):
        print("usage: python -m island_jax.experiment _run WORKDIR [--allow_config_change]", file=sys.stderr)
        return 2
    workdir = argv[1]
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.use_absl_handler()
    try:
        with open(os.path.join(workdir, VARIANT_FILE), encoding="utf-8") as f:
            config = ml_collections.ConfigDict(json.load(f))
        config_lib.validate(config)
        from island_jax.mesh import use_cpu_devices  # the backend starts at the first device query, after this

        use_cpu_devices(config_lib.total_devices(config))
        from island_jax.run import run_in_process

        run_in_process(config, workdir, allow_config_change=allow)
    except Exception as e:  # noqa: BLE001 - reported in the log the caller quotes
        traceback.print_exc()
        print(f"{type(e).__name__}: {e}" if not isinstance(e, config_lib.ConfigError) else str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
