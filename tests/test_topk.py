"""The topk codec (SparseLoCo, arXiv 2508.15706): the bytes of a top-k leaf, one group's decoding, error feedback
on a sparse signal, one chunk plan both ways, the coordinator's sparse merge and top-k update, and the join's check
of `codec.update_kind`."""

import math

import jax
import numpy as np
import pytest

from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, FragmentCoordinator, HandshakeError
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.outer.codec import topk


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096, 4096 + 10, 3 * 4096, 3 * 4096 + 100, 10_000])
def test_a_leaf_costs_the_sum_over_its_groups_of_the_packed_values_and_a_scale(n):
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    expected = sum(math.ceil(min(64, len(x[s:s + 4096])) * 14 / 8) + 4 for s in range(0, n, 4096))
    assert len(topk.encode(x, 4096, 64)) == topk.leaf_bytes(n, 4096, 64) == expected


def test_a_full_group_of_4096_with_k_64_is_116_bytes():
    assert topk.group_bytes(4096, 4096, 64) == 116
    assert round(116 * 8 / 4096, 3) == 0.227 and round(112 * 8 / 4096, 3) == 0.219  # with and without the scale


def test_one_group_decodes_to_its_64_largest_values_as_the_nearer_of_s_over_3_and_s():
    rng = np.random.default_rng(0)
    x = rng.normal(size=4096).astype(np.float32)
    out = topk.decode(topk.encode(x, 4096, 64), 4096, 4096, 64)
    largest = np.argsort(-np.abs(x), kind="stable")[:64]
    assert set(np.flatnonzero(out)) == set(largest)
    s = np.float32(np.abs(x[largest]).max())
    near = np.where(np.abs(np.abs(x[largest]) - s) <= np.abs(np.abs(x[largest]) - s / np.float32(3)), s,
                    s / np.float32(3))
    np.testing.assert_array_equal(out[largest], np.sign(x[largest]) * near)
    assert np.count_nonzero(out) == 64 and out.dtype == np.float32


def test_error_feedback_carries_a_sparse_signal_of_twice_k_within_10_percent_in_20_rounds():
    rng = np.random.default_rng(1)
    x = np.zeros(4096, np.float32)
    x[rng.choice(4096, 128, replace=False)] = rng.normal(size=128)
    residual = {"x": np.zeros_like(x)}  # what the codec left out so far, kept by the encoder
    sent = np.zeros_like(x)
    for _ in range(20):
        buf = codec.ChunkEncoder({"x": x}, codec.Codec("topk", 256, 4096, 64), residual=residual).tobytes()
        sent += topk.decode(buf, 4096, 4096, 64)
    error = np.linalg.norm(sent - 20 * x) / np.linalg.norm(20 * x)
    assert error < 0.10, error


def test_bytes_of_another_length_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"a topk leaf of 4096 values \(group 4096, k 64\) is 116 bytes, not 115"):
        topk.decode(bytes(115), 4096, 4096, 64)


# -- the topk codec on the chunked wire, the coordinator's merge and update (codec.kind / codec.update_kind) --------


TOPK = codec.Codec("topk", 256, 4096, 64)


def _formula(n, group=4096, k=64):
    return sum(math.ceil(min(k, min(group, n - s)) * 14 / 8) + 4 for s in range(0, n, group))


def test_the_codec_encodes_a_tree_in_the_bytes_of_the_formula_and_decodes_what_topk_keeps():
    rng = np.random.default_rng(2)
    sizes = {"a": 1, "b": 40, "c": 4096, "d": 4096 + 40, "e": 3 * 4096 + 100, "f": 300_000}  # 40 < k: short groups
    tree = {name: rng.normal(size=n).astype(np.float32) for name, n in sizes.items()}
    payload = codec.encode(tree, TOPK)
    assert len(payload) == codec.payload_bytes(tree, TOPK) == sum(_formula(n) for n in sizes.values())
    decoded = codec.decode(payload, tree, TOPK)
    for name, x in tree.items():
        np.testing.assert_array_equal(decoded[name], topk.decode(topk.encode(x, 4096, 64), x.size, 4096, 64))
    assert np.count_nonzero(decoded["b"]) == 40 and np.count_nonzero(decoded["d"]) == 64 + 40


def test_one_plan_both_ways_is_cut_by_the_costlier_codec():
    # top-k up, int8 down: 2,000,000 values are 56,724 bytes of top-k but 2.03 MB of int8; cut by top-k's bytes
    # alone, one 200 kB chunk would carry all of them, and its int8 update chunk would be 2 MB. Cut by int8's, the
    # 31 pieces of 65,536 values (66,560 bytes of int8) go three to a chunk, the first with leaf b's 81 bytes.
    tree = {"w": np.zeros(2_000_000, np.float32), "b": np.zeros(77, np.float32)}
    int8 = codec.Codec("int8", 256)
    up = codec.chunk_plan(tree, TOPK, None, 200_000, int8)
    down = codec.chunk_plan(tree, int8, None, 200_000, TOPK)
    assert len(up) == len(down) == 11
    for a, b in zip(up, down):
        assert [(p.leaf, p.start, p.stop) for p in a.pieces] == [(p.leaf, p.start, p.stop) for p in b.pieces]
        assert a.nbytes <= 200_000 and b.nbytes <= 200_000
        assert all(p.start % 4096 == 0 for p in a.pieces)  # whole groups up, whole blocks down
    assert sum(c.nbytes for c in up) == codec.payload_bytes(tree, TOPK) == _formula(2_000_000) + _formula(77)
    assert sum(c.nbytes for c in down) == codec.payload_bytes(tree, int8) == 2_000_077 + 4 * (7813 + 1)


def _topk_config(update_kind, chunk_bytes):
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.update(kind="topk", update_kind=update_kind, topk_group=512, topk_k=16)
    c.comm.chunk_bytes = chunk_bytes
    c.outer.update(learning_rate=0.7, momentum=0.9, nesterov=True)
    return c


def _rounds(config, rounds=3):
    """`rounds` rounds of two islands with top-k contributions (error feedback on); returns (each round's update
    bytes, the coordinator, the islands' parameters after the last update)."""
    rng = np.random.default_rng(5)
    params = {"w": rng.normal(size=(300, 70)).astype(np.float32), "b": rng.normal(size=600).astype(np.float32)}
    coord = FragmentCoordinator(config, params, ["a", "b"])
    for name in ("a", "b"):
        coord.join(name, fingerprint_fields(config), coord.checksum)
    up = codec.Codec.of(config.codec)
    down = codec.Codec.of(config.codec, update=True)
    plan = codec.chunk_plan(params, up, None, config.comm.chunk_bytes, down)
    residual = {n: {k: np.zeros(v.size, np.float32) for k, v in params.items()} for n in ("a", "b")}
    held = {n: dict(params) for n in ("a", "b")}
    updates = []
    for r in range(rounds):
        for name, tokens in (("a", 300), ("b", 100)):
            pg = {k: (rng.normal(size=v.shape) * 0.01).astype(np.float32) for k, v in params.items()}
            payload = codec.ChunkEncoder(pg, up, None, plan, residual=residual[name]).tobytes()
            assert coord.contribute(ContributionHeader(r, name, tokens), payload) == "accepted"
        update = coord.fetch_update(r, "a")
        assert len(update) == codec.payload_bytes(params, down) == coord.update_bytes
        updates.append(update)
        for name in held:
            held[name] = codec.decode_and_apply(held[name], update, down)
            assert checksum(held[name]) == coord.checksum == coord.history[-1].checksum, (r, name)
    return updates, coord, held["a"]


@pytest.mark.parametrize("update_kind", ["topk", "int8", "none"])
def test_topk_contributions_merged_chunk_by_chunk_equal_a_whole_payload_merge_bit_for_bit(update_kind):
    chunked, coord, _ = _rounds(_topk_config(update_kind, 1024))
    whole, one, _ = _rounds(_topk_config(update_kind, 1 << 30))
    assert len(coord.plan) >= 2 and len(one.plan) == 1
    assert chunked == whole
    for key in ("w", "b"):
        np.testing.assert_array_equal(coord.state()["master"][key], one.state()["master"][key])
    assert coord.checksum == one.checksum


def test_a_topk_update_keeps_every_island_on_the_view_and_carries_the_drift_into_the_next_round():
    config = _topk_config("topk", 4096)
    updates, coord, held = _rounds(config, rounds=2)
    state = coord.state()
    drift = {k: state["master"][k] - coord.view[k] for k in ("w", "b")}
    assert 0 < coord.history[-1].update_codec_relative_error < 1  # the update is sparse: it left drift behind
    # A round of zero pseudo-gradients with no momentum leaves the master where it is, so its update is the top-k
    # of the drift alone: what the last update left out is sent now, not lost.
    config.outer.update(momentum=0.0, nesterov=False)
    still = FragmentCoordinator(config, coord.view, ["a", "b"])
    still.load_state(dict(state, opt_state=[
        jax.tree.map(np.zeros_like, s) for s in still.state()["opt_state"]]))
    for name in ("a", "b"):
        still.join(name, fingerprint_fields(config), still.checksum, round=2)
        zero = {k: np.zeros(np.shape(v), np.float32) for k, v in coord.view.items()}
        still.contribute(ContributionHeader(2, name, 100), codec.encode(zero, codec.Codec.of(config.codec)))
    update = still.fetch_update(2, "a")
    assert update == codec.encode(drift, codec.Codec.of(config.codec, update=True))
    assert checksum(codec.decode_and_apply(held, update, codec.Codec.of(config.codec, update=True))) == still.checksum


def test_islands_and_a_coordinator_that_disagree_on_the_update_codec_are_refused_at_the_join():
    config = _topk_config("topk", 4096)
    coord = FragmentCoordinator(config, {"w": np.zeros(10, np.float32)}, ["a", "b"])
    other = _topk_config("int8", 4096)
    with pytest.raises(HandshakeError, match=r"codec.update_kind \(theirs 'int8', here 'topk'\)"):
        coord.join("a", fingerprint_fields(other), coord.checksum)
    same = _topk_config("", 4096)  # "" is codec.kind's: the same codec
    coord.join("b", fingerprint_fields(same), coord.checksum)


def test_error_feedback_decay_carries_beta_of_what_was_lost():
    rng = np.random.default_rng(7)
    x = {"w": rng.normal(size=5000).astype(np.float32)}
    kept = rng.normal(size=5000).astype(np.float32)
    residual = {"w": kept.copy()}
    payload = codec.ChunkEncoder(x, TOPK, None, residual=residual, decay=0.95).tobytes()
    intended = x["w"] + np.float32(0.95) * kept
    assert payload == codec.encode({"w": intended}, TOPK)
    np.testing.assert_array_equal(residual["w"], intended - codec.decode(payload, x, TOPK)["w"])


@pytest.mark.parametrize("kind,update_kind", [("int8", "bf16"), ("int4", "int8"), ("topk", "int8"), ("none", "topk")])
def test_a_paired_codecs_whole_payload_is_the_one_its_chunks_make(kind, update_kind):
    # int8 alone cuts pieces of 65,536 values, bf16 of 32,768: paired, both payloads use the pieces they share,
    # whether encoded whole (encode, decode, decode_and_apply) or chunk by chunk
    c = default_config()
    c.codec.update(kind=kind, update_kind=update_kind)
    up, down = codec.Codec.of(c.codec), codec.Codec.of(c.codec, update=True)
    assert up.piece == down.piece > 0
    rng = np.random.default_rng(3)
    tree = {"w": rng.normal(size=300_001).astype(np.float32), "b": rng.normal(size=77).astype(np.float32)}
    for fmt, other in ((up, down), (down, up)):
        plan = codec.chunk_plan(tree, fmt, None, 65536, other)
        whole = codec.encode(tree, fmt)
        assert codec.ChunkEncoder(tree, fmt, None, plan).tobytes() == whole
        decoded = codec.decode(whole, tree, fmt)
        assert all(np.isfinite(v).all() for v in decoded.values())
        applied = codec.decode_and_apply({k: np.zeros_like(v) for k, v in tree.items()}, whole, fmt)
        np.testing.assert_array_equal(applied["w"], decoded["w"])
        if fmt.kind in ("none", "bf16", "int8"):  # dense kinds: within one quantization step of the values
            np.testing.assert_allclose(decoded["w"], tree["w"], atol=float(np.abs(tree["w"]).max()) / 127 * 1.01)


def test_dense_codecs_alone_keep_their_pieces():
    assert codec.piece_elements("int8", 256) == 65536 and codec.piece_elements("int4", 256) == 131072
    assert codec.piece_elements("int4", 9) == 262134 and codec.piece_elements("int4", 40001) == 240006
    assert codec.Codec.of(default_config().codec).piece == 0


def test_a_nan_in_a_topk_pseudo_gradient_is_refused_by_the_coordinator():
    from island_jax.coordinator import ContributionError

    config = _topk_config("topk", 4096)
    coord = FragmentCoordinator(config, {"w": np.zeros(5000, np.float32)}, ["a", "b"])
    coord.join("a", fingerprint_fields(config), coord.checksum)
    pg = {"w": np.ones(5000, np.float32)}
    pg["w"][4100] = np.nan
    with pytest.raises(ContributionError, match="holds NaN or Inf"):
        coord.contribute(ContributionHeader(0, "a", 10), codec.encode(pg, codec.Codec.of(config.codec)))


def test_a_group_and_a_block_neither_a_multiple_of_the_other_are_refused_with_two_codecs():
    from island_jax.config import ConfigError, validate

    config = _topk_config("int8", 4096)
    config.codec.update(topk_group=3000, topk_k=16)
    with pytest.raises(ConfigError, match=r"codec\.topk_group is 3000 and codec\.block_size 256: .* one must be a "
                                          r"multiple of the other"):
        validate(config)
    config.codec.update_kind = "topk"  # one codec both ways: any group
    validate(config)
