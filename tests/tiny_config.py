"""A run small enough for tests: two unequal islands, a 1-layer model, 3 rounds of 2 steps.

Used in process (`get_config()`) and by the launcher
(`--config=tests/tiny_config.py --config.data.files=DIR/*.py`); `write_corpus`
makes its data.
"""

import numpy as np

from island_jax.config import default_config, island


def write_corpus(folder) -> str:
    """30 small .py-like files of shuffled keywords in `folder` (a pathlib.Path); returns their glob."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "if", "else", "for", "in", "(", ")", ":", "\n    "]
    for i in range(30):
        (folder / f"m{i}.py").write_text(" ".join(rng.choice(words, size=400)))
    return str(folder / "*.py")


def get_config():
    c = default_config()
    c.model.update(seq_len=32, num_layers=1, d_model=32, num_heads=2)
    c.moe.update(num_experts=4, expert_hidden_dim=32)
    c.islands.a = island(4, 2, 2, 8, 2)
    c.islands.b = island(2, 1, 2, 4, 2)
    c.outer.rounds = 3
    c.eval.update(every_rounds=3, batch_size=4, num_windows=8)
    c.data.eval_fraction = 0.2
    c.checkpoint.every_rounds = 1
    # no routing probe: a program less to compile in each of the suite's runs; tests/test_run.py's runs route one
    c.metrics.routing_probe_tokens = 0
    # no figures in the workdir (drawing them is a noticeable share of a tiny run's end); the tests of timeline.png
    # and routing.png ask for them
    c.metrics.plots = ""
    return c


def write_prepared(folder, seed: int = 0, words=None, documents: int = 120, seq_len: int = 32, tokenizer: str = "",
                   vocab_size: int = 300) -> str:
    """A prepared dataset (island_jax/data/preparation.py) of `documents` JSONL documents of shuffled `words` in
    `folder` (a pathlib.Path): a BPE of `vocab_size` tokens trained on them, or the tokenizer.json
    `tokenizer`; records of `seq_len` predictions, small shards. Returns the dataset's folder."""
    import json

    from island_jax.data.preparation import prepare

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = words or ["def", "return", "self", "import", "class", "if", "else", "for", "in", "(", ")", ":", "\n    "]
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(5, 80))))}) + "\n")
    out = str(folder / "prepared")
    kw = dict(tokenizer="tokenizer_json", tokenizer_path=tokenizer) if tokenizer else dict(vocab_size=vocab_size)
    prepare([str(folder / "docs.jsonl")], out, seq_len=seq_len, eval_fraction=0.2, shard_bytes=4000, workers=1, **kw)
    return out
