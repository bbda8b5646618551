"""A ~100M-parameter MoE that two islands hold sharded over an fsdp axis: the size of the memory budget's
check (`experiments/train.py --dry_run`) and of benchmarks/accelerator_check.py.

6 blocks of width 768 (12 heads, 1024-byte sequences), each an MoE of 4 experts of 1536 (top-2): 100.3M
parameters, 57.8M active per token. Island `a`: 4 devices, data=1 x fsdp=4 x expert=1; island `b`: 4
devices, data=1 x fsdp=2 x expert=2. 8 sequences per inner step each.

  python experiments/train.py --config=experiments/configs/fsdp_100m.py --dry_run

prints each island's bytes per device (docs/island.md); `--config.islands.a.mesh.fsdp=1
--config.islands.a.mesh.data=4` gives the replicated layout to compare with.
"""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(seq_len=1024, num_layers=6, d_model=768, num_heads=12)
    config.moe.update(num_experts=4, expert_hidden_dim=1536)
    config.islands.a = island(num_devices=4, data=1, fsdp=4, expert=1, batch_size=8, inner_steps=25)
    config.islands.b = island(num_devices=4, data=1, fsdp=2, expert=2, batch_size=8, inner_steps=25)
    config.outer.rounds = 10
    config.eval.update(every_rounds=10, batch_size=8)
    return config
