"""Outer step and token-weighted merge, through the coordinator's real path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import (
    ContributionError,
    ContributionHeader,
    FragmentCoordinator,
    HandshakeError,
    UpdateNotReady,
)
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.outer.optimizer import momentum_schedule, outer_optimizer


def _config(lr, momentum, nesterov, kind="none"):
    c = default_config()
    c.islands.a = island(4, 2, 2, 16, 10)
    c.islands.b = island(2, 1, 2, 8, 10)
    c.outer.learning_rate, c.outer.momentum, c.outer.nesterov = lr, momentum, nesterov
    c.codec.kind = kind
    return c


def _coordinator(config, start):
    coord = FragmentCoordinator(config, {"w": np.asarray(start, np.float32)}, ["a", "b"])
    for name in ("a", "b"):
        coord.join(name, fingerprint_fields(config), coord.checksum)
    return coord


def _round(coord, config, ends, tokens=(1000, 1000)):
    """Islands end the round at `ends`; returns the view after the update."""
    r = coord.round
    anchor = coord.view["w"]
    for name, end, t in zip(("a", "b"), ends, tokens):
        pg = {"w": anchor - np.asarray(end, np.float32)}
        coord.contribute(ContributionHeader(r, name, t), codec.encode(pg, config.codec.kind, config.codec.block_size))
    return coord.fetch_update(r, "a")


def test_sgd_lr1_is_parameter_averaging():
    config = _config(1.0, 0.0, False)
    coord = _coordinator(config, [1.0, 1.0])
    _round(coord, config, ([0.5, 1.5], [0.7, 1.1]))
    np.testing.assert_allclose(coord.state()["master"]["w"], [0.6, 1.3], rtol=1e-6)
    np.testing.assert_allclose(coord.view["w"], [0.6, 1.3], rtol=1e-6)


def test_nesterov_momentum_survives_between_rounds():
    config = _config(0.7, 0.9, True)
    coord = _coordinator(config, [1.0, 1.0])
    _round(coord, config, ([0.5, 1.5], [0.7, 1.1]))
    np.testing.assert_allclose(coord.state()["master"]["w"], [0.468, 1.399], rtol=1e-6)
    # The same pseudo-gradients again, relative to the new anchor.
    anchor = coord.view["w"]
    _round(coord, config, (anchor - [0.5, -0.5], anchor - [0.3, -0.1]))
    np.testing.assert_allclose(coord.state()["master"]["w"], [-0.2908, 1.9681], rtol=1e-6)


def test_token_weighting():
    config = _config(1.0, 0.0, False)
    coord = _coordinator(config, [1.0])
    _round(coord, config, ([0.4], [0.7]), tokens=(4096, 2048))
    np.testing.assert_allclose(coord.state()["master"]["w"], [0.5], rtol=1e-6)  # uniform would give 0.55


def test_same_update_bytes_for_every_island_and_view_follows_them():
    config = _config(0.7, 0.9, True, kind="int8")
    coord = _coordinator(config, np.linspace(-1, 1, 300))
    island_view = {"w": coord.view["w"].copy()}
    payload = _round(coord, config, (np.linspace(-1, 1, 300) * 0.9, np.linspace(-1, 1, 300) * 1.1 + 0.01))
    assert coord.fetch_update(0, "b") == payload
    island_view = codec.decode_and_apply(island_view, payload, "int8", config.codec.block_size)
    assert checksum(island_view) == checksum(coord.view)
    # What int8 lost is still in master - view, to be sent next round.
    assert np.abs(coord.state()["master"]["w"] - coord.view["w"]).max() > 0


def test_refuses_non_finite_and_wrong_round():
    config = _config(1.0, 0.0, False)
    coord = _coordinator(config, [1.0, 1.0])
    bad = codec.encode({"w": np.array([np.nan, 0.0], np.float32)}, "none", 256)
    with pytest.raises(ContributionError, match="NaN or Inf"):
        coord.contribute(ContributionHeader(0, "a", 10), bad)
    with pytest.raises(ContributionError, match="round 3 but the coordinator is at round 0"):
        coord.contribute(ContributionHeader(3, "a", 10), codec.encode({"w": np.zeros(2, np.float32)}, "none", 256))
    with pytest.raises(ContributionError, match="is 4 bytes"):
        coord.contribute(ContributionHeader(0, "a", 10), b"\0" * 4)
    with pytest.raises(UpdateNotReady):
        coord.fetch_update(0, "a")
    assert coord.pending == {}


def test_different_seed_is_refused_with_reason():
    config = _config(1.0, 0.0, False)
    coord = FragmentCoordinator(config, {"w": np.ones(2, np.float32)}, ["a", "b"])
    other = checksum({"w": np.full(2, 2.0, np.float32)})
    with pytest.raises(HandshakeError, match="parameter checksum .* same config.seed"):
        coord.join("a", fingerprint_fields(config), other)
    config_b = _config(1.0, 0.0, False)
    config_b.seed = 1
    with pytest.raises(HandshakeError, match=r"differs from the coordinator in seed \(theirs 1, here 0\)"):
        coord.join("b", fingerprint_fields(config_b), coord.checksum)


def test_round_record_has_pseudo_gradient_norms_and_cosine_similarity():
    config = _config(1.0, 0.0, False)
    coord = _coordinator(config, [0.0, 0.0])
    _round(coord, config, ([-1.0, 0.0], [-1.0, -1.0]))  # pseudo-gradients [1, 0] and [1, 1]
    rec = coord.history[-1]
    assert rec.pseudo_gradient_norm == {"a": 1.0, "b": pytest.approx(np.sqrt(2.0), rel=1e-7)}
    assert rec.cosine_similarity == {"a/b": pytest.approx(1 / np.sqrt(2.0), rel=1e-7)}
    assert rec.checksum == coord.checksum == checksum(coord.view)


def test_contribution_from_other_parameters_is_refused():
    config = _config(1.0, 0.0, False)
    coord = _coordinator(config, [0.0, 0.0])
    payload = codec.encode({"w": np.ones(2, np.float32)}, "none", 256)
    with pytest.raises(ContributionError, match="trained round 0 from parameters with checksum 0123456789abcdef"):
        coord.contribute(ContributionHeader(0, "a", 10, "0123456789abcdef"), payload)
    assert coord.pending == {}


def test_update_codec_relative_error_is_logged():
    config = _config(1.0, 0.0, False, kind="int8")
    coord = _coordinator(config, [0.0, 0.0])
    # Pseudo-gradients [1, 0.3] and [0.5, 0.3] arrive in int8 as [1, 38/127] and [0.5, 38/127]
    # (0.3 / (0.5/127) = 76.2 -> 76); their mean [0.75, 38/127] is the update (SGD lr 1). In int8 it
    # has scale 0.75/127 and 38/127 / (0.75/127) = 50.67 -> code 51: the view misses by 51 x 0.75/127 - 38/127.
    _round(coord, config, ([-1.0, -0.3], [-0.5, -0.3]))
    expected = (51 * 0.75 / 127 - 38 / 127) / np.hypot(0.75, 38 / 127)
    assert coord.history[-1].update_codec_relative_error == pytest.approx(expected, rel=1e-4)
    config = _config(1.0, 0.0, False, kind="none")
    coord = _coordinator(config, [0.0, 0.0])
    _round(coord, config, ([-1.0, -0.3], [-1.0, -0.3]))
    assert coord.history[-1].update_codec_relative_error == 0.0


@pytest.mark.parametrize("kind,chunk_bytes", [("int8", 4096), ("int4", None), ("bf16", 3000), ("none", None)])
def test_view_of_bfloat16_and_float32_leaves_is_what_islands_compute(kind, chunk_bytes):
    import ml_dtypes

    config = _config(0.7, 0.9, True, kind=kind)
    if chunk_bytes is not None:  # leaves cut over several chunks: the checksum reads each leaf from many rows
        config.comm.chunk_bytes = chunk_bytes
    rng = np.random.default_rng(3)
    params = {
        "w": rng.normal(size=(70, 300)).astype(ml_dtypes.bfloat16),  # 21,000 elements: several pieces for int8
        "b": rng.normal(size=77).astype(np.float32),
    }
    coord = FragmentCoordinator(config, params, ["a", "b"])
    for name in ("a", "b"):
        coord.join(name, fingerprint_fields(config), coord.checksum)
    island_view = {k: np.array(v, copy=True) for k, v in params.items()}
    for r in range(3):
        for name, shift in (("a", 0.01), ("b", -0.02)):
            pg = {k: (rng.normal(size=np.shape(v)) * shift).astype(np.float32) for k, v in params.items()}
            coord.contribute(ContributionHeader(r, name, 100), codec.encode(pg, kind, config.codec.block_size))
        island_view = codec.decode_and_apply(island_view, coord.fetch_update(r, "a"), kind, config.codec.block_size)
        assert {k: v.dtype for k, v in coord.view.items()} == {"w": ml_dtypes.bfloat16, "b": np.float32}
        assert checksum(coord.view) == checksum(island_view) == coord.history[-1].checksum == coord.checksum


def test_outer_momentum_warms_up_linearly_with_one_state_structure():
    c = default_config()
    c.outer.update(learning_rate=1.0, momentum=0.9, nesterov=True, momentum_warmup_rounds=4)
    tx = outer_optimizer(c)
    state = tx.init(jnp.zeros(1, jnp.float32))
    used, updates, traces = [], [], []
    for _ in range(6):  # the same pseudo-gradient g = [1.0] every round, from m = 0
        update, state = tx.update(jnp.ones(1, jnp.float32), state)
        used.append(float(state.hyperparams["momentum"]))  # the momentum this round's update used
        updates.append(float(update[0]))
        traces.append(float(state.inner_state[0].trace[0]))
    np.testing.assert_allclose(used, [0.0, 0.225, 0.45, 0.675, 0.9, 0.9], rtol=1e-6)
    np.testing.assert_allclose(traces[:2], [1.0, 1.225], rtol=1e-6)  # m_1 = 0.225 x 1.0 + 1.0
    np.testing.assert_allclose(updates[:2], [-1.0, -1.275625], rtol=1e-6)  # -(1.0 + 0.225 x 1.225)
    plain = default_config()
    plain.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    zero = outer_optimizer(plain).init(jnp.zeros(1, jnp.float32))
    assert jax.tree.structure(zero) == jax.tree.structure(state)  # checkpoints keep their shape
    update, _ = outer_optimizer(plain).update(jnp.full(1, 0.3, jnp.float32), zero)
    assert float(update[0]) == -np.float32(0.3)  # plain averaging, exactly


def test_checkpoint_state_is_read_in_place_and_never_written_again():
    """`state()` gives a checkpoint the optimizer state as read-only views of the coordinator's own arrays (no
    copy), and the master and view laid out afresh; a later round replaces the arrays, so a snapshot taken before
    it keeps the values it had."""
    config = _config(0.7, 0.9, True, kind="int8")
    coord = _coordinator(config, np.linspace(-1.0, 1.0, 3000))
    snapshot = coord.state()
    held = jax.tree.leaves(coord._state.opt)
    views = jax.tree.leaves(snapshot["opt_state"])
    assert len(views) == len(held) > 0
    for view, array in zip(views, held):
        assert isinstance(view, np.ndarray) and not view.flags.writeable
        assert view.ctypes.data == array.unsafe_buffer_pointer()  # the same bytes, not a copy
    before = jax.tree.map(np.array, snapshot)
    assert coord.state()["view"]["w"] is not snapshot["view"]["w"]  # laid out at each call
    _round(coord, config, (np.full(3000, 0.5), np.full(3000, -0.25)))
    after = coord.state()
    assert not np.array_equal(after["master"]["w"], before["master"]["w"])  # the round moved the state ...
    jax.tree.map(np.testing.assert_array_equal, snapshot, before)  # ... and left the snapshot as it was


def test_round_record_has_the_outer_learning_rate_and_the_warmed_up_momentum_it_used():
    config = _config(0.7, 0.9, True)
    config.outer.momentum_warmup_rounds = 4
    coord = _coordinator(config, [1.0, 1.0])
    for _ in range(6):
        _round(coord, config, ([0.5, 1.5], [0.7, 1.1]))
    schedule = momentum_schedule(0.9, 4)
    used = [(rec.outer_learning_rate, rec.outer_momentum) for rec in coord.history]
    assert used == [(float(np.float32(0.7)), float(schedule(jnp.int32(r)))) for r in range(6)]
    assert [m for _, m in used] == pytest.approx([0.0, 0.225, 0.45, 0.675, 0.9, 0.9], rel=1e-6)  # 0.9 x min(r / 4, 1)
    from island_jax.roles.coordinator import _round_record  # the coordinator's metrics record of a round

    logged = _round_record(coord.history[2], 2, 0, {}, 1.0)
    assert (logged["round"], logged["outer_learning_rate"], logged["outer_momentum"]) == (3, *used[2])
