"""The ladder's second rung: a 124.6M-parameter MoE (53.8M active per token), rotary positions, fsdp islands.

12 blocks of width 640 (10 heads of 64), each an MoE of 8 routed experts of 512 (top-2); a vocabulary of
8,192 tokens (docs/data.md) and 1,024-token sequences; rotary positions.

  124,595,840 parameters, 53,816,960 active per token, 0.4173 GFLOPs per token to train (6 N + 12 L S D,
  island_jax/model/flops.py; the output head is in N)

Island `a`: 4 devices (data=1, fsdp=2, expert=2); island `b`: 2 devices (data=1, fsdp=2, expert=1); 4
sequences per inner step each, 25 inner steps per round, 20 rounds, int8 pseudo-gradients. Give it a dataset
prepared with --vocab_size=8192 --seq_len=1024 (`--config.data.prepared=DIR`, docs/data.md); without one the
islands read the byte-level corpus (`data.files`) and the vocabulary's rows past 256 stay unused.

  python experiments/train.py --config=experiments/configs/ladder_125m.py --dry_run
  python launch/local.py --config=experiments/configs/ladder_125m.py --workdir=workdir/ladder_125m
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(vocab_size=8192, seq_len=1024, num_layers=12, d_model=640, num_heads=10, positions="rope",
                        scan_layers=True)
    config.moe.update(num_experts=8, num_experts_per_token=2, expert_hidden_dim=512)
    config.islands.a = island(num_devices=4, data=1, fsdp=2, expert=2, batch_size=4, inner_steps=25)
    config.islands.b = island(num_devices=2, data=1, fsdp=2, expert=1, batch_size=4, inner_steps=25)
    config.outer.rounds = 20
    config.outer.momentum_warmup_rounds = 5
    config.eval.update(every_rounds=5, batch_size=4, num_windows=256)
    return config
