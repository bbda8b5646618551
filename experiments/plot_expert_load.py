"""Draws expert load per MoE layer over inner steps from a run's metrics.

  python experiments/plot_expert_load.py --metrics=WORKDIR/islands/a/metrics.jsonl --out=expert_load.png
"""

import sys

from absl import app, flags

_METRICS = flags.DEFINE_string("metrics", None, "A metrics.jsonl with inner-step records.")
_OUT = flags.DEFINE_string("out", "expert_load.png", "The PNG to write.")
flags.mark_flags_as_required(["metrics"])


def main(argv):
    del argv
    from island_jax.plots import plot_expert_load

    try:
        print(plot_expert_load(_METRICS.value, _OUT.value))
    except (OSError, ValueError) as e:
        sys.exit(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    app.run(main)
