"""Writes a finished run's WORKDIR/summary.json from every role's folder, for launches whose roles ran as
separate jobs or pods (the last step of launch/slurm.py's job; after the jobs of launch/tpu_vm.py or
launch/k8s.py, once every role's folder is on one filesystem).

  python launch/summarize.py --config=experiments/configs/two_islands.py --workdir=DIR [--wall_seconds=S]

Takes the run's config and overrides, like every role. Prints the launchers' done line (eval loss, whether the
global parameters agree) and exits 1 when the run failed (`workdir.failures`: the islands' final parameters
disagree, or a round was merged without an island its quorum requires), its last line saying why; a role that
left no summary.json (it did not finish) is an error naming its folder.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.")
_WALL = flags.DEFINE_float("wall_seconds", 0.0, "The run's wall time, seconds, as the launcher measured it.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    from island_jax.workdir import combine_summaries, done_line

    try:
        summary = combine_summaries(_CONFIG.value, _WORKDIR.value, _WALL.value)
    except FileNotFoundError as e:
        sys.exit(f"{e}: that role did not finish; see its log, and launch the run again to resume it")
    print(f"[summarize] {done_line(_CONFIG.value, _WORKDIR.value, summary)}", flush=True)
    if summary["failures"]:
        sys.exit(f"[summarize] the run failed: {'; '.join(summary['failures'])}")


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
