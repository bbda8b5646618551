"""The global parameters of a run, from its workdir or from an export, as the pure dict `init_params` makes.

`from_workdir(workdir, round)` reads a finished or running run's checkpoint:
the evaluating island's `anchor` (the global parameters after that round;
with no outer loop, the island's own `params`), as orbax wrote it, with no
optimizer built. `save(folder, config, params)` writes an export,
`model.safetensors` (one tensor per parameter, named by its path, e.g.
`blocks.0.attn.qkv.kernel`) beside `config.json` (the run's config), and
`from_export(folder)` reads it back, checked against the model its config
builds. Both return exactly the arrays saved: logits computed from them are
the checkpoint's, bit for bit.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from island_jax.config import evaluating_island, read_json
from island_jax.model import stacking

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class LoadError(ValueError):
    """Parameters cannot be read into the model their config describes; the message says which and why."""


def _paths(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, np.ndarray]]:
    out = []
    for key in sorted(tree, key=lambda k: (isinstance(k, str), k)):
        value = tree[key]
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _fill(like: dict, lookup, source: str) -> dict:
    """A copy of `like` (`init_params`' pure dict) with each leaf replaced by `lookup(name)` (an array or None),
    checked against the leaf's shape and dtype.

    Raises:
      LoadError: a parameter `source` lacks, or holds with another shape or dtype.
    """
    def walk(tree, prefix):
        out = {}
        for key, value in tree.items():
            path = (*prefix, key)
            if isinstance(value, dict):
                out[key] = walk(value, path)
                continue
            found = lookup(_name(path))
            if found is None:
                raise LoadError(f"{source} has no parameter {_name(path)} ({value.dtype}{list(value.shape)}); it was "
                                "written for another model config")
            found = np.asarray(found)
            if found.shape != value.shape or found.dtype != value.dtype:
                raise LoadError(
                    f"{source} holds {_name(path)} as {found.dtype}{list(found.shape)} but the model of its config "
                    f"has {value.dtype}{list(value.shape)}; the file was written for another model config"
                )
            out[key] = found
        return out

    return walk(like, ())


def _template(config: ml_collections.ConfigDict):
    from island_jax.model.init import init_params

    return init_params(config)


def read_config(path: str) -> ml_collections.ConfigDict:
    """A `config.json` a role or an export wrote, as the ConfigDict it was written from (`config.read_json`)."""
    return read_json(path)


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config of the run in `workdir`: the `config.json` of its first island folder that has one.

    Raises:
      FileNotFoundError: `workdir` holds no island folder with a config.json.
    """
    islands = os.path.join(workdir, "islands")
    names = sorted(os.listdir(islands)) if os.path.isdir(islands) else []
    found = [n for n in names if os.path.exists(os.path.join(islands, n, CONFIG_FILE))]
    if not found:
        raise FileNotFoundError(f"{workdir} holds no island's config.json: it is not a run's workdir (or no island "
                                "has started yet)")
    return read_config(os.path.join(islands, found[0], CONFIG_FILE))


def from_workdir(workdir: str, round: int | None = None) -> tuple[ml_collections.ConfigDict, dict, int]:
    """The global parameters of the run in `workdir` after `round` rounds (None: its newest checkpoint).

    Args:
      workdir: a finished or running run's folder (`island_jax.workdir`).
      round: completed rounds of a kept checkpoint of the run's first island (the evaluating one).

    Returns:
      (the run's config, its first island's `config.json`; the parameters, `init_params`' pure dict of NumPy
      arrays in their dtypes; the round).

    Raises:
      FileNotFoundError: `workdir` holds no island folder with a config.json.
      LoadError: no checkpoint (of `round`), one that does not fit the config's model, or one whose parameters
        read other bits than their saved checksums (`checkpoint.verify_leaves`; the leaf is named).
    """
    import orbax.checkpoint as ocp

    from island_jax.checkpoint import LEAVES, CheckpointCorrupt, verify_leaves

    config = run_config(workdir)
    folder = os.path.join(workdir, "islands", evaluating_island(config), "checkpoints")
    if not os.path.isdir(folder):
        raise LoadError(f"{folder} does not exist: the run's evaluating island has saved no checkpoint yet")
    # read only: nothing is created or changed in a run's folder, which may be running
    manager = ocp.CheckpointManager(os.path.abspath(folder),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        rounds = sorted(manager.all_steps())
        if not rounds:
            raise LoadError(f"{folder} holds no complete checkpoint yet; wait for the run's first save")
        if round is not None and round not in rounds:
            raise LoadError(f"{folder} holds no checkpoint of round {round}; it keeps rounds {rounds}")
        round = rounds[-1] if round is None else round
        state = manager.restore(round, args=ocp.args.StandardRestore())
        recorded = (manager.metadata(round).custom_metadata or {}).get(LEAVES)
    finally:
        manager.close()
    key = "anchor" if config.outer.enabled else "params"
    saved = state[key]
    if recorded is not None:  # a checkpoint written with its checksums: the parameters read are checked
        try:
            verify_leaves({key: saved}, recorded, f"the checkpoint of round {round} in {os.path.join(folder, str(round))}")
        except CheckpointCorrupt as e:
            older = [r for r in rounds if r < round]
            raise LoadError(f"{e}; {f'pass --round={older[-1]} (an older checkpoint)' if older else 'no older one is kept'}"
                            ", or let the run resume (it falls back to its newest intact checkpoint)") from e
    flat = {_name(path): value for path, value in _paths(saved)}
    _, like, _ = _template(config)
    return config, _fill(like, flat.get, f"the checkpoint of round {round} in {folder}"), round


def save(folder: str, config: ml_collections.ConfigDict, params: dict, metadata: dict | None = None) -> str:
    """Writes an export: `folder/model.safetensors` (every parameter of `params` in the per-layer form, named by
    its path: `blocks.{i}....`, the stacked form's leaves written slice by slice, `stacking.unstack`) and
    `folder/config.json` (`config`); returns the weights' path. `metadata` (str -> str) goes into the
    safetensors header."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {_name(path): np.ascontiguousarray(value) for path, value in _paths(stacking.unstack(params))}
    weights = os.path.join(folder, WEIGHTS_FILE)
    save_file(tensors, weights, metadata={k: str(v) for k, v in (metadata or {}).items()})
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    return weights


def from_export(folder: str, scan_layers: bool | None = None) -> tuple[ml_collections.ConfigDict, dict]:
    """Reads an export (`save`): (its config, the parameters as `init_params`' pure dict of NumPy arrays).

    Args:
      folder: the export's folder.
      scan_layers: the layout to load into (`model.scan_layers`, set so in the config returned); None: the
        export's config's. The file's per-layer tensors are stacked for a scanned model (`stacking.to_layout`).

    Raises:
      FileNotFoundError: `folder` lacks model.safetensors or config.json.
      LoadError: a parameter the config's model has is missing from the file, or has another shape or dtype
        (a file written for another model config), named with both shapes.
    """
    from safetensors.numpy import load_file

    weights = os.path.join(folder, WEIGHTS_FILE)
    for path in (weights, os.path.join(folder, CONFIG_FILE)):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing; an export holds {WEIGHTS_FILE} and {CONFIG_FILE} "
                                    "(python -m island_jax.export)")
    config = read_config(os.path.join(folder, CONFIG_FILE))
    tensors = load_file(weights)
    _, like, _ = _template(config)
    like = stacking.unstack(like)  # the file's form
    params = _fill(like, tensors.get, weights)
    extra = sorted(set(tensors) - {_name(p) for p, _ in _paths(like)})
    if extra:
        raise LoadError(f"{weights} holds parameters the model of its config does not have ({', '.join(extra[:5])}); "
                        "it was written for another model config")
    if scan_layers is not None:
        config.model.scan_layers = bool(scan_layers)
    return config, stacking.to_layout(params, config.model.get("scan_layers", False), config.moe.every_n_layers)
