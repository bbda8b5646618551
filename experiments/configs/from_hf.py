"""`two_islands` started from a Hugging Face transformers checkpoint: continued pretraining across islands.

  python launch/local.py --config=experiments/configs/from_hf.py:CHECKPOINT --workdir=/tmp/from_hf

CHECKPOINT is the folder of a Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint in safetensors (config.json,
model.safetensors or its index and shards, tokenizer.json), such as `python -m island_jax.export --format=hf`
writes. Its config.json sets every model.* and moe.* field that shapes the model (`island_jax.config.hf.apply`),
and the coordinator and every island start from its weights (`model.init_from`): the run's initial checksum is
the checkpoint's. Its tokenizer must be the data's: a byte-level one reads the standard library's bytes as
two_islands does; any other needs a dataset prepared with it (`data.prepared`; docs/interop.md). The islands,
rounds and optimizers are two_islands'; override them as usual (`--config.outer.rounds=10`).
"""

import os

from island_jax.config import load_config
from island_jax.config.hf import apply


def get_config(checkpoint: str = ""):
    if not checkpoint:
        raise ValueError("name the checkpoint's folder: --config=experiments/configs/from_hf.py:FOLDER")
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_islands.py"))
    return apply(config, os.path.abspath(checkpoint))
