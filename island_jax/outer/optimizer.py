"""The outer optimizer of DiLoCo (arXiv 2311.08105, Algorithm 1).

The merged pseudo-gradient (anchor - local parameters, averaged over islands)
is treated as a gradient of the global parameters and fed to SGD with Nesterov
momentum; DiLoCo's defaults are learning rate 0.7 and momentum 0.9.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
import optax


def outer_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """optax SGD from `config.outer` (`learning_rate`, `momentum`, `nesterov`).

    A momentum of 0 gives plain SGD; with learning rate 1 and no momentum the
    outer step is exactly parameter averaging (FedAvg).
    """
    o = config.outer
    return optax.sgd(o.learning_rate, momentum=o.momentum or None, nesterov=bool(o.nesterov and o.momentum))


def outer_step(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, pseudo_gradient: Any
) -> tuple[Any, Any]:
    """One outer step on the host: params <- params + tx.update(pseudo_gradient).

    Args:
      tx: the outer optimizer.
      params: float32 master parameters (pytree of NumPy arrays).
      opt_state: `tx`'s state for `params`.
      pseudo_gradient: merged pseudo-gradient, same structure, float32.

    Returns:
      (new params as float32 NumPy arrays, new optimizer state).
    """
    with jax.default_device(jax.devices("cpu")[0]):
        updates, opt_state = tx.update(pseudo_gradient, opt_state, params)
        params = optax.apply_updates(params, updates)
        params, opt_state = jax.device_get((params, opt_state))
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params), opt_state
