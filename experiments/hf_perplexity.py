"""A run's model scored by transformers itself: its `--format=hf` export's perplexity on held-out windows against
island_jax's loss on the same windows.

  python experiments/hf_perplexity.py --workdir=workdir/two_islands [--windows=16] [--out=DIR]

Exports the run's newest checkpoint (`island_jax.export --format=hf`, into --out or a temporary folder), loads it
with `transformers.AutoModelForCausalLM` (float32, CPU; `pip install -e '.[hf]'` and torch), and scores the
first --windows windows of the run's held-out set (`data.eval_windows`: the run's eval set in its seeded order)
both ways: the mean cross-entropy over every target (nats per byte) and its exponential, the perplexity.
island_jax's side is the exported model's function, `sample.logits` (no expert-capacity drops, as transformers
computes it). Prints both losses, the perplexity and their relative difference; the last line is
`hf_perplexity: island_jax=L transformers=L relative=R`. Byte-corpus runs only (no `data.prepared`).
"""

import tempfile

import numpy as np
from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained run's folder (its byte corpus, no data.prepared).")
_WINDOWS = flags.DEFINE_integer("windows", 16, "Held-out windows to score: the first of the run's eval set.")
_OUT = flags.DEFINE_string("out", "", "Where the export goes ('': a temporary folder).")
flags.mark_flags_as_required(["workdir"])


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean over every target of -log softmax(logits)[target], in float64. logits [n, S, V], targets [n, S]."""
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    log_z = peak[..., 0] + np.log(np.exp(x - peak).sum(axis=-1))
    picked = np.take_along_axis(x, targets[..., None].astype(np.int64), axis=-1)[..., 0]
    return float(np.mean(log_z - picked))


def main(argv) -> None:
    del argv
    import torch
    import transformers

    from island_jax import data as data_lib
    from island_jax import export, sample
    from island_jax.model import load

    config, params, round = load.from_workdir(_WORKDIR.value)
    if config.data.get("prepared", ""):
        raise app.UsageError("the run trains on data.prepared records; this check scores byte-corpus runs")
    out = _OUT.value or tempfile.mkdtemp(prefix="hf_export_")
    done = export.export(_WORKDIR.value, out, round, format="hf")
    corpus = data_lib.load_corpus(config.data.files, config.data.eval_fraction, list(config.islands.keys()))
    windows = data_lib.eval_windows(corpus.eval, config.model.seq_len, config.eval.num_windows, config.eval.seed)
    windows = windows[: _WINDOWS.value].astype(np.int32)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    ours = _cross_entropy(sample.logits(config, params, inputs), targets)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = _cross_entropy(model(torch.tensor(inputs, dtype=torch.long)).logits.numpy(), targets)
    relative = abs(theirs - ours) / ours
    print(f"round {round} of {_WORKDIR.value}, exported as transformers {done['architecture']} to {out}")
    print(f"{len(windows)} held-out windows of {config.model.seq_len} targets (set {data_lib.windows_sha256(windows)})")
    print(f"island_jax:   {ours:.10f} nats per byte (perplexity {np.exp(ours):.6f})")
    print(f"transformers: {theirs:.10f} nats per byte (perplexity {np.exp(theirs):.6f})")
    print(f"hf_perplexity: island_jax={ours:.10f} transformers={theirs:.10f} relative={relative:.2e}")


if __name__ == "__main__":
    app.run(main)
