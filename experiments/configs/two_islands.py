"""Two unequal islands train one MoE language model with DiLoCo and int8 pseudo-gradients.

Island `a`: 4 devices (data=2, expert=2), 16 sequences per step.
Island `b`: 2 devices (data=1, expert=2), 8 sequences per step.

  python experiments/train.py --config=experiments/configs/two_islands.py --workdir=/tmp/two_islands

Reaches: see the README's results table (eval loss in nats per byte on held-out
standard-library files, wall time on a 2-core CPU machine).
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.islands.a = island(num_devices=4, data=2, expert=2, batch_size=16, inner_steps=25)
    config.islands.b = island(num_devices=2, data=1, expert=2, batch_size=8, inner_steps=25)
    config.outer.rounds = 20
    return config
