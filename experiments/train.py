"""Runs one experiment: `python experiments/train.py --config=CONFIG.py --workdir=DIR`.

Overrides use ml_collections syntax, e.g. `--config.islands.b.batch_size=8`.
The process gets one virtual CPU device per island device (set from the config
before JAX starts its backend) unless it already runs on accelerators.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for config.json, metrics.jsonl and summary.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    from island_jax import config as config_lib

    config = _CONFIG.value
    try:
        config_lib.validate(config)  # everything that needs no backend, before JAX starts
    except config_lib.ConfigError as e:
        sys.exit(str(e))

    import jax

    jax.config.update("jax_num_cpu_devices", max(config_lib.total_devices(config), 1))

    from island_jax.coordinator import HandshakeError
    from island_jax.data import DataError
    from island_jax.train import train_and_evaluate

    try:
        train_and_evaluate(config, _WORKDIR.value)
    except config_lib.ConfigError as e:
        sys.exit(str(e))
    except (DataError, HandshakeError, FileExistsError) as e:
        sys.exit(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    app.run(main)
