"""One run from Python: `run(config, workdir)` trains in a process of its own and reads back what it wrote.

The process is `python -m island_jax.experiment _run WORKDIR` (every role of the run in it, as
`run_in_process`), so that JAX there gets exactly the virtual CPU devices the config asks for and a failed or
stopped run leaves the caller untouched. The config travels as `WORKDIR/variant.json`; what the run writes is
the usual workdir (`island_jax.workdir`), read back as a `Result`. A run stopped halfway resumes from its
checkpoints when run again with the same workdir; a finished one is read back, not run again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import ml_collections

from island_jax import config as config_lib
from island_jax.config.overrides import REPO_ROOT
from island_jax.experiment.result import Result

VARIANT_FILE = "variant.json"  # the config a run's process trains, in its workdir
LOG_FILE = "run.log"  # the run process's stdout and stderr (absl logs), in its workdir
STDERR_TAIL_LINES = 20  # lines of a failed run's log its error quotes


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


def kill_running() -> None:
    """Kills the run processes of this process's `run` calls (a sweep interrupted)."""
    with _RUNNING_LOCK:
        for proc in _RUNNING:
            proc.kill()


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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _tail(path: str, lines: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()
