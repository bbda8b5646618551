"""Quiet libraries: the log lines of orbax, JAX and the like hidden in entry points that only read a run.

orbax logs through absl, as island_jax does, so one logger carries both and a level alone cannot tell them
apart. `quiet_libraries` filters by where a record was logged from instead: records from island_jax's own
files always pass, records from any other file pass only at `level` or above (default ERROR), unless absl's
`--verbosity` is 1 or more (DEBUG), which shows everything again. Used by `python -m island_jax.sample` and
`python -m island_jax.export`, whose output is their printed result, not orbax's restore lines, and (`install`,
WARNING and above) by every role of `experiments/train.py`.

  with logs.quiet_libraries():
      config, params, round = load.from_workdir(workdir)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # records logged from files under it are ours
SHOW_ALL_VERBOSITY = 1  # absl's --verbosity from which library records are all shown (1: DEBUG)


class LibraryFilter(logging.Filter):
    """Passes a record logged from a file of island_jax (or under `ours`, more folders), or at `level` or above;
    drops the rest."""

    def __init__(self, level: int = logging.ERROR, ours: tuple[str, ...] = ()):
        super().__init__()
        self.level = level
        self.ours = (PACKAGE_DIR, *(os.path.abspath(d) + os.sep for d in ours))

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or os.path.abspath(record.pathname).startswith(self.ours)


def _verbosity() -> int:
    """absl's --verbosity (-1 WARNING, 0 INFO, 1 DEBUG); 0 when the flags are not parsed yet."""
    from absl import flags

    return flags.FLAGS.verbosity if flags.FLAGS.is_parsed() else 0


@contextlib.contextmanager
def quiet_libraries(level: int = logging.ERROR, verbosity: int | None = None) -> Iterator[LibraryFilter | None]:
    """While active, drops log records below `level` that other packages log (orbax's INFO and WARNING lines);
    island_jax's own records, and any at `level` or above, pass.

    The filter sits on absl's handler and on every handler of the root logger, so it catches records logged
    through absl (orbax) and through plain `logging` (JAX) alike; it is removed on exit.

    Args:
      level: the lowest `logging` level of another package's record that still shows.
      verbosity: absl's verbosity; None reads `--verbosity` (0 when flags are not parsed). At
        `SHOW_ALL_VERBOSITY` (1) or more nothing is filtered.

    Yields:
      The filter installed, or None when the verbosity shows everything.
    """
    installed = install(level, verbosity)
    try:
        yield None if installed is None else installed[0]
    finally:
        if installed is not None:
            for handler in installed[1]:
                handler.removeFilter(installed[0])


def install(level: int = logging.ERROR, verbosity: int | None = None, ours: tuple[str, ...] = ()):
    """Puts a `LibraryFilter(level, ours)` on absl's handler and every handler of the root logger, for good (an
    entry point's whole process; `quiet_libraries` for a block). Returns (the filter, the handlers it is on),
    or None when `verbosity` (None: absl's `--verbosity`) is `SHOW_ALL_VERBOSITY` or more."""
    from absl import logging as absl_logging

    if (_verbosity() if verbosity is None else verbosity) >= SHOW_ALL_VERBOSITY:
        return None
    quiet = LibraryFilter(level, ours)
    handlers = list({id(h): h for h in [absl_logging.get_absl_handler(), *logging.getLogger().handlers]}.values())
    for handler in handlers:
        handler.addFilter(quiet)
    return quiet, handlers
