"""The ladder's third rung: a 1.06B-parameter MoE (286.1M active per token) for GPU islands.

14 blocks of width 1,280 (10 heads of 128), each an MoE of 16 routed experts of 1,024 (top-2); a vocabulary
of 32,768 tokens and 2,048-token sequences; rotary positions; bfloat16 activations.

  1,056,764,160 parameters, 286,060,800 active per token, 2.1568 GFLOPs per token to train (6 N + 12 L S D,
  island_jax/model/flops.py; the output head is in N)

Two islands of 8 H100 each (data=2, fsdp=2, expert=2), 32 sequences per inner step, 100 inner steps per
round. Its memory per device from shapes and from the compiler (on this machine's CPU devices, or for a
TPU v5p slice or H100s it does not have: docs/island.md, "Compiling for a target"), and the planner:

  python experiments/train.py --config=experiments/configs/ladder_1b.py --dry_run [--target=tpu-v5p-16]
  python -m island_jax.plan --config=experiments/configs/ladder_1b.py
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(vocab_size=32768, seq_len=2048, num_layers=14, d_model=1280, num_heads=10, positions="rope",
                        compute_dtype="bfloat16", scan_layers=True)
    config.moe.update(num_experts=16, num_experts_per_token=2, expert_hidden_dim=1024)
    for name in ("a", "b"):
        config.islands[name] = island(num_devices=8, data=2, fsdp=2, expert=2, batch_size=32, inner_steps=100,
                                      hardware="h100")
    config.outer.rounds = 100
    config.eval.update(every_rounds=10, batch_size=32)
    return config
