"""Two islands of different size and speed, rounds planned by wall clock.

Island `a`: 4 devices (data=2, expert=2), 8 sequences per step, full speed.
Island `b`: 2 devices (data=1, expert=2), 4 sequences per step, at half speed
(`simulated_speed` 0.5: it sleeps as long as each step took, standing for
older hardware). With `outer.sync = "time"` both train for the same
`outer.round_seconds` each round, so b processes fewer tokens, and the
coordinator weights each contribution by the tokens it reports.

  python launch/local.py --config=experiments/configs/hetero_islands.py --workdir=/tmp/hetero_islands

With Streaming DiLoCo (two fragments, each exchanged while the islands keep
training; see docs/streaming.md):

  python launch/local.py --config=experiments/configs/hetero_islands.py --workdir=/tmp/hetero_streaming \
      --config.outer.fragments=2 --config.outer.overlap_steps=auto
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    # inner_steps: the expected steps per round (the learning-rate schedule's length).
    config.islands.a = island(num_devices=4, data=2, expert=2, batch_size=8, inner_steps=25)
    config.islands.b = island(num_devices=2, data=1, expert=2, batch_size=4, inner_steps=12, simulated_speed=0.5)
    config.outer.sync = "time"
    config.outer.round_seconds = 5.0
    config.outer.rounds = 60
    config.eval.every_rounds = 10
    # Plain averaging (outer lr 1, no momentum), where two_islands uses Nesterov with a warm-up: the time-based
    # rounds' unequal contributions are the subject here, and no outer optimizer was tuned for them.
    config.outer.learning_rate = 1.0
    config.outer.momentum = 0.0
    config.outer.nesterov = False
    return config
