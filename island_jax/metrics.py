"""Metrics in the workdir: JSON lines, and the same numbers for the trackers the config names (docs/workdir.md).

Every record is one JSON object per line in `metrics.jsonl`, the run's own record that summaries, the progress
line and `experiment.Result` read; each carries `time`, when it was logged (Unix seconds, float). The writers of
`metrics.writers` (comma-separated; "jsonl,tensorboard" by default) get every record too:

  tensorboard  each numeric field as a TensorBoard scalar (tensorboardX) named `KIND/FIELD`, nested dicts joined
               with "/" and lists indexed (`inner/moe/expert_load/0/3`: MoE layer 0, expert 3), at the record's
               `step` or `round`, with its `time` as the wall time;
  wandb        the same scalars in a Weights & Biases run per role (`metrics.wandb`), x axis `KIND/step|round`;
  MODULE:CLASS any other tracker: a class importable in every role's process, made as
               `CLASS(folder, role, config)` and called like `Writer`: `write(record)` with the record's plain
               values, `close()` at the end (`scalars(record)` gives the flattened numbers).
"""

from __future__ import annotations

import json
import numbers
import os
import time
from concurrent import futures
from typing import Any

import numpy as np


def gbps(nbytes: int, seconds: float) -> float:
    """`nbytes` moved in `seconds`, in Gbit/s (0 when nothing was timed)."""
    return nbytes * 8 / seconds / 1e9 if seconds else 0.0


def duration(seconds: float) -> str:
    """Seconds as "42s", "7m05s" or "2h03m" (rounded to the second; negative as 0), for log lines and plots."""
    seconds = int(round(max(seconds, 0.0)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        a = np.asarray(value)
        return a.item() if a.ndim == 0 else a.tolist()
    return value


def _scalars(record: dict, prefix: str) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, name))
        elif isinstance(value, list):  # per layer, per expert: NAME/0, NAME/0/1, ...
            out.update(_scalars({str(i): v for i, v in enumerate(value)}, name))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class NoMetrics:
    """Writes nothing: what the processes of a multi-process island other than process 0 log to, since
    process 0 writes the island's metrics once."""

    def write(self, record: dict) -> None:
        del record

    def close(self) -> None:
        pass


class Writer:
    """What `MetricsWriter` hands every record to, besides `metrics.jsonl`: the interface of a tracker.

    A writer is made once per role as `Writer(folder, role, config)`: the role's folder in the workdir, its
    name ("coordinator" or "island NAME") and the run's config. `write` gets each record with plain values
    (numbers, strings, lists and dicts of them; `kind`, and `step` or `round`), in order, on one thread;
    `close` is called once, after the last.
    """

    def __init__(self, folder: str, role: str, config):
        self.folder, self.role, self.config = folder, role, config

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def x_axis(record: dict) -> tuple[str, int]:
    """("step", inner steps) or ("round", rounds): the x axis of a record's scalars (0 for a record with neither)."""
    return ("step", record["step"]) if "step" in record else ("round", record.get("round", 0))


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers as `KIND/FIELD` scalars (nested dicts and lists flattened with "/"), leaving out
    `kind`, `step`, `round` and `time` (the x axes and the wall time)."""
    fields = {k: v for k, v in record.items() if k not in ("kind", "step", "round", "time")}
    return _scalars(fields, record["kind"])


def _summary_writer():
    """tensorboardX's `SummaryWriter` class, imported without torch: tensorboardX's writer module imports torch
    whenever it is installed (to accept its tensors), which costs a process about 0.9 s of CPU and 300 MB here,
    and island_jax writes floats only. A process that imported torch already keeps it; later imports of torch are
    unaffected."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter(Writer):
    """`metrics.writers` "tensorboard": event files (`events.out.tfevents.*`) in the role's folder (tensorboardX)."""

    def __init__(self, folder: str, role: str, config):
        super().__init__(folder, role, config)
        self._tb = _summary_writer()(logdir=folder, flush_secs=10)

    def write(self, record: dict) -> None:
        step, walltime = x_axis(record)[1], record.get("time")
        for tag, value in scalars(record).items():
            self._tb.add_scalar(tag, value, global_step=step, walltime=walltime)

    def close(self) -> None:
        self._tb.close()


class WandbWriter(Writer):
    """`metrics.writers` "wandb": one Weights & Biases run per role, in the role's folder (`wandb/`).

    The run is named after the role, grouped by the workdir's name, and holds the config; its id is fixed by
    the role's folder, so a resumed role appends to its run. `metrics.wandb.mode` ("online", "offline" or
    "disabled"; "" leaves it to `WANDB_MODE`), `project` and `entity` go to `wandb.init`. Each kind of record
    has its own x axis: `inner/*` scalars over `inner/step`, `round/*` over `round/round`. An offline run's file
    is whole once the process has exited or `wandb.teardown()` has returned (`close` finishes the run, which may
    return before wandb's service has flushed it), so sync it after that.

    Raises:
      ImportError: wandb is not installed (`pip install island_jax[wandb]`).
    """

    def __init__(self, folder: str, role: str, config):
        super().__init__(folder, role, config)
        try:
            import wandb
        except ImportError as e:
            raise ImportError("metrics.writers names wandb, which is not installed: pip install 'island_jax[wandb]' "
                              "(or leave wandb out of metrics.writers)") from e
        import hashlib

        settings = config.metrics.wandb
        workdir = os.path.dirname(folder) if role == "coordinator" else os.path.dirname(os.path.dirname(folder))
        self._run = wandb.init(
            project=settings.project, entity=settings.entity or None, mode=settings.mode or None,
            dir=folder, name=role, group=os.path.basename(os.path.abspath(workdir)),
            id=hashlib.sha256(os.path.abspath(folder).encode()).hexdigest()[:16], resume="allow",
            config=config.to_dict(), reinit="create_new",
        )
        self._axes: set[str] = set()

    def write(self, record: dict) -> None:
        axis, x = x_axis(record)
        kind = record["kind"]
        if kind not in self._axes:  # this kind's scalars over its own x axis
            self._run.define_metric(f"{kind}/{axis}")
            self._run.define_metric(f"{kind}/*", step_metric=f"{kind}/{axis}")
            self._axes.add(kind)
        values = scalars(record)
        if values:
            self._run.log({**values, f"{kind}/{axis}": x})

    def close(self) -> None:
        self._run.finish()


# Names `metrics.writers` may hold, besides "jsonl" (always written) and "MODULE:CLASS".
WRITERS = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter}


def comma_names(spec: str) -> list[str]:
    """The names in a comma-separated config value, `metrics.writers` or `metrics.plots`
    ("jsonl, tensorboard" -> ["jsonl", "tensorboard"]; "" -> [])."""
    return [name.strip() for name in spec.split(",") if name.strip()]


def make_writers(spec: str, folder: str, role: str, config) -> list[Writer]:
    """The writers `spec` (`metrics.writers`) names besides "jsonl", made for a role's folder.

    Raises:
      ValueError: a name that is neither in `WRITERS` nor MODULE:CLASS.
      ImportError: a writer whose library or module cannot be imported.
    """
    import importlib

    writers = []
    for name in comma_names(spec):
        if name == "jsonl":
            continue
        if name in WRITERS:
            cls = WRITERS[name]
        elif ":" in name:
            module, _, attr = name.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        else:
            raise ValueError(f"metrics.writers names {name!r}; use jsonl, {', '.join(WRITERS)} or MODULE:CLASS")
        writers.append(cls(folder, role, config))
    return writers


class MetricsWriter:
    """Appends records to `folder/metrics.jsonl` (flushed per write) and hands each to `writers`.

    Args:
      folder: the role's folder in the workdir (created).
      writers: the trackers besides JSON lines (`make_writers`), closed by `close`.
      background: write on a thread of its own, in the order given, so that a
        training loop does not wait for JSON and the trackers (`close` waits for
        every record; an error in a write is raised there or by the next `write`).
    """

    def __init__(self, folder: str, writers: list[Writer] = (), background: bool = False):
        os.makedirs(folder, exist_ok=True)
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics") if background else None
        self._last: futures.Future | None = None
        self.path = os.path.join(folder, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._writers = list(writers)

    def write(self, record: dict) -> None:
        """Writes one record; it needs a `kind`, and `step` or `round` for the trackers' x axis.

        The record is written with `time`: when this call was made (Unix
        seconds, `time.time()`, float), unless it holds a `time` already;
        the caller's dict is not changed. A top-level value may be a function of no arguments, called when the
        record is written (on the writer's thread with `background`): for
        values slow to compute, such as a checksum. With `background`, the
        record must not change after this call.

        Raises:
          With `background`, whatever an earlier write raised.
        """
        record = {**record, "time": float(record.get("time", time.time()))}
        if self._pool is None:
            self._write(record)
            return
        if self._last is not None and self._last.done():
            self._last.result()  # a failed write surfaces here
        self._last = self._pool.submit(self._write, record)

    def _write(self, record: dict) -> None:
        record = _plain({k: v() if callable(v) else v for k, v in record.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for writer in self._writers:
            writer.write(record)

    def close(self) -> None:
        """Writes what is queued, then closes the file and every writer."""
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
                if self._last is not None and self._last.exception() is not None:
                    raise self._last.exception()
        finally:
            self._file.close()
            failed = None
            for writer in self._writers:  # every writer is closed, even after one that raised
                try:
                    writer.close()
                except Exception as e:  # noqa: BLE001 - the first is raised once all are closed
                    failed = failed or e
            if failed is not None:
                raise failed


def read_jsonl(path: str) -> list[dict]:
    """All records of a `metrics.jsonl` file; a torn last line (a crash mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def write_json(path: str, obj: dict) -> None:
    """Writes `obj` as indented JSON, atomically (temporary file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_plain(obj), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
