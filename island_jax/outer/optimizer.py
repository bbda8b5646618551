"""The outer optimizer of DiLoCo (arXiv 2311.08105, Algorithm 1).

The merged pseudo-gradient (anchor - local parameters, averaged over islands)
is treated as a gradient of the global parameters and fed to SGD with Nesterov
momentum; DiLoCo's defaults are learning rate 0.7 and momentum 0.9. The
coordinator applies it chunk by chunk (island_jax/outer/chunk_step.py).
"""

from __future__ import annotations

import ml_collections
import optax


def outer_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """optax SGD from `config.outer` (`learning_rate`, `momentum`, `nesterov`).

    A momentum of 0 gives plain SGD; with learning rate 1 and no momentum the
    outer step is exactly parameter averaging (FedAvg).
    """
    o = config.outer
    return optax.sgd(o.learning_rate, momentum=o.momentum or None, nesterov=bool(o.nesterov and o.momentum))
