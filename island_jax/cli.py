"""What the command-line scripts share: their flags parsed, with one line for every mistake in them.

`parse_flags` is the `flags_parser` of `absl.app.run` in experiments/sweep.py, `python -m island_jax.plan`
and the other scripts; experiments/train.py and launch/local.py use `parse_run_flags`, which also resumes a
workdir under its recorded config. Before absl sees the arguments (`config_argv`), `--config=PATH` is looked
up from the working directory, then from the repository (as `config.load_config` does), and a file in neither
place exits with one line naming it. A run's recorded `config.json` is a config file too (`config.read_json`
rebuilds it; `--config.a.b=v` overrides apply), and with `parse_run_flags`, `--workdir=DIR` and no `--config`
takes the run's recorded config (`recorded_config_path`).

An override that names no field (`--config.outer.roundz=3`) exits with one line naming the nearest field,
and any other flag error with absl's message on one line. `port_in_use` is the launchers' check of a port
before anything starts. Imports no JAX.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import Sequence

from island_jax.config.overrides import REPO_ROOT

PREFIX = "--config."
_HELP = ("--help", "-help", "--helpshort", "--helpfull", "--helpxml", "-h", "-?")


def _config_path(argv: Sequence[str]) -> str | None:
    """The value of `--config=PATH` (or `--config PATH`) in `argv`, if given."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of the string flag `--NAME=V` (or `--NAME V`) in `argv`, the last one given; None if absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def recorded_config_path(workdir: str) -> str | None:
    """The config a run in `workdir` recorded when it started: `WORKDIR/coordinator/config.json`, or where that
    is absent (a run without the outer loop) the first island's in name order; None if no role has started."""
    coordinator = os.path.join(workdir, "coordinator", "config.json")
    if os.path.isfile(coordinator):
        return coordinator
    islands = os.path.join(workdir, "islands")
    names = sorted(os.listdir(islands)) if os.path.isdir(islands) else []
    return next((p for p in (os.path.join(islands, n, "config.json") for n in names) if os.path.isfile(p)), None)


def get_config(path: str):
    """A recorded `config.json` as a config file: `--config=island_jax/cli.py:PATH` is what `parse_flags`
    gives ml_collections for `--config=PATH.json` (its config flag runs a Python file's `get_config(ARG)`)."""
    from island_jax.config import read_json

    return read_json(path)


def config_argv(argv: Sequence[str], from_workdir: bool = False) -> list[str]:
    """`argv` with its config given as one argument, `--config=PATH[:ARG]` with PATH absolute.

    A relative PATH is looked up from the working directory, then from the repository (`REPO_ROOT`). With
    `from_workdir` and no `--config`, `--workdir=DIR` gives `recorded_config_path(DIR)`, placed first so that
    every `--config.a.b=v` override follows it. With a help flag (`--helpshort`, ...), `argv` is returned as is.

    Raises:
      ValueError: one line: a config file in neither place, or (`from_workdir`) neither `--config` nor a
        `--workdir` holding a recorded config.
    """
    argv = list(argv)
    if any(a in _HELP for a in argv):
        return argv
    path = _config_path(argv)
    if path is None:
        if not from_workdir:
            return argv
        workdir = _flag_value(argv, "workdir")
        recorded = recorded_config_path(workdir) if workdir else None
        if recorded is None:
            where = f"; {workdir} holds no recorded config.json (no role of a run has started there)" if workdir else ""
            raise ValueError(f"--config is required: pass an experiment config, e.g. "
                             f"--config=experiments/configs/two_islands.py, or --workdir of a started run to resume it "
                             f"under its recorded config{where}")
        return [*argv[:1], f"--config={os.path.abspath(recorded)}", *argv[1:]]
    file, colon, arg = path.partition(":")
    found = next((p for p in (file, os.path.join(REPO_ROOT, file)) if file and os.path.isfile(p)), None)
    if found is None:
        places = os.getcwd() if os.path.isabs(file) or not file or os.getcwd() == REPO_ROOT else (
            f"{os.getcwd()} and {REPO_ROOT}")
        raise ValueError(f"--config={path}: no config file {file!r} (looked in {places}); pass the path of an "
                         "experiment config (a get_config() file, e.g. experiments/configs/two_islands.py) or of "
                         "a run's recorded config.json")
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--config" and i + 1 < len(argv):
            out.append(f"--config={os.path.abspath(found)}{colon}{arg}")
            skip = True
        elif a.startswith("--config="):
            out.append(f"--config={os.path.abspath(found)}{colon}{arg}")
        else:
            out.append(a)
    return out


def _loadable(argv: list[str]) -> list[str]:
    """`argv` with `--config=PATH.json` as ml_collections can load it: `--config=<this file>:PATH.json`."""
    return [f"--config={os.path.abspath(__file__)}:{a.split('=', 1)[1]}" if a.startswith("--config=")
            and a.endswith(".json") else a for a in argv]


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


def _load(path: str):
    """The config `--config=PATH[:ARG]` names (after `config_argv`): a recorded config.json or a config file's."""
    file = path.partition(":")[0]
    if file.endswith(".json"):
        from island_jax.config import read_json

        return read_json(file)
    from island_jax.config import load_config

    return load_config(path)


def parse_flags(argv: list[str], from_workdir: bool = False) -> list[str]:
    """Parses `argv` into absl's FLAGS, as `absl.app.run` does by default; returns the arguments left.

    The config is found as `config_argv` says (with `from_workdir`, in the workdir's record). Every mistake
    exits with status 1 and one line: a config file not found, or one with no `get_config`; an override of the
    config that names no field
    (`config.unknown_field`: "ConfigError: outer.roundz is not a field of the config; did you mean
    outer.rounds? ..."); a value of the wrong type, or any other flag error, with absl's message.
    """
    from absl import flags

    try:
        resolved = config_argv(argv, from_workdir)
    except ValueError as e:
        sys.exit(str(e))
    try:
        return flags.FLAGS(_loadable(resolved))
    except flags.Error as e:
        sys.exit(f"FATAL Flags parsing error: {' '.join(str(e).split())} (pass --helpshort or --helpfull to see "
                 "help on flags)")
    except (AttributeError, KeyError) as e:  # ml_collections, for an override of a field the config lacks
        path = _config_path(resolved)
        if path is None:
            raise
        from island_jax import config as config_lib

        try:
            config = _load(path)
        except AttributeError as missing:
            if "get_config" not in str(missing):
                raise e from None
            sys.exit(f"--config: {missing}")  # a file that defines no get_config()
        except Exception:  # noqa: BLE001 - the config file itself fails: that error is the one to see
            raise e from None
        unknown = unknown_overrides(config, argv)
        if not unknown:
            raise
        sys.exit(str(config_lib.unknown_field(config, unknown[0])))


def parse_run_flags(argv: list[str]) -> list[str]:
    """`parse_flags` for the scripts that run or resume a run in `--workdir` (experiments/train.py,
    launch/local.py): without `--config`, the run's recorded config (`recorded_config_path`)."""
    return parse_flags(argv, from_workdir=True)


def port_in_use(host: str, port: int) -> str | None:
    """Where a server listening on `host`:`port` would collide with a socket already bound: the first such
    address ("127.0.0.1:50051"), or None when the port is free (or `port` is 0).

    Every address `host` resolves to is tried, and for a wildcard (0.0.0.0, ::) or `localhost` both loopback
    addresses too: gRPC, asked for localhost or a wildcard, starts with a warning where only one of them is
    free. Tried with SO_REUSEADDR, as servers bind, so a port left in TIME_WAIT by an ended run counts as free.
    """
    if not port:
        return None
    host = host.strip("[]")
    addresses = []
    try:
        for family, _, _, _, sockaddr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
            addresses.append((family, sockaddr[0]))
    except socket.gaierror:
        return None  # a host that does not resolve: the server's own error names it
    if host in ("", "0.0.0.0", "::", "localhost"):
        addresses += [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    for family, address in dict.fromkeys(addresses):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return None
