"""Exports a run's global parameters as safetensors, with the config that builds their model.

  python -m island_jax.export --workdir=DIR [--round=R] --out=DIR

writes OUT/model.safetensors (one tensor per parameter, named by its path,
e.g. `blocks.0.moe.w_gate`, in the parameters' dtypes) and OUT/config.json (the
run's config), from the checkpoint of round R (default: the newest) of the
run's evaluating island (`model.load.from_workdir`). The safetensors header
holds the round and the parameters' `model.init.checksum`.
`island_jax.model.load.from_export(OUT)` reads it back to the same bits.
"""

from __future__ import annotations

import sys


def export(workdir: str, out: str, round: int | None = None) -> dict:
    """Writes the export of the run in `workdir` (round `round`, None: the newest) to `out`.

    Args:
      workdir: a finished or running run's folder.
      out: the export's folder (created): `model.safetensors` and `config.json` (`model.load.save`).
      round: completed rounds of a kept checkpoint of the run's evaluating island; None: the newest.

    Returns:
      {"weights": the safetensors path, "round", "checksum" (`model.init.checksum` of the parameters),
      "params" (their count)}.

    Raises:
      FileNotFoundError, model.load.LoadError: as `model.load.from_workdir`.
    """
    from island_jax.model import load
    from island_jax.model.init import checksum, count

    config, params, round = load.from_workdir(workdir, round)
    digest = checksum(params)
    weights = load.save(out, config, params, metadata=dict(round=round, checksum=digest, workdir=workdir))
    return dict(weights=weights, round=round, checksum=digest, params=count(params))


def _main(argv) -> int:
    from absl import flags

    from island_jax.model.load import LoadError

    del argv
    f = flags.FLAGS
    if not f.workdir or not f.out:
        sys.exit("island_jax.export: give --workdir=DIR (a run) and --out=DIR (where the export goes)")
    try:
        done = export(f.workdir, f.out, f.round)
    except (LoadError, FileNotFoundError) as e:
        sys.exit(f"island_jax.export: {e}")
    print(f"exported round {done['round']} ({done['params']} parameters, checksum {done['checksum']}) to "
          f"{done['weights']}")
    return 0


if __name__ == "__main__":
    from absl import app, flags

    from island_jax.cli import parse_flags

    flags.DEFINE_string("workdir", "", "A run's folder (finished or running).")
    flags.DEFINE_integer("round", None, "The checkpoint of this round (default: the newest).")
    flags.DEFINE_string("out", "", "The export's folder (created).")
    app.run(_main, flags_parser=parse_flags)
