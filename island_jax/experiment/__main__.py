"""`python -m island_jax.experiment _run WORKDIR [--allow_config_change]`: the process `run` starts."""

from __future__ import annotations

import json
import os
import sys
import traceback

import ml_collections

from island_jax import config as config_lib
from island_jax.experiment.runner import VARIANT_FILE


def _main(argv: list[str]) -> int:
    """`python -m island_jax.experiment _run WORKDIR [--allow_config_change]`: trains WORKDIR/variant.json with
    every role in this process."""
    allow = argv[2:] == ["--allow_config_change"]
    if len(argv) not in (2, 3) or argv[0] != "_run" or (len(argv) == 3 and not allow):
        print("usage: python -m island_jax.experiment _run WORKDIR [--allow_config_change]", file=sys.stderr)
        return 2
    workdir = argv[1]
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.use_absl_handler()
    try:
        with open(os.path.join(workdir, VARIANT_FILE), encoding="utf-8") as f:
            config = ml_collections.ConfigDict(json.load(f))
        config_lib.validate(config)
        from island_jax.mesh import use_cpu_devices  # the backend starts at the first device query, after this

        use_cpu_devices(config_lib.total_devices(config))
        from island_jax.run import run_in_process

        run_in_process(config, workdir, allow_config_change=allow)
    except Exception as e:  # noqa: BLE001 - reported in the log the caller quotes
        traceback.print_exc()
        print(f"{type(e).__name__}: {e}" if not isinstance(e, config_lib.ConfigError) else str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
