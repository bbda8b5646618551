"""Islands with an fsdp axis: what is sharded where, the same training as fsdp = 1, islands of both layouts in
one run, and a resume."""

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from processes import shared_folder
from tiny_config import get_config, write_corpus

from island_jax.checkpoint import CheckpointError
from island_jax.island import Island
from island_jax.island import step as step_lib
from island_jax.metrics import read_jsonl
from island_jax.model.init import init_params
from island_jax.run import run_in_process

ROUNDS = 2


def config(tmp, fsdp_a: int):
    """The tiny two-island config over 2 rounds; island a (4 devices, batch 8) at data=2 x fsdp=1 x expert=2,
    or at data=1 x fsdp=2 x expert=2 (`fsdp_a` = 2); island b stays data=1 x fsdp=1 x expert=2."""
    c = get_config()
    c.data.files = write_corpus(tmp / "corpus")
    c.outer.rounds = ROUNDS
    c.eval.every_rounds = ROUNDS
    c.islands.a.mesh.update(data=4 // (2 * fsdp_a), fsdp=fsdp_a, expert=2)
    return c


def records(workdir, role, kind):
    return [r for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{fsdp of island a: its run's workdir}, for 1 and 2 (made once per pytest run, `shared_folder`)."""

    def make(fsdp):
        return lambda folder: run_in_process(config(folder, fsdp), str(folder / "workdir"))

    return {fsdp: shared_folder(tmp_path_factory, f"fsdp{fsdp}", make(fsdp)) / "workdir" for fsdp in (1, 2)}


def test_parameters_gradients_moments_and_anchor_are_sharded_over_fsdp(tmp_path):
    c = config(tmp_path, 2)
    graphdef, params, specs = init_params(c)
    # every parameter with an embed dimension over fsdp on its leading non-expert dimension, the routed experts over
    # expert, the rest whole
    assert specs["embedding"] == P("fsdp", None) and specs["position"] == P("fsdp", None)
    assert specs["head"]["kernel"] == P("fsdp", None)
    block = specs["blocks"][0]
    assert block["attn"]["qkv"]["kernel"] == P("fsdp", None) and block["attn"]["out"]["kernel"] == P("fsdp", None)
    assert block["attn_norm"]["scale"] == P(None)
    assert block["moe"]["router"] == P("fsdp", None)
    assert block["moe"]["w_gate"] == block["moe"]["w_up"] == P("expert", "fsdp", None)
    assert block["moe"]["w_down"] == P("expert", "fsdp", None)

    corpus = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    island = Island("a", c, jax.devices()[:4], graphdef, params, specs, corpus, ROUNDS)
    state = island.opt_state
    moments = [optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")]
    inputs, targets, _ = island.shardings.batch_of(island.dataset[0], island.batch_size)
    with jax.set_mesh(island.mesh):
        grads = jax.jit(jax.grad(lambda p: step_lib.loss_fn(graphdef, p, inputs, targets, c.moe)[0]))(island.params)
    for tree in (island.params, island.anchor, grads, *moments):
        for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(specs), strict=True):
            assert leaf.sharding.spec == spec, jax.tree_util.keystr(path)
            # each device holds 1/fsdp of an embed-sharded leaf (and 1/expert more of an expert's)
            split = [1 if s is None else island.mesh.shape[s] for s in spec] + [1] * (leaf.ndim - len(spec))
            assert leaf.addressable_shards[0].data.shape == tuple(n // k for n, k in zip(leaf.shape, split))


def test_fsdp_two_trains_as_fsdp_one_on_the_same_devices_and_batch(runs):
    one, two = runs[1], runs[2]
    first_round = [r["loss"] for r in records(one, "islands/a", "inner") if r["round"] == 1]
    assert len(first_round) == 2
    np.testing.assert_allclose([r["loss"] for r in records(two, "islands/a", "inner") if r["round"] == 1],
                               first_round, rtol=1e-5)
    (eval_one,) = [r["eval_loss"] for r in records(one, "islands/a", "round") if "eval_loss" in r and r["round"] == 2]
    (eval_two,) = [r["eval_loss"] for r in records(two, "islands/a", "round") if "eval_loss" in r and r["round"] == 2]
    np.testing.assert_allclose(eval_two, eval_one, rtol=1e-4)


@pytest.mark.parametrize("fsdp", [1, 2])
def test_every_island_holds_the_coordinators_view_after_every_round(runs, fsdp):
    """With fsdp = 2, island a (data=1 x fsdp=2 x expert=2) and island b (fsdp=1) hold the same bits."""
    view = [r["checksum"] for r in records(runs[fsdp], "coordinator", "round")]
    assert len(view) == ROUNDS and len(set(view)) == ROUNDS
    for name in ("a", "b"):
        assert [r["checksum"] for r in records(runs[fsdp], f"islands/{name}", "round")] == view


def test_a_stopped_fsdp_run_resumes_to_the_checksums_of_one_without_a_stop(runs, tmp_path):
    c = config(tmp_path, 2)
    c.islands.a.crash_at_round = 2
    workdir = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="island a crashes at round 2 on purpose"):
        run_in_process(c, str(workdir))
    c.islands.a.crash_at_round = 0
    summary = run_in_process(c, str(workdir))
    assert summary["checksums_agree"] is True
    for role in ("coordinator", "islands/a", "islands/b"):
        resumed = {r["round"]: r["checksum"] for r in records(workdir, role, "round")}
        assert resumed == {r["round"]: r["checksum"] for r in records(runs[2], role, "round")}


def test_the_residual_is_saved_as_its_owners_rows_and_refused_under_other_owners(tmp_path):
    c = config(tmp_path, 2)
    c.codec.update(kind="int4", error_feedback=True)
    graphdef, params, specs = init_params(c)
    corpus = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    island = Island("a", c, jax.devices()[:4], graphdef, params, specs, corpus, ROUNDS)
    chunk = island.ownerships[0].share[0]  # one chunk of every piece (the default comm.chunk_bytes)
    piece = chunk.pieces[3]
    kept = np.arange(piece.stop - piece.start, dtype=np.float32)
    island.residual[(0, piece.leaf, piece.start)] = kept
    state = island.state(1)
    # one process owns every piece: one row of every element, this piece's values at its place in the row
    elements = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    before = sum(p.stop - p.start for p in chunk.pieces[:3])
    row = np.asarray(state["residual"])
    assert row.shape == (1, -(-elements // 4) * 4)  # rounded up to a multiple of the 4 devices, which split it
    assert state["residual"].sharding.shard_shape(row.shape) == (1, row.shape[1] // 4)
    assert np.array_equal(row[0, before : before + kept.size], kept)
    assert np.count_nonzero(row) == kept.size - 1  # arange's first value is 0
    again = Island("a", c, jax.devices()[:4], graphdef, params, specs, corpus, ROUNDS)
    assert again.load_state(jax.device_get(state)) == 1
    assert list(again.residual) == [(0, piece.leaf, piece.start)]
    np.testing.assert_array_equal(again.residual[(0, piece.leaf, piece.start)], kept)
    # a checkpoint whose pieces were owned otherwise (here: by 2 processes, as its layout bytes say) is refused
    layout = bytearray(np.asarray(state["residual_layout"]).tobytes())
    layout[0] ^= 1
    layout[16:] = b"2 processes, data=2 fsdp=1 expert=2".ljust(len(layout) - 16, b"\0")
    with pytest.raises(CheckpointError, match=re.escape(
            "island a's checkpoint holds the error-feedback residual of the chunks each process owned under another "
            "layout (2 processes, data=2 fsdp=1 expert=2) than this run's (1 process, data=1 fsdp=2 expert=2); "
            "resume with that layout, or start a new --workdir")):
        again.load_state(dict(jax.device_get(state), residual_layout=np.frombuffer(bytes(layout), np.uint8)))
