"""int8 / bf16 / none codecs on awkward pytrees."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from island_jax.outer import codec


def _tree():
    rng = np.random.default_rng(0)
    return {
        "scalar": np.float32(-0.37),
        "vector": rng.normal(size=5).astype(np.float32),
        "matrix": rng.normal(size=(3, 7)).astype(np.float32),
        "tensor": (rng.normal(size=(4, 3, 5)) * 100).astype(np.float32),
        "bf16": jnp.asarray(rng.normal(size=16), jnp.bfloat16),
    }


def test_int8_shapes_dtypes_and_error_bound():
    tree = _tree()
    payload = codec.encode(tree, "int8", 256)
    assert len(payload) == codec.payload_bytes(tree, "int8", 256) == (1 + 5 + 21 + 60 + 16) + 4 * 5
    decoded = codec.decode(payload, tree, "int8", 256)
    assert jax.tree.structure(decoded) == jax.tree.structure(tree)
    applied = codec.decode_and_apply(jax.tree.map(np.zeros_like, tree), payload, "int8", 256)
    for key, x in tree.items():
        x32 = np.asarray(x, np.float32).reshape(-1)
        assert decoded[key].shape == np.shape(x) and decoded[key].dtype == np.float32
        assert applied[key].dtype == np.asarray(x).dtype and applied[key].shape == np.shape(x)
        bound = np.abs(x32).max() / 254 * (1 + 1e-6)
        got = np.asarray(applied[key], np.float32).reshape(-1)
        ulp_half = np.spacing(np.abs(got).astype(np.asarray(x).dtype)).astype(np.float32) / 2
        assert np.all(np.abs(decoded[key].reshape(-1) - x32) <= bound)
        assert np.all(np.abs(got - x32) <= bound + ulp_half)


def test_decode_and_apply_into_out_gives_the_same_bits_in_the_buffers_given():
    rng = np.random.default_rng(3)
    params = {"a": rng.normal(size=(3, 700)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    update = codec.encode(jax.tree.map(lambda x: x * 0.01, params), "int8", 256)
    expected = codec.decode_and_apply(params, update, "int8", 256)
    into_other = jax.tree.map(np.empty_like, params)
    got = codec.decode_and_apply(params, update, "int8", 256, out=into_other)
    assert got["a"] is into_other["a"] and got["b"] is into_other["b"]
    in_place = jax.tree.map(np.copy, params)
    got_in_place = codec.decode_and_apply(in_place, update, "int8", 256, out=in_place)
    assert got_in_place["a"] is in_place["a"]
    for tree in (got, got_in_place):
        for key in params:
            assert tree[key].tobytes() == expected[key].tobytes()
    with pytest.raises(ValueError, match=r"each must be a writable, C-contiguous float32 NumPy array of its parameter's shape \(5,\)"):
        codec.decode_and_apply(params, update, "int8", 256, out={"a": into_other["a"], "b": np.zeros(5, np.float64)})
    with pytest.raises(ValueError, match="out has the structure"):
        codec.decode_and_apply(params, update, "int8", 256, out={"a": into_other["a"]})
    shared = np.zeros(10, np.float32)
    tied = {"a": shared[:5], "b": shared[5:]}  # disjoint halves of one buffer: allowed
    codec.decode_and_apply({"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)},
                           codec.encode({"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)}, "int8", 256),
                           "int8", 256, out=tied)
    assert shared.tolist() == [2.0] * 10
    one = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="out's leaves 0 and 1 share memory"):
        codec.decode_and_apply({"a": one, "b": one}, codec.encode({"a": one, "b": one}, "int8", 256), "int8", 256,
                               out={"a": one, "b": one})
    x, y = np.ones(5, np.float32), np.ones(5, np.float32)
    with pytest.raises(ValueError, match="out's leaf 1 shares memory with params' leaf 0"):
        codec.decode_and_apply({"a": x, "b": y}, codec.encode({"a": x, "b": y}, "int8", 256), "int8", 256,
                               out={"a": np.empty(5, np.float32), "b": x})


def test_int8_zero_blocks_are_exact_and_finite():
    rng = np.random.default_rng(1)
    t = rng.normal(size=(8, 64, 256)).astype(np.float32)
    t[3] = 0.0
    one = np.zeros((1000,), np.float32)
    one[617] = 1.0
    tree = {"t": t, "one": one}
    payload = codec.encode(tree, "int8", 256)
    decoded = codec.decode(payload, tree, "int8", 256)
    assert np.all(decoded["t"][3] == 0.0)
    np.testing.assert_array_equal(decoded["one"], one * (np.float32(127) * np.float32(1 / 127)))  # code 127 x scale 1/127
    for leaf in jax.tree.leaves(decoded):
        assert np.isfinite(leaf).all()
    # Scales sit after each leaf's codes; read them back raw.
    n_one = one.size
    scales = np.frombuffer(payload, "<f4", 4, n_one)
    assert np.isfinite(scales).all() and (scales >= 0).all()
    np.testing.assert_array_equal(scales, np.array([0.0, 0.0, 1 / 127, 0.0], np.float32))


@pytest.mark.parametrize("kind,per_element", [("none", 4), ("bf16", 2)])
def test_float_codecs(kind, per_element):
    tree = _tree()
    payload = codec.encode(tree, kind, 256)
    assert len(payload) == per_element * (1 + 5 + 21 + 60 + 16)
    decoded = codec.decode(payload, tree, kind, 256)
    for key, x in tree.items():
        expect = np.asarray(x, np.float32)
        if kind == "bf16":
            expect = expect.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(decoded[key], expect)


def test_wrong_size_and_kind_are_refused():
    tree = {"w": np.ones(10, np.float32)}
    with pytest.raises(codec.CodecError, match=r"payload is 3 bytes but a int8 \(block 256\) payload for these parameters is 14 bytes"):
        codec.decode(b"abc", tree, "int8", 256)
    with pytest.raises(codec.CodecError, match="unknown codec kind 'int2'"):
        codec.encode(tree, "int2", 256)


def test_int4_packs_two_codes_a_byte():
    x = {"w": np.asarray([1.0, -0.5, 0.25, 0.0, -1.0], np.float32)}
    payload = codec.encode(x, "int4", 4)
    assert len(payload) == codec.payload_bytes(x, "int4", 4) == 3 + 4 * 2  # ceil(5 / 2) codes + 2 scales
    decoded = codec.decode(payload, x, "int4", 4)["w"]
    # block [1, -0.5, 0.25, 0] has scale float32(1/7), a little above 1/7, so -0.5 / scale = -3.4999998:
    # codes 7, -3, 2, 0; block [-1]: scale 1/7, code -7
    np.testing.assert_array_equal(decoded, np.asarray([7, -3, 2, 0, -7], np.float32) * np.float32(1 / 7))


def test_error_feedback_removes_the_bias_of_int4():
    x = {"w": np.asarray([1.0, 0.3], np.float32)}  # one block; scale 1/7, 0.3 -> code 2 (2/7)
    plain = sum(codec.decode(codec.encode(x, "int4", 256), x, "int4", 256)["w"][1] for _ in range(10))
    assert plain == pytest.approx(10 * 2 / 7, rel=1e-6)  # 2.857: bias -0.143
    residual, total = {"w": np.zeros(2, np.float32)}, 0.0
    for _ in range(10):  # the encoder adds the residual, then overwrites it with what it lost
        payload = codec.ChunkEncoder(x, "int4", 256, residual=residual).tobytes()
        total += codec.decode(payload, x, "int4", 256)["w"][1]
    assert abs(total - 3.0) <= 1 / 14


@pytest.mark.parametrize("kind", codec.KINDS)
def test_chunk_encoder_builds_the_whole_payload_chunk_by_chunk_in_any_order(kind):
    rng = np.random.default_rng(1)
    tree = {**_tree(), "long": rng.normal(size=200_003).astype(np.float32)}  # several pieces, a short last block
    whole = codec.encode(tree, kind, 256)
    plan = codec.chunk_plan(tree, kind, 256, 48 * 1024 if kind != "topk" else 1024)  # topk: 5.7 kB in all
    assert len(plan) >= 3
    encoder = codec.ChunkEncoder(tree, kind, 256, plan)
    assert len(encoder) == len(whole)
    parts = {k: b"".join(encoder.chunk(k)) for k in reversed(range(len(plan)))}
    assert b"".join(parts[k] for k in range(len(plan))) == whole
    background = codec.ChunkEncoder(tree, kind, 256, plan).start()  # one thread, chunks in order
    assert b"".join(b"".join(background.chunk(k)) for k in range(len(plan))) == whole
    # An accelerator's path: one program on the device, chunks cut from its codes. XLA divides by a
    # block's scale as a multiplication by its reciprocal, so a code may round the other way.
    on_device = codec.ChunkEncoder(jax.tree.map(jnp.asarray, tree), kind, 256, plan, on_device=True).start()
    device = b"".join(b"".join(on_device.chunk(k)) for k in range(len(plan)))
    assert len(device) == len(whole)
    if kind not in codec.QUANTIZED_KINDS:
        assert device == whole
    else:
        got, want = codec.decode(device, tree, kind, 256), codec.decode(whole, tree, kind, 256)
        for name, x in tree.items():
            step = float(np.max(np.abs(np.asarray(x, np.float32)))) / codec.MAX_CODE[kind]
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=step * 1.0001)


def test_chunk_encoder_keeps_what_the_codec_lost_in_place():
    rng = np.random.default_rng(2)
    tree = {"w": rng.normal(size=70_000).astype(np.float32), "b": np.asarray([1.0, 0.3], np.float32)}
    old = {"w": rng.normal(size=70_000).astype(np.float32) * 0.01, "b": np.asarray([0.0, 0.1], np.float32)}
    expected = jax.tree.map(np.copy, old)
    whole = codec.ChunkEncoder(tree, "int4", 256, residual=expected)  # one chunk, on the host
    payload, error = whole.tobytes(), whole.relative_error
    residual = jax.tree.map(np.copy, old)
    plan = codec.chunk_plan(tree, "int4", 256, 16 * 1024)
    encoder = codec.ChunkEncoder(tree, "int4", 256, plan, residual).start()
    assert b"".join(b"".join(encoder.chunk(k)) for k in range(len(plan))) == payload
    for name in tree:  # intended - sent, bit for bit, written into the island's own buffers
        sent = codec.decode(payload, tree, "int4", 256)[name]
        np.testing.assert_array_equal(residual[name], (tree[name] + old[name]) - sent)
        np.testing.assert_array_equal(residual[name], expected[name])
    assert encoder.relative_error == pytest.approx(error, rel=1e-12)
    assert 0.05 < error < 0.2  # int4 of Gaussian blocks: about a tenth of the norm is lost
    on_device = jax.tree.map(np.copy, old)  # the accelerator's path keeps it too (up to fused multiply-adds)
    device = codec.ChunkEncoder(jax.tree.map(jnp.asarray, tree), "int4", 256, plan, on_device, on_device=True)
    sent = codec.decode(device.tobytes(), tree, "int4", 256)
    for name in tree:
        np.testing.assert_allclose(on_device[name], (tree[name] + old[name]) - sent[name], rtol=0, atol=1e-6)
    assert device.relative_error == pytest.approx(error, rel=1e-2)
