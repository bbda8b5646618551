"""Where a run came from: what each start of a role records in its folder's `run_info.json`.

Results differ in their last digits between CPU models and library versions,
so every role writes, each time it starts (a resumed role adds a start), the
code, the libraries and the machine that ran it. `run_info.json` beside the
role's `config.json` holds `{"starts": [START, ...]}`, the first start first;
each START is `describe()`'s dict plus `time` and, when the role resumed
under a changed config (`--allow_config_change`), its `config_changes`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata

# The distributions whose versions a start records (island_jax's own first).
PACKAGES = ("island_jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grpcio")
RUN_INFO_FILE = "run_info.json"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_state(folder: str = _REPO) -> dict:
    """`{"commit": 40 hex digits, "dirty": whether tracked files have uncommitted changes}` of the checkout
    `folder` belongs to; both None when it is not in a git checkout (an installed package) or git is missing."""
    try:
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return dict(commit=None, dirty=None)
        status = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        return dict(commit=commit.stdout.strip(), dirty=bool(status.stdout.strip()) if status.returncode == 0 else None)
    except (OSError, subprocess.TimeoutExpired):
        return dict(commit=None, dirty=None)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name"; elsewhere `platform.processor()`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    """{distribution: version} of `PACKAGES` (None for one not installed)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def accelerator() -> dict:
    """`{"platform", "kind", "count"}` of JAX's devices in this process (e.g. "cpu", "cpu", 4 or "gpu",
    "NVIDIA H200", 8): its backend is started if it was not yet."""
    import jax

    devices = jax.local_devices()
    return dict(platform=devices[0].platform, kind=devices[0].device_kind, count=len(devices))


def describe() -> dict:
    """This process's provenance: `git` (`git_state`), `versions`, `python` (version), `cpu` (`cpu_model`),
    `cpu_count`, `accelerator`, `hostname` and `command` (sys.argv, with the interpreter first)."""
    return dict(
        git=git_state(), versions=versions(), python=platform.python_version(), cpu=cpu_model(),
        cpu_count=os.cpu_count(), accelerator=accelerator(), hostname=socket.gethostname(),
        command=[sys.executable, *sys.argv],
    )


def record_start(folder: str, config_changes: list | None = None) -> dict:
    """Appends this start (`describe()`, `time` in Unix seconds, and `config_changes` when given: [[field, the
    value it started with, the value now]]) to `folder/run_info.json`, written atomically; returns the start."""
    from island_jax.metrics import write_json

    path = os.path.join(folder, RUN_INFO_FILE)
    info = {"starts": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    start = dict(time=time.time(), **describe())
    if config_changes:
        start["config_changes"] = [list(c) for c in config_changes]
    info["starts"].append(start)
    write_json(path, info)
    return start
