"""The ladder's smallest rung: a 19.9M-parameter MoE (9.3M active per token), rotary positions, two islands.

6 blocks of width 256 (4 heads of 64), each an MoE of 8 routed experts of 384 (top-2); a vocabulary of 8,192
tokens (a BPE prepared by experiments/prepare_data.py, docs/data.md) and 512-token sequences; rotary positions
(`model.positions = "rope"`).

  19,938,560 parameters, 9,321,728 active per token, 0.0654 GFLOPs per token to train (6 N + 12 L S D,
  island_jax/model/flops.py, the same count MFU and the planner use; the output head's 2.1M parameters are in
  N, since vocabularies differ)

Island `a`: 4 devices (data=2, expert=2), 8 sequences per inner step; island `b`: 2 devices (data=1,
expert=2), 4 sequences; 25 inner steps per round, 60 rounds, int8 pseudo-gradients, the outer step of
two_islands. Give it a dataset prepared with --vocab_size=8192 --seq_len=512 (docs/data.md); without one the
islands read the byte-level corpus (`data.files`) and the vocabulary's rows past 256 stay unused.

  python experiments/prepare_data.py --input=DIR --out=PREPARED --vocab_size=8192 --seq_len=512
  python launch/local.py --config=experiments/configs/ladder_20m.py --workdir=workdir/ladder_20m \
      --config.data.prepared=PREPARED

Against a byte-level model of the same shape at equal training FLOPs: docs/results.md.
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(vocab_size=8192, seq_len=512, num_layers=6, d_model=256, num_heads=4, positions="rope",
                        scan_layers=True)
    config.moe.update(num_experts=8, num_experts_per_token=2, expert_hidden_dim=384)
    config.islands.a = island(num_devices=4, data=2, expert=2, batch_size=8, inner_steps=25)
    config.islands.b = island(num_devices=2, data=1, expert=2, batch_size=4, inner_steps=25)
    config.outer.rounds = 60
    config.outer.momentum_warmup_rounds = 20
    config.eval.update(every_rounds=10, batch_size=8)
    return config
