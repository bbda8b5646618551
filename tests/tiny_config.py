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
    return c
