"""Streaming DiLoCo's fragments over stacked parameters (`model.scan_layers`): a fragment is a range of layers,
slices of the stacked axis, and islands and coordinator agree on it bit for bit."""

import jax
import numpy as np
from tiny_config import get_config, write_corpus

from island_jax.config import fingerprint_fields
from island_jax.coordinator import Coordinator
from island_jax.island import Island
from island_jax.model import stacking
from island_jax.model.init import checksum, init_params
from island_jax.protocol import ContributionHeader

# the tiny model's elements: per block, attention qkv 32 x 96 and out 32 x 32, two norms of 32, the router
# 32 x 4 and three expert matrices 4 x 32 x 32; outside the blocks, the embedding 256 x 32, positions 32 x 32,
# the final norm 32 and the head 32 x 256
BLOCK = 32 * 96 + 32 * 32 + 2 * 32 + 32 * 4 + 3 * 4 * 32 * 32  # 16,576
OTHERS = 256 * 32 + 32 * 32 + 32 + 32 * 256  # 17,440


def _config(scan: bool = True):
    c = get_config()
    c.model.update(num_layers=4, scan_layers=scan)
    c.outer.fragments = 2
    c.comm.chunk_bytes = 4096
    return c


def test_a_fragment_holds_a_range_of_layers_as_slices_of_the_stacked_axis():
    config = _config()
    _, params, _ = init_params(config)
    assert params["layers"][0]["attn"]["qkv"]["kernel"].shape == (4, 32, 96)
    coordinator = Coordinator(config, params, ["a", "b"])
    # 4 x 16,576 + 17,440 = 83,744 elements; half is 41,872, nearest after layer 2 (49,728) rather than after
    # layer 1 (33,152): fragment 0 is layers 0..2, fragment 1 layer 3 and the leaves outside the blocks
    elements = [sum(p.stop - p.start for chunk in f.plan for p in chunk.pieces) for f in coordinator.fragments]
    assert elements == [3 * BLOCK, BLOCK + OTHERS]
    per_layer = stacking.unstack(params)
    layer_leaves = [jax.tree.leaves(per_layer["blocks"][i]) for i in range(4)]
    views = [jax.tree.leaves(f.view) for f in coordinator.fragments]
    # fragment 0: every stacked leaf's slices 0, 1, 2, the per-layer leaves of blocks 0..2, bit for bit
    assert len(views[0]) == 3 * len(layer_leaves[0])
    for got, want in zip(views[0], [x for i in range(3) for x in layer_leaves[i]]):
        assert got.shape == want.shape and np.array_equal(got, want)
    others = [per_layer["embedding"], per_layer["final_norm"]["scale"], per_layer["head"]["kernel"], per_layer["position"]]
    assert len(views[1]) == len(layer_leaves[3]) + 4
    for got, want in zip(views[1], layer_leaves[3] + others):
        assert got.shape == want.shape and np.array_equal(got, want)
    # the view is the per-layer form: its checksum is the unscanned model's, whose parameters are the same
    _, unscanned, _ = init_params(_config(scan=False))
    assert coordinator.checksum == checksum(unscanned) == checksum(params)
    # an unscanned run cuts between leaves, as before: here inside layer 2
    unscanned_parts = Coordinator(_config(scan=False), unscanned, ["a", "b"]).partition
    assert unscanned_parts != coordinator.partition


def _islands(config, params, graphdef, specs):
    corpus = (np.arange(20000) % 251).astype(np.uint8)
    out, start = [], 0
    for name in config.islands.keys():
        n = config.islands[name].num_devices
        out.append(Island(name, config, jax.devices()[start : start + n], graphdef, params, specs, corpus,
                          config.outer.rounds))
        start += n
    return out


def test_islands_and_the_coordinator_agree_on_every_fragment_after_every_round():
    """F = 2 over four scanned layers, islands a (data 2, expert 2) and b (expert 2): after every round each
    island's fragments and whole global parameters have the coordinator's checksums, and its anchor and
    parameters on the devices (stacked) hold those bits."""
    config = _config()
    graphdef, params, specs = init_params(config)
    islands = _islands(config, params, graphdef, specs)
    coordinator = Coordinator(config, params, [i.name for i in islands])
    for isl in islands:
        coordinator.join(isl.name, fingerprint_fields(config), isl.global_checksum)
    seen = {checksum(params)}
    for r in range(config.outer.rounds):
        for isl in islands:
            result = isl.train_round()
            for f in range(2):
                header = ContributionHeader(r, isl.name, result["tokens"], isl.fragment_checksum(f), fragment=f)
                coordinator.contribute(header, isl.encode_fragment(f, isl.fragment_pseudo_gradient(f)).tobytes())
        for isl in islands:
            for f in range(2):
                isl.apply_fragment(f, isl.decode_fragment(f, coordinator.fetch_update(r, isl.name, f)))
        assert [f.round for f in coordinator.fragments] == [r + 1, r + 1]
        for isl in islands:
            assert [isl.fragment_checksum(f) for f in range(2)] == [f.checksum for f in coordinator.fragments]
            assert isl.global_checksum == coordinator.checksum == checksum(coordinator.view)
            assert checksum(isl.host_shards(isl.anchor)) == checksum(isl.host_shards(isl.params)) == isl.global_checksum
            assert stacking.is_stacked(jax.tree.map(np.shape, isl.params))
        seen.add(coordinator.checksum)
    assert len(seen) == config.outer.rounds + 1  # the parameters moved every round
    # the whole view, per layer: what a rejoining island takes, and stacks again on its devices
    assert jax.tree.map(np.shape, coordinator.shapes) == jax.tree.map(np.shape, stacking.unstack(params))
    islands[1].load_view(coordinator.fetch_view()[1])
    assert islands[1].global_checksum == coordinator.checksum == checksum(islands[1].host_shards(islands[1].params))


def test_two_islands_stream_two_fragments_of_stacked_layers_with_overlap(tmp_path):
    from island_jax.metrics import read_jsonl
    from island_jax.run import run_in_process

    config = _config()
    config.data.files = write_corpus(tmp_path / "corpus")
    config.outer.overlap_steps = 1  # Streaming DiLoCo's mix of local and global values, on the layers' slices
    workdir = tmp_path / "run"
    summary = run_in_process(config, str(workdir))
    for name in ("a", "b"):
        sends = sorted((e["round"], e["fragment"]) for e in read_jsonl(workdir / "islands" / name / "events.jsonl")
                       if e["kind"] == "send")
        assert sends == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    merged = [(r["round"], r["fragment"], sorted(r["contributors"]))
              for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    # every contribution carried the island's checksum of the fragment's anchor, checked against the view
    assert sorted(merged) == [(r, f, ["a", "b"]) for r in (1, 2, 3) for f in (0, 1)]
    assert summary["checksums_agree"] is True  # the islands' last global parameters are the coordinator's view
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
