"""How precisely a held-out set of each size scores a run's model: two halves, and the spread over draws.

  python experiments/heldout_halves.py --workdir=DIR [--round=R] [--sizes=256,512,1024,2048,4096] [--draws=200]

scores every window of the run's held-out files (`data.eval_windows` with no
limit, the global parameters of DIR's newest checkpoint or round R, on the
evaluating island's mesh of virtual CPU devices, as the run scores them), then for each size n prints: the mean loss of the first n
windows in `eval.seed`'s order (the set a run with `eval.num_windows=n`
scores), how far its two halves differ (relative, %), its standard error (%
of the mean), and the median and 95th percentile of the halves' difference
over `--draws` other random sets of n windows. The last line is the whole
held-out split. docs/results.md quotes it for `two_islands`.
"""

from __future__ import annotations

import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "A run's folder.")
_ROUND = flags.DEFINE_integer("round", None, "The checkpoint of this round (default: the newest).")
_SIZES = flags.DEFINE_list("sizes", ["256", "512", "1024", "2048", "4096"], "Held-out set sizes (windows).")
_DRAWS = flags.DEFINE_integer("draws", 200, "Random sets per size for the spread of the halves.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    import jax
    import numpy as np

    from island_jax import data as data_lib
    from island_jax.config import evaluating_island
    from island_jax.island.step import build_eval_step
    from island_jax.mesh import island_mesh, use_cpu_devices
    from island_jax.model import load
    from island_jax.model.init import init_params

    # the evaluating island's mesh, as the run scores its held-out set (expert capacity depends on the shards)
    started = load.run_config(_WORKDIR.value)
    first = started.islands[evaluating_island(started)]
    use_cpu_devices(first.num_devices)  # before JAX starts its backend
    config, params, round = load.from_workdir(_WORKDIR.value, _ROUND.value)
    corpus = data_lib.load(config, list(config.islands.keys()), island=evaluating_island(config))
    windows = data_lib.eval_windows(corpus.eval, config.model.seq_len, sys.maxsize, config.eval.get("seed", 0))
    graphdef, _, _ = init_params(config)
    step = build_eval_step(graphdef)
    with jax.set_mesh(island_mesh(first.mesh.data, first.mesh.expert, jax.devices()[: first.num_devices], fsdp=first.mesh.fsdp)):
        losses = []
        for b, real in data_lib.eval_batches(windows, config.eval.batch_size):
            mask = (np.arange(len(b)) < real)[:, None].repeat(b.shape[-1] - 1, axis=1).astype(np.float32)
            tokens, segments = (b, ()) if b.ndim == 2 else (b[:, 0], (b[:, 1],))  # byte windows, or packed records
            tokens = tokens.astype(np.int32)
            losses.append(np.asarray(step(params, tokens[:, :-1], tokens[:, 1:], mask, *segments))[:real])
        losses = np.concatenate(losses).astype(np.float64)
    print(f"{_WORKDIR.value}, round {round}: {len(losses)} held-out windows, mean {losses.mean():.4f}, per-window "
          f"std {losses.std(ddof=1):.4f} {data_lib.loss_unit(config)}")
    rng = np.random.default_rng(1)
    for n in [int(s) for s in _SIZES.value if int(s) < len(losses)] + [len(losses)]:
        half = n // 2

        def halves(x):
            return abs(x[:half].mean() / x[half:].mean() - 1) * 100

        first = losses[:n]
        spread = [halves(losses[rng.permutation(len(losses))[:n]]) for _ in range(_DRAWS.value)]
        print(f"n={n}: mean {first.mean():.4f}, halves differ {halves(first):.3f}%, standard error "
              f"{100 * first.std(ddof=1) / np.sqrt(n) / first.mean():.3f}% of the mean; over {_DRAWS.value} draws "
              f"the halves differ {np.median(spread):.3f}% (median), {np.quantile(spread, 0.95):.3f}% (95th percentile)")


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
