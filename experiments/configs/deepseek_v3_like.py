"""DeepSeek-V3's shape in this model's terms: a 704.9B-parameter MoE (38.7B active per token).

61 blocks of width 7,168 (128 heads of 56), each an MoE of 256 fine-grained routed experts of 2,048 (top-8)
and one shared expert of 2,048; auxiliary-loss-free balancing (`moe.routing_bias_update_rate` 0.001, V3's
gamma); a vocabulary of 129,280 tokens; 4,096-token sequences; rotary positions; bfloat16 activations.

  704,921,055,488 parameters, 38,681,030,912 active per token, 253.5778 GFLOPs per token to train
  (6 N + 12 L S D, island_jax/model/flops.py; the output head is in N)

DeepSeek-V3 (arXiv 2412.19437) has 671B parameters, 37B active per token. This model has more, for two
reasons:
- its attention is multi-head, 4 D^2 = 205.5M parameters per block, where V3's multi-head latent attention
  projects queries, keys and values through low-rank latents (about 187M per block);
- every block here is an MoE, where V3's first 3 blocks are dense SwiGLU layers of 18,432: 3 more MoE layers
  of 11.3B.
V3 also limits each token's experts to 4 nodes, which changes no count.

V3's multi-token-prediction module (14B parameters) is not part of its 671B, nor of this model. Used by the
planner, for counts from shapes and for the compiler's memory per device (nothing is allocated; its islands
do not fit their devices: docs/island.md, "Compiling for a target"):

  python -m island_jax.plan --config=experiments/configs/deepseek_v3_like.py
  python experiments/train.py --config=experiments/configs/deepseek_v3_like.py --dry_run --target=us=tpu-v5p-2048

Two islands of 1,024 H100 (data=32, fsdp=4, expert=8), as in docs/planner.md's frontier example.
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(vocab_size=129280, seq_len=4096, num_layers=61, d_model=7168, num_heads=128, positions="rope",
                        compute_dtype="bfloat16", mlp_hidden_dim=18432, scan_layers=True)
    config.moe.update(num_experts=256, num_experts_per_token=8, expert_hidden_dim=2048, num_shared_experts=1,
                      routing_bias_update_rate=0.001)
    for name in ("us", "eu"):
        config.islands[name] = island(num_devices=1024, data=32, fsdp=4, expert=8, batch_size=2048, inner_steps=100,
                                      hardware="h100")
    config.outer.update(rounds=100, fragments=4)
    config.eval.update(every_rounds=10, batch_size=2048)
    return config
