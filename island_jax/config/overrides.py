"""Configs from files and fields set by dotted path: how a command line, a sweep or a notebook changes a config.

`load_config(path)` runs an experiment config file's `get_config()`. `apply_override(config, "outer.rounds",
5)` sets a field in place (`*` for every entry of a dict: `islands.*.inner_steps`), and `parse_override`
reads the value from text as `--config.KEY=TEXT` would. A path that names no field gets `unknown_field`'s
error, which suggests the nearest field.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

import ml_collections

from island_jax.config.schema import ConfigError, flat_fields

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder island_jax is in


def field_paths(config: ml_collections.ConfigDict) -> list[str]:
    """Every leaf field of `config` as a dotted path (e.g. "outer.rounds", "islands.a.mesh.data"), in key order."""
    return list(flat_fields(json.loads(config.to_json_best_effort())))


def unknown_field(config: ml_collections.ConfigDict, path: str) -> ConfigError:
    """The error for a dotted `path` that names no field of `config`, suggesting the nearest field's path
    (difflib's closest match of `field_paths`), e.g. "outer.roundz is not a field of the config; did you mean
    outer.rounds? (the fields are listed in island_jax/config/schema.py)"."""
    near = difflib.get_close_matches(path, field_paths(config), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "no field is close to it"
    return ConfigError(f"{path} is not a field of the config; {hint} (the fields are listed in island_jax/config/schema.py)")


def load_config(path: str) -> ml_collections.ConfigDict:
    """The config of an experiment file's `get_config()` (e.g. "experiments/configs/two_islands.py").

    `FILE:ARG` passes the string ARG to `get_config(ARG)`, as `--config=FILE:ARG` does on a command line
    (e.g. "experiments/configs/diloco_m.py:2,25"). A relative path is looked up from the working directory, then from the
    repository this package sits in, so a notebook finds the configs from any folder.

    Raises:
      FileNotFoundError: no such file in either place.
      AttributeError: the file defines no `get_config`.
    """
    import importlib.util

    path, sep, arg = path.partition(":") if not os.path.isfile(path) else (path, "", "")
    found = next((p for p in (path, os.path.join(REPO_ROOT, path)) if os.path.isfile(p)), None)
    if found is None:
        raise FileNotFoundError(f"no config file {path} (looked in {os.getcwd()} and {REPO_ROOT})")
    spec = importlib.util.spec_from_file_location(f"_island_jax_config_{abs(hash(found))}", found)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{found} defines no get_config(); an experiment config file returns its config from it")
    return module.get_config(arg) if sep else module.get_config()


def _fields(config: ml_collections.ConfigDict, key: str) -> list[tuple[ml_collections.ConfigDict, str]]:
    """(parent, name) of every field the dotted path `key` names (`*` stands for every entry of a dict, e.g.
    `islands.*.inner_steps` for every island's).

    Raises:
      ConfigError: `key` names no field of the config (`unknown_field`: with the nearest field).
    """
    found = []

    def walk(node, parts, done):
        head, rest = parts[0], parts[1:]
        if head == "*":
            if not isinstance(node, ml_collections.ConfigDict) or not len(node):
                raise ConfigError(f"{key}: {'.'.join(done) or 'the config'} has no entries for '*'")
            for name in node.keys():
                walk(node, [name, *rest], done)
            return
        if not isinstance(node, ml_collections.ConfigDict) or head not in node:
            raise unknown_field(config, ".".join([*done, *parts]))
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
            raise ConfigError(f"{key}={value!r}: {e}") from e


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
        raise ConfigError(f"{key}={text}: {e}") from e
