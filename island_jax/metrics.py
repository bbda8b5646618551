"""Metrics in the workdir: JSON lines, and the same numbers as TensorBoard scalars.

Every record is one JSON object per line in `metrics.jsonl`. With `tensorboard`
on, each numeric field (nested dicts flattened with "/") is also written as a
TensorBoard scalar (tensorboardX, no TensorFlow needed) named `KIND/FIELD`, for
example `inner/loss`, `round/pseudo_gradient_norm/a`, `inner/moe/expert_load/0/3`
(lists are indexed: MoE layer 0, expert 3), at the record's `step` (inner
steps) or `round`.
"""

from __future__ import annotations

import json
import numbers
import os
from concurrent import futures
from typing import Any

import numpy as np


def gbps(nbytes: int, seconds: float) -> float:
    """`nbytes` moved in `seconds`, in Gbit/s (0 when nothing was timed)."""
    return nbytes * 8 / seconds / 1e9 if seconds else 0.0


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


class MetricsWriter:
    """Appends records to `folder/metrics.jsonl` (flushed per write) and, optionally, TensorBoard events.

    Args:
      folder: the role's folder in the workdir (created).
      tensorboard: also write event files (`events.out.tfevents.*`) to `folder`.
      background: write on a thread of its own, in the order given, so that a
        training loop does not wait for JSON and TensorBoard (`close` waits for
        every record; an error in a write is raised there or by the next `write`).
    """

    def __init__(self, folder: str, tensorboard: bool = False, background: bool = False):
        os.makedirs(folder, exist_ok=True)
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics") if background else None
        self._last: futures.Future | None = None
        self.path = os.path.join(folder, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=folder, flush_secs=10)

    def write(self, record: dict) -> None:
        """Writes one record; it needs a `kind`, and `step` or `round` for TensorBoard's x axis.

        A top-level value may be a function of no arguments, called when the
        record is written (on the writer's thread with `background`): for
        values slow to compute, such as a checksum. With `background`, the
        record must not change after this call.

        Raises:
          With `background`, whatever an earlier write raised.
        """
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
        if self._tb is not None:
            step = record.get("step", record.get("round", 0))
            fields = {k: v for k, v in record.items() if k not in ("kind", "step", "round")}
            for tag, value in _scalars(fields, record["kind"]).items():
                self._tb.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        """Writes what is queued, then closes the files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            if self._last is not None and self._last.exception() is not None:
                self._file.close()
                raise self._last.exception()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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
