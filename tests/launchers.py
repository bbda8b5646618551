"""What the tests of the cluster launchers share: a launcher loaded from launch/, and a cluster description
changed by dotted paths."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launcher(name: str):
    """launch/NAME.py as a module, loaded once per process (its flags are defined only when it runs as a script).
    It is registered in sys.modules before it runs: dataclasses look their module up there."""
    key = f"{name}_launcher"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "launch", f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def changed(raw: dict, changes: dict) -> dict:
    """`raw` (a cluster description) with each {"dotted.path": value} of `changes` set, or deleted for None."""
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return raw
