"""The outer optimizer of DiLoCo (arXiv 2311.08105, Algorithm 1).

The merged pseudo-gradient (anchor - local parameters, averaged over islands)
is treated as a gradient of the global parameters and fed to SGD with Nesterov
momentum; DiLoCo's defaults are learning rate 0.7 and momentum 0.9. The
coordinator applies it chunk by chunk (island_jax/outer/chunk_step.py).

The momentum may be warmed up (Pier, arXiv 2511.17849): with
`outer.momentum_warmup_rounds = W`, round r uses mu_r = momentum x min(r / W, 1),
so a cold start is not thrown by momentum built on its first, largest steps.
With Nesterov, round r computes m_r = mu_r m_{r-1} + g_r and the update
-lr (g_r + mu_r m_r), both with the same mu_r. The learning rate and mu_r a
round used are in the optimizer state after it (`outer_hyperparams`), and so
in the coordinator's round records.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
import optax


def momentum_schedule(momentum: float, warmup_rounds: int):
    """mu_r as an optax schedule of the round r (the optimizer's update count): a linear ramp from 0 at round 0 to
    `momentum` at round `warmup_rounds` (float32), then `momentum`; constant `momentum` when `warmup_rounds` is 0."""
    if not warmup_rounds:
        return lambda count: jnp.float32(momentum)
    return lambda count: jnp.float32(momentum) * jnp.minimum(count.astype(jnp.float32) / warmup_rounds, 1.0)


def outer_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """optax SGD from `config.outer` (`learning_rate`, `momentum`, `nesterov`, `momentum_warmup_rounds`).

    One state structure whatever the momentum (`optax.inject_hyperparams`: the learning rate and the round's
    momentum are in the state, with a momentum trace even at momentum 0), so checkpoints keep their shape when
    the momentum changes. A momentum of 0 gives plain SGD; with learning rate 1 and no momentum the outer step is
    exactly parameter averaging (FedAvg).
    """
    o = config.outer
    schedule = momentum_schedule(float(o.momentum), int(o.momentum_warmup_rounds))
    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=float(o.learning_rate), momentum=schedule, nesterov=bool(o.nesterov)
    )


def outer_hyperparams(opt_state: Any) -> dict[str, float]:
    """The outer learning rate and momentum of the step that produced `opt_state` (an `outer_optimizer` state).

    `optax.inject_hyperparams` keeps in its state the values the last update
    used (the round's mu_r from `momentum_schedule`, evaluated at the update
    count); before any update, those of round 0.

    Returns:
      {"outer_learning_rate": lr, "outer_momentum": mu_r}: the float32 values, as Python floats.
    """
    h = opt_state.hyperparams
    return dict(outer_learning_rate=float(h["learning_rate"]), outer_momentum=float(h["momentum"]))
