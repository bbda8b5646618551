"""`--smoke`: every benchmark's tiny size, which runs in seconds, for checking that the benchmark still runs.

A benchmark defines its full size in its flags' defaults and names its smoke
size once, in `sizes(...)`. With `--smoke`, the flags named there take their
smoke values, except those given on the command line, and everything else runs
as at full size: the same code path and the same printout, the same last line.
The figures a smoke run prints are not measurements. tests/test_benchmarks.py
runs every benchmark this way.
"""

from __future__ import annotations

from absl import flags

SMOKE = flags.DEFINE_bool(
    "smoke", False,
    "Run at a tiny size that finishes in seconds (the same code path and printout as the full size; its figures "
    "are not measurements). Flags given on the command line keep their values.",
)


def sizes(**smoke_values) -> bool:
    """With `--smoke`, sets each named flag to its smoke value unless the command line gave it.

    Call it in `main`, after absl parsed the flags, before any flag is read.

    Args:
      **smoke_values: flag name -> its value at smoke size, e.g. `sizes(megabytes=4, repeats=1)`.

    Returns:
      Whether `--smoke` was given.

    Raises:
      KeyError: a name that is no flag of the program (define it, or fix the name).
    """
    for name in smoke_values:
        if name not in flags.FLAGS:
            raise KeyError(f"_smoke.sizes names {name!r}, which is no flag of this program; define it or fix the name")
    if SMOKE.value:
        for name, value in smoke_values.items():
            if not flags.FLAGS[name].present:
                flags.FLAGS[name].value = value
    return SMOKE.value

