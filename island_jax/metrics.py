"""JSON-lines metrics in the workdir."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        a = np.asarray(value)
        return a.item() if a.ndim == 0 else a.tolist()
    return value


class MetricsWriter:
    """Appends one JSON object per line to `path` (created with its folder), flushed per write."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(_plain(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: str, obj: dict) -> None:
    """Writes `obj` as indented JSON, atomically (temporary file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_plain(obj), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
