"""Packed documents (prepared records): attention and positions stay within a document, the loss scores every
document's tokens, and the mask reaches cuDNN's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from island_jax.config import default_config
from island_jax.island import step as step_lib
from island_jax.mesh import island_mesh
from island_jax.model import transformer
from island_jax.model.transformer import Transformer, segment_mask, segment_positions

S = 16


def _config(positions):
    c = default_config()
    c.model.update(positions=positions, seq_len=S, d_model=32, num_heads=4, num_layers=2, vocab_size=300)
    # no token is dropped, so that no document's routing can push another's tokens out of an expert
    c.moe.update(capacity_factor=0.0, expert_hidden_dim=32)
    return c


def _model(c):
    model = Transformer(c, rngs=nnx.Rngs(0))
    model.head.kernel[...] = jax.random.normal(jax.random.key(1), model.head.kernel.shape) * 0.1  # not uniform
    return model


def test_segment_positions_count_from_each_documents_start_and_the_mask_keeps_to_one_document():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    mask = np.asarray(segment_mask(segments))
    assert mask.shape == (2, 1, 8, 8) and mask[1].all()
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_an_earlier_documents_tokens_leave_a_later_documents_logits_bitwise_equal(positions):
    c = _config(positions)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, (2, S))
    changed = tokens.copy()
    changed[:, :6] = rng.integers(0, 300, (2, 6))  # the first document's tokens, its length kept
    segments = np.array([[1] * 6 + [2] * 7 + [3] * 3, [1] * 6 + [2] * 10], np.int32)
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        model = _model(c)
        call = nnx.jit(lambda m, t, s: m(t, None, None, s)[0])
        before = np.asarray(call(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(segments)))
        after = np.asarray(call(model, jnp.asarray(changed, jnp.int32), jnp.asarray(segments)))
        # the second document alone, from the start of a row: the same logits (positions count from 0)
        alone = np.asarray(call(model, jnp.asarray(tokens[:, 6:], jnp.int32), jnp.ones((2, S - 6), jnp.int32)))
    assert not np.array_equal(before[:, :6], after[:, :6])
    np.testing.assert_array_equal(before[:, 6:], after[:, 6:])
    np.testing.assert_allclose(before[1, 6:], alone[1], atol=2e-5)
    np.testing.assert_allclose(before[0, 6:13], alone[0, :7], atol=2e-5)


def test_the_loss_scores_every_documents_tokens_and_no_padding():
    segments = jnp.asarray([[1, 1, 2, 2, 2, 0, 0]], jnp.int32)  # [B, S + 1]: inputs are the first 6, targets the last
    model_mask, loss_mask, segment_ids = step_lib.packed_masks(segments)
    assert segment_ids.tolist() == [[1, 1, 2, 2, 2, 0]]
    assert model_mask.tolist() == [[1, 1, 1, 1, 1, 0]]  # the last real token is an input, padding is not
    # the end of document 1 predicts document 2's first token; nothing predicts padding
    assert loss_mask.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert step_lib.packed_masks(None) == (None, None, None)  # bytes: every token real
    ones = jnp.ones((1, 6))  # and a padded rows' mask as given
    assert step_lib.packed_masks(None, ones)[0] is ones and step_lib.packed_masks(None, ones)[1] is ones


def test_the_segment_mask_reaches_cudnns_attention(monkeypatch):
    """cuDNN's fused attention takes the document mask (as a bias); this machine has no GPU, so the call is
    checked: with the implementation forced to cuDNN, the mask and causality are what it is given."""
    seen = {}

    def attention(q, k, v, bias=None, mask=None, *, is_causal=False, implementation=None, **kw):
        seen.update(mask=None if mask is None else np.asarray(mask), is_causal=is_causal, implementation=implementation)
        return q

    monkeypatch.setattr(transformer, "attention_implementation", lambda dtype: "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", attention)
    attn = transformer.Attention(32, 4, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                 rope_theta=10_000.0)
    segments = jnp.asarray([[1, 1, 2, 2]], jnp.int32)
    attn(jnp.ones((1, 4, 32), jnp.bfloat16), segments)
    assert seen["implementation"] == "cudnn" and seen["is_causal"] is True
    np.testing.assert_array_equal(seen["mask"], np.asarray(segment_mask(segments)))


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_one_document_per_row_is_the_unpacked_model(positions):
    c = _config(positions)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, (2, S)), jnp.int32)
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        model = _model(c)
        call = nnx.jit(lambda m, t, s: m(t, None, None, s)[0])
        packed = np.asarray(call(model, tokens, jnp.ones((2, S), jnp.int32)))
        plain = np.asarray(call(model, tokens, None))
    np.testing.assert_allclose(packed, plain, atol=1e-6)
