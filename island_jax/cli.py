"""What the command-line scripts share: their flags parsed, with a one-line error for an unknown config override.

`parse_flags` is the `flags_parser` of `absl.app.run` in experiments/train.py,
experiments/sweep.py, launch/local.py and `python -m island_jax.plan`. An
override that names no field of the config (`--config.outer.roundz=3`) exits
with status 1 and one line naming it and the nearest field, where
ml_collections would end in a traceback of its AttributeError. Imports no JAX.
"""

from __future__ import annotations

import sys
from typing import Sequence

PREFIX = "--config."


def _config_path(argv: Sequence[str]) -> str | None:
    """The value of `--config=PATH` (or `--config PATH`) in `argv`, if given."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def unknown_overrides(config, argv: Sequence[str]) -> list[str]:
    """The dotted paths of `--config.PATH=V` (or `--config.PATH V`, `--config.noPATH`) arguments in `argv` that
    name no field of `config` (a `ConfigDict`), in argument order."""
    unknown = []
    for arg in argv:
        if not arg.startswith(PREFIX):
            continue
        path = arg[len(PREFIX):].split("=", 1)[0]
        if not _has_field(config, path) and not (path.rsplit(".", 1)[-1].startswith("no") and _has_field(
                config, ".".join([*path.split(".")[:-1], path.rsplit(".", 1)[-1][2:]]))):  # --config.a.nob: b False
            unknown.append(path)
    return unknown


def _has_field(config, path: str) -> bool:
    import ml_collections

    node = config
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:  # a leaf where the path goes on
            return False
        node = node[part]
    return True


def parse_flags(argv: list[str]) -> list[str]:
    """Parses `argv` into absl's FLAGS, as `absl.app.run` does by default; returns the arguments left.

    An override of the config that names no field exits (status 1) with `config.unknown_field`'s one line
    ("ConfigError: outer.roundz is not a field of the config; did you mean outer.rounds? ..."); a value of the
    wrong type, or any other flag error, exits with absl's own one line.
    """
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
    except (AttributeError, KeyError) as e:  # ml_collections, for an override of a field the config lacks
        path = _config_path(argv)
        if path is None:
            raise
        from island_jax import config as config_lib
        from island_jax.experiment import load_config

        try:
            config = load_config(path)
        except Exception:  # noqa: BLE001 - the config file itself fails: that error is the one to see
            raise e from None
        unknown = unknown_overrides(config, argv)
        if not unknown:
            raise
        sys.exit(str(config_lib.unknown_field(config, unknown[0])))
