"""Rotary positions (`model.positions = "rope"`, transformer.rotary) beside the learned position embedding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_config import get_config

from island_jax.config import ConfigError, default_config, validate
from island_jax.mesh import island_mesh
from island_jax.model.flops import model_size
from island_jax.model.transformer import Transformer, rotary


def test_rotary_scores_depend_only_on_the_offset_and_position_zero_is_the_identity():
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 12, 2, 16))
    positions = jnp.arange(12, dtype=jnp.int32)

    def scores(shift):
        qr, kr = rotary(q, positions + shift, 10_000.0), rotary(k, positions + shift, 10_000.0)
        return np.asarray(jnp.einsum("bshd,bthd->bhst", qr, kr))

    np.testing.assert_allclose(scores(0), scores(1000), atol=2e-4)  # q_m . k_n is a function of m - n
    assert not np.allclose(scores(0), np.asarray(jnp.einsum("bshd,bthd->bhst", q, k)), atol=1e-2)
    np.testing.assert_array_equal(np.asarray(rotary(q, jnp.zeros(12, jnp.int32), 10_000.0)), np.asarray(q))


def _rope_config():
    c = default_config()
    c.model.update(positions="rope", seq_len=16, d_model=32, num_heads=4, num_layers=2)
    c.moe.update(capacity_factor=0.0, expert_hidden_dim=32)
    return c


def test_a_rope_model_has_no_position_table_and_decoding_gives_its_logits():
    c = _rope_config()
    learned = default_config()
    learned.model.update(seq_len=16, d_model=32, num_heads=4, num_layers=2)
    learned.moe.update(expert_hidden_dim=32)
    assert model_size(learned).total_params - model_size(c).total_params == 16 * 32  # the table of seq_len x D
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        model = Transformer(c, rngs=nnx.Rngs(0))
        assert "position" not in nnx.to_pure_dict(nnx.state(model, nnx.Param))
        model.head.kernel[...] = jax.random.normal(jax.random.key(1), model.head.kernel.shape) * 0.1  # not uniform
        full, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
        decode = nnx.jit(lambda m, t, pos, cache: m.decode(t, pos, cache))
        cache = model.init_cache(2, 16)
        steps = []
        for pos in range(16):
            logits, cache = decode(model, tokens[:, pos : pos + 1], jnp.int32(pos), cache)
            steps.append(np.asarray(logits))
    assert float(np.abs(np.asarray(full)).max()) > 0.1
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full), atol=2e-5)


def test_positions_and_the_heads_width_are_checked():
    c = get_config()
    c.model.positions = "alibi"
    with pytest.raises(ConfigError, match="model.positions is 'alibi'; choose one of \\('learned', 'rope'\\)"):
        validate(c)
    c = get_config()
    c.model.update(positions="rope", d_model=36, num_heads=4)  # heads of width 9
    with pytest.raises(ConfigError, match="the heads' width d_model / num_heads = 9 is odd"):
        validate(c)
