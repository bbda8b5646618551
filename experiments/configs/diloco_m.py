"""`baseline_dp`'s run split over M equal DiLoCo islands, H inner steps per round: the outer step's sweep.

  python experiments/train.py --config=experiments/configs/diloco_m.py:2,25 --workdir=/tmp/m2_h25

The argument is "M,H" (default "2,25"). Every M and H trains `baseline_dp`'s
model on its tokens: 12 sequences of 128 bytes per inner step over all
islands, 1500 inner steps per island (1500 / H rounds), 2.30M tokens, scored
on the same 2048 held-out windows. The islands (`outer.weighting = "tokens"`
gives each 1/M):

| M | islands | devices each (data x expert) | sequences per step each |
|---|---|---|---|
| 1 | a | 6 (3 x 2), `baseline_dp`'s mesh | 12 |
| 2 | a, b | 3 (3 x 1) | 6 |
| 4 | a, b, c, d | 1 (1 x 1) | 3 |

The outer step is Scaling Laws for DiLoCo's (arXiv 2503.09799, Section 3), Nesterov with momentum 0.9, here
at the sweep's chosen point for M = 1 and 2 at H = 25: outer lr 0.4 with the momentum ramped from 0 over the
first 20 rounds (docs/results.md; M = 4's best on seed 0 was 0.6). The paper starts the momentum cold; here
that ends 12% to 34% behind data parallel at M = 1 (`--config.outer.momentum_warmup_rounds=0`).
`experiments/outer_sweep.py` sets both for each point. Pseudo-gradients are int8 (island_jax's default codec).
With M = 1, `--config.outer.learning_rate=1 --config.outer.momentum=0 --config.codec.kind=none` is
data parallel: a + (l - a) = l up to float32 rounding (tests/test_run.py).
"""

from island_jax.config import ConfigError, default_config, island

STEPS = 1500  # inner steps per island, baseline_dp's
BATCH = 12  # sequences per inner step over all islands, baseline_dp's
# M -> (devices, data, expert) of each island
MESHES = {1: (6, 3, 2), 2: (3, 3, 1), 4: (1, 1, 1)}


def get_config(arg: str = "2,25"):
    try:
        m, h = (int(v) for v in arg.split(","))
    except ValueError:
        raise ConfigError(f"diloco_m.py:{arg}: give M,H as two integers, e.g. diloco_m.py:2,25") from None
    if m not in MESHES or h <= 0 or STEPS % h:
        raise ConfigError(f"diloco_m.py:{arg}: M must be one of {sorted(MESHES)} and H a positive divisor of {STEPS}")
    devices, data, expert = MESHES[m]
    config = default_config()
    for name in "abcd"[:m]:
        config.islands[name] = island(num_devices=devices, data=data, expert=expert, batch_size=BATCH // m,
                                      inner_steps=h)
    config.outer.rounds = STEPS // h
    config.outer.learning_rate = 0.4
    config.outer.momentum = 0.9
    config.outer.nesterov = True
    config.outer.momentum_warmup_rounds = 20
    config.model.positions = "rope"  # baseline_dp's model
    config.eval.every_rounds = config.outer.rounds // 6
    config.eval.batch_size = 48  # baseline_dp's
    return config
