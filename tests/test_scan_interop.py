"""`model.scan_layers` where blocks are addressed by index: the checksum (on the per-layer form), routing biases
per layer, the KV-cache sampler, the safetensors export and loader (one tensor per block either way), and
checkpoint resume (under the layout a run started with, and no other)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from processes import shared_folder
from tiny_config import get_config, write_corpus

from island_jax import export, sample
from island_jax.config import ConfigChangeError
from island_jax.island.shards import HostLeaf, LeafLayout
from island_jax.mesh import island_mesh
from island_jax.metrics import read_jsonl
from island_jax.model import load, stacking
from island_jax.model.init import checksum, init_params
from island_jax.model.transformer import update_routing_biases
from island_jax.run import run_in_process

RTOL = 1e-5  # float32 scanned against unrolled: the same-numbers tolerance for the loss
PROMPT = np.frombuffer(b"def self(:", np.uint8).astype(np.int32)  # byte ids of the tiny corpus's words
NEW_TOKENS = 16


def _config(scan_layers: bool, rounds: int = 2):
    """The tiny two-island config with 5 blocks, MoE in every 2nd: scanned, 2 units of (dense, MoE) and a dense
    tail block; with routing biases (aux-loss-free balancing) on."""
    c = get_config()
    c.model.update(num_layers=5, scan_layers=scan_layers)
    c.moe.update(every_n_layers=2, routing_bias_update_rate=0.01)
    c.outer.rounds = rounds
    return c


@pytest.fixture(scope="module")
def scanned_run(tmp_path_factory):
    """A finished scanned run of 2 rounds, a checkpoint after each: (its config, its workdir), made once per pytest
    run (`shared_folder`)."""

    def config_of(folder):
        c = _config(True)
        c.data.files = str(folder / "corpus" / "*.py")
        return c

    def make(folder):
        write_corpus(folder / "corpus")
        run_in_process(config_of(folder), str(folder / "workdir"))

    folder = shared_folder(tmp_path_factory, "scan_interop", make)
    return config_of(folder), folder / "workdir"


def _stacked_and_per_layer():
    """A stacked dict (`layers` of n = 2, U = 3; one `tail` block) whose slices (20,000 and 6 elements) end inside
    checksum pieces, and its per-layer form written out by hand (copies, block i = u n + j)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4, 5000)).astype(np.float32)
    bias = rng.standard_normal((3, 6)).astype(np.float32)
    tail = rng.standard_normal((4, 5000)).astype(np.float32)
    embedding = rng.standard_normal((3, 4)).astype(np.float32)
    stacked = {"embedding": embedding, "layers": {0: {"w": w}, 1: {"moe": {"routing_bias": bias}}}, "tail": {0: {"w": tail}}}
    blocks = {}
    for u in range(3):
        blocks[2 * u] = {"w": w[u].copy()}
        blocks[2 * u + 1] = {"moe": {"routing_bias": bias[u].copy()}}
    blocks[6] = {"w": tail.copy()}
    return stacked, {"embedding": embedding, "blocks": blocks}


def test_the_checksum_of_stacked_parameters_is_that_of_their_per_layer_form():
    stacked, per_layer = _stacked_and_per_layer()
    assert checksum(stacked) == checksum(per_layer) == checksum(stacking.unstack(stacked))
    assert checksum(stacked) != checksum(jax.tree.leaves(stacked))  # a list of leaves is hashed as given
    # sharded on meshes: the stacked axis whole, a slice's elements split over fsdp on a later dimension (its rows
    # runs of their own on the last); and as each process's host copy (`HostLeaf`), read in place alike
    for data, fsdp, expert in [(1, 2, 2), (2, 4, 1)]:
        mesh = island_mesh(data, expert, jax.devices()[: data * fsdp * expert], fsdp=fsdp)
        specs = {"embedding": P(), "layers": {0: {"w": P(None, "fsdp")}, 1: {"moe": {"routing_bias": P()}}},
                 "tail": {0: {"w": P(None, "fsdp")}}}
        placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), stacked, specs,
                              is_leaf=lambda x: isinstance(x, P))
        assert checksum(placed) == checksum(per_layer), (data, fsdp, expert)
        cols = dict(placed, layers={0: {"w": jax.device_put(stacked["layers"][0]["w"], NamedSharding(mesh, P(
            None, None, "fsdp")))}, 1: placed["layers"][1]})
        assert checksum(cols) == checksum(per_layer), (data, fsdp, expert)
        host = jax.tree.map(lambda x: HostLeaf.of(LeafLayout(x.shape, x.dtype, x.sharding), x), cols)
        assert checksum(host) == checksum(per_layer), (data, fsdp, expert)


def test_a_scanned_model_drawn_whole_or_sharded_has_the_unrolled_models_checksum():
    _, unrolled, _ = init_params(_config(False))
    _, scanned, _ = init_params(_config(True))
    assert stacking.is_stacked(scanned) and not stacking.is_stacked(unrolled)
    assert checksum(scanned) == checksum(unrolled)
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)  # (data 1, fsdp 2, expert 2)
    _, sharded, _ = init_params(_config(True), mesh)
    assert not sharded["layers"][1]["moe"]["w_gate"].sharding.is_fully_replicated
    assert checksum(sharded) == checksum(unrolled)


def test_routing_biases_update_per_layer_alike_scanned_and_unrolled():
    _, unrolled, _ = init_params(_config(False))
    _, scanned, _ = init_params(_config(True))
    load_ = np.array([[0.5, 0.25, 0.125, 0.125], [0.125, 0.125, 0.25, 0.5]], np.float32)  # [MoE layers, experts]
    moved = update_routing_biases(unrolled, jnp.asarray(load_), 0.25)  # a rate of 0.25: exact steps
    moved_scanned = update_routing_biases(scanned, jnp.asarray(load_), 0.25)
    per_layer = stacking.unstack(moved_scanned)
    step = np.array([[-0.25, 0.0, 0.25, 0.25], [0.25, 0.25, 0.0, -0.25]], np.float32)  # rate x sign(0.25 - load)
    for k, block in enumerate((1, 3)):  # the MoE blocks, each moved by its own layer's load
        before = unrolled["blocks"][block]["moe"]["routing_bias"]
        assert np.asarray(moved["blocks"][block]["moe"]["routing_bias"]).tolist() == (before + step[k]).tolist()
        assert np.asarray(per_layer["blocks"][block]["moe"]["routing_bias"]).tolist() == (before + step[k]).tolist()
    assert checksum(moved) == checksum(moved_scanned) != checksum(unrolled)


def _logits(config, params, tokens):
    """float32 [1, S, V] logits of `tokens` [1, S] (no jitter, no capacity drops) on one device."""
    from flax import nnx

    graphdef, _, _ = init_params(sample._sampling_config(config))
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        return np.asarray(jax.jit(lambda q, t: nnx.merge(graphdef, nnx.State(q))(t)[0])(params, tokens))


def test_an_export_does_not_depend_on_the_layout(scanned_run, tmp_path):
    from safetensors.numpy import load_file

    config, workdir = scanned_run
    done = export.export(str(workdir), str(tmp_path / "export"))
    _, params, round = load.from_workdir(str(workdir))
    assert round == 2 and stacking.is_stacked(params)
    # one tensor per block, bit for bit the slices of the stacked parameters
    tensors = load_file(done["weights"])
    expected = {".".join(str(k) for k in path): leaf for path, leaf in _flat(stacking.unstack(params))}
    unrolled_names = [".".join(str(k) for k in path) for path, _ in _flat(init_params(_config(False))[1])]
    assert sorted(tensors) == sorted(expected) == sorted(unrolled_names)  # the names an unscanned run exports
    assert {k.split(".")[0] for k in tensors} == {"blocks", "embedding", "final_norm", "head", "position"}
    assert tensors["blocks.3.moe.w_gate"].shape == params["layers"][1]["moe"]["w_gate"].shape[1:]
    for name, leaf in expected.items():
        assert tensors[name].dtype == leaf.dtype and tensors[name].tobytes() == leaf.tobytes(), name
    # the checksum is the per-layer form's: the export's, the coordinator's final view's, island b's after round 2
    (last,) = [r for r in read_jsonl(workdir / "islands" / "b" / "metrics.jsonl") if r["kind"] == "round" and r["round"] == 2]
    coordinator = json.loads((workdir / "coordinator" / "summary.json").read_text())
    assert done["checksum"] == checksum(params) == checksum(stacking.unstack(params)) == last["checksum"]
    assert done["checksum"] == coordinator["checksum"]

    # loaded into either layout: scanned, the checkpoint's bits; unrolled, logits within the tolerance
    scan_config, stacked = load.from_export(str(tmp_path / "export"))
    assert scan_config.model.scan_layers and stacking.is_stacked(stacked)
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    flat_config, unrolled = load.from_export(str(tmp_path / "export"), scan_layers=False)
    assert not flat_config.model.scan_layers and not stacking.is_stacked(unrolled)
    assert checksum(unrolled) == done["checksum"]
    tokens = np.frombuffer(b"class Foo(self):\n    return self", np.uint8).astype(np.int32)[None]
    scan_logits = _logits(scan_config, stacked, tokens)
    np.testing.assert_allclose(_logits(flat_config, unrolled, tokens), scan_logits, rtol=RTOL)

    # the KV-cache sampler: the same greedy tokens both ways, up to the first step whose top-2 margin is within
    # the tolerance (where the two may rightly choose differently)
    greedy = sample.generate(scan_config, stacked, PROMPT, NEW_TOKENS, temperature=0)[0]
    assert greedy.tolist() == sample.greedy_without_cache(scan_config, stacked, PROMPT, NEW_TOKENS).tolist()
    assert sample.generate(scan_config, unrolled, PROMPT, NEW_TOKENS, temperature=0)[0].tolist() == greedy.tolist()
    meshed = sample.generate(scan_config, stacked, PROMPT, NEW_TOKENS, temperature=0, num_samples=4, mesh=(2, 2))
    assert meshed.tolist() == [greedy.tolist()] * 4  # the cache split over data, the stacked experts over expert
    sequence = np.concatenate([PROMPT, greedy])[None]
    chosen = _logits(scan_config, stacked, sequence)[0, len(PROMPT) - 1 : -1, :256]  # each step's next-token logits
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    near = np.isclose(top2[:, 1], top2[:, 0], rtol=RTOL, atol=0)
    compared = int(np.argmax(near)) if near.any() else NEW_TOKENS
    assert compared > 0  # something is compared
    unrolled_greedy = sample.generate(flat_config, unrolled, PROMPT, NEW_TOKENS, temperature=0)[0]
    assert unrolled_greedy[:compared].tolist() == greedy[:compared].tolist()


def _flat(tree, prefix=()):
    for key in sorted(tree, key=lambda k: (isinstance(k, str), k)):
        if isinstance(tree[key], dict):
            yield from _flat(tree[key], (*prefix, key))
        else:
            yield (*prefix, key), tree[key]


def test_resuming_under_the_other_layout_is_refused_naming_model_scan_layers(scanned_run, tmp_path):
    config, finished = scanned_run
    workdir = str(tmp_path / "workdir")
    shutil.copytree(finished, workdir)
    before = {role: read_jsonl(os.path.join(workdir, role, "metrics.jsonl")) for role in ("coordinator", "islands/a")}
    unrolled = _config(False, rounds=3)
    unrolled.data.files = config.data.files
    for allow in (False, True):  # --allow_config_change or not: the checkpoints hold the stacked layout
        with pytest.raises(ConfigChangeError) as refused:
            run_in_process(unrolled, workdir, allow_config_change=allow)
        assert str(refused.value) == (
            f"ConfigError: {workdir}/coordinator was started with model.scan_layers=True but would resume with "
            "model.scan_layers=False: the parameters' layout differs (its checkpoints hold them stacked on a leading "
            "layers axis), and a run resumes under the layout it started with, --allow_config_change or not. Resume "
            "with model.scan_layers=True, or pass a new --workdir (its export, python -m island_jax.export, loads "
            "into either layout)"
        )
        assert refused.value.changes == [("model.scan_layers", True, False)]
    # under its own layout the run resumes from its checkpoints of round 2 (restored stacked) and goes on
    extended = _config(True, rounds=3)
    extended.data.files = config.data.files
    summary = run_in_process(extended, workdir)
    assert summary["rounds"] == 3 and summary["checksums_agree"] is True and summary["failures"] == []
    for role, old in before.items():  # rounds 1 and 2 were not run again
        rounds = [r["round"] for r in read_jsonl(os.path.join(workdir, role, "metrics.jsonl")) if r["kind"] == "round"]
        assert rounds == [1, 2, 3], role
        assert read_jsonl(os.path.join(workdir, role, "metrics.jsonl"))[: len(old)] == old
    _, params, round = load.from_workdir(workdir)
    assert round == 3 and stacking.is_stacked(params)
