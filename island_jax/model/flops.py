"""Parameter counts and training FLOPs per token, from a config's shapes alone: the one home for MFU (the
islands' round records), the planner's step times and the model configs' sizes.

Training FLOPs per token (PaLM, arXiv 2204.02311, appendix B):

    6 N + 12 L S D

N is the parameters active per token (every parameter, with k of each MoE layer's E routed experts), the
6 is a forward (2) and a backward (4) multiply-add per parameter, and 12 L S D is the attention's
scores and weighted sum over S positions in each of L layers of width D, forward and backward (as PaLM
counts it, for the full S x S square even where the mask is causal). Model FLOPs utilization (MFU) is
those FLOPs over the devices' peak: tokens per second x FLOPs per token / peak FLOP/s.
"""

from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Attributes: total_params (every parameter, what the exchange moves); active_params (per token: the
    routed experts counted k of E); routed_params (the routed experts' weights); num_layers, seq_len,
    d_model (the attention term's L, S and D)."""

    total_params: int
    active_params: int
    routed_params: int
    num_layers: int
    seq_len: int
    d_model: int

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6 N + 12 L S D (module docstring)."""
        return train_flops_per_token(self.active_params, self.num_layers, self.seq_len, self.d_model)


def train_flops_per_token(active_params: float, num_layers: int = 0, seq_len: int = 0, d_model: int = 0) -> float:
    """6 x active_params + 12 x num_layers x seq_len x d_model: training FLOPs per token (forward and backward).

    Without the shapes (0), the attention term is left out: 6 N, which is what a planner given only parameter
    counts can say.
    """
    return 6.0 * active_params + 12.0 * num_layers * seq_len * d_model


def model_size(config: ml_collections.ConfigDict) -> ModelSize:
    """The parameter counts of `config.model` / `config.moe`, from the shapes of an abstract model (nothing is
    computed or allocated, so it serves frontier shapes on a laptop)."""
    import jax
    import numpy as np
    from flax import nnx

    from island_jax.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    total = routed = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        n = int(np.prod(leaf.shape))
        total += n
        keys = [str(getattr(k, "key", k)) for k in path]
        if len(keys) >= 2 and keys[-2] == "moe" and keys[-1] in ("w_gate", "w_up", "w_down"):
            routed += n
    k, e = config.moe.num_experts_per_token, config.moe.num_experts
    active = total - routed + routed * k // e
    m = config.model
    return ModelSize(total, active, routed, int(m.num_layers), int(m.seq_len), int(m.d_model))
