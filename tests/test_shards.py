"""What each process of an island holds and owns (`island/shards.py`): runs of shards, chunk owners, what travels
over the interconnect, and the update applied shard by shard with the coordinator's arithmetic."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.island.shards import HostLeaf, LeafLayout, Ownership, view_chunks
from island_jax.mesh import island_mesh, shard_runs
from island_jax.model.init import checksum
from island_jax.outer import codec


def _two_processes(spec, shape, process):
    """The layout of a leaf on a data=1 x fsdp=2 x expert=2 mesh whose devices 0 and 1 stand for process 0 and
    devices 2 and 3 for process 1, as `process` sees it."""
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)
    first = {d.id for d in mesh.devices.flat[:2]}
    return LeafLayout(shape, np.float32, NamedSharding(mesh, spec), process_of=lambda d: 0 if d.id in first else 1,
                      process=process)


def test_a_shard_is_runs_of_consecutive_elements():
    assert shard_runs((8, 5), (slice(4, 8), slice(None))) == [(20, 20, 0)]  # cut on its leading dimension: one run
    assert shard_runs((4, 6, 5), (slice(2, 4), slice(0, 3), slice(None))) == [(60, 15, 0), (90, 15, 15)]
    assert shard_runs((3, 4), (slice(None), slice(2, 4))) == [(2, 2, 0), (6, 2, 2), (10, 2, 4)]
    assert shard_runs((), ()) == [(0, 1, 0)] and shard_runs((0, 4), (slice(None), slice(None))) == [(0, 0, 0)]


def test_owners_hold_the_most_of_their_chunks_and_only_shard_edges_travel():
    # leaves in order: "norm" (300, whole on both processes), "rows" (8 x 20000, rows 0-3 on process 0, 4-7 on 1)
    shapes = {"norm": (300,), "rows": (8, 20000)}
    plan = codec.chunk_plan({k: np.zeros(v, np.float32) for k, v in shapes.items()}, "int8", 256, 66560)
    # int8 pieces of 65,536 elements: norm (308 bytes), then rows [0, 65536), [65536, 131072), [131072, 160000)
    assert [(c.nbytes, [(p.leaf, p.start, p.stop) for p in c.pieces]) for c in plan] == [
        (308, [(0, 0, 300)]), (66560, [(1, 0, 65536)]), (66560, [(1, 65536, 131072)]), (29380, [(1, 131072, 160000)])]
    for process in (0, 1):
        layouts = [_two_processes(P(), shapes["norm"], process), _two_processes(P("fsdp"), shapes["rows"], process)]
        assert layouts[1].holders == [(0,), (1,)] and layouts[0].holders == [(0, 1)]
        assert layouts[1].segments(70000, 90000) == [(70000, 80000, 0, 70000), (80000, 90000, 1, 0)]
        o = Ownership(plan, layouts, 2)
        # norm: both hold it whole, dealt by bytes (to 0); chunk 2 has 14,464 elements on 0 and 51,072 on 1
        assert o.owners == [0, 0, 1, 1] and [[c.index for c in s] for s in o.shares] == [[0, 1], [2, 3]]
        assert o.share == o.shares[process]
        assert o.values_sent == [80000 - 65536, 0]  # process 0's part of chunk 2, to its owner
        assert o.update_bytes_sent == [308, 66560]  # norm's update to process 1; chunk 2's to process 0
        assert o.residual_elements == [300 + 65536, 65536 + 28928]
    # the view (float32, chunks of 16,384 elements): each process takes the chunks its rows meet
    view = codec.chunk_plan({"rows": np.zeros(shapes["rows"], np.float32)}, "none", 1, 65536)
    assert [[c.index for c in view_chunks(view, [_two_processes(P("fsdp"), shapes["rows"], p)])] for p in (0, 1)] == [
        [0, 1, 2, 3, 4], [4, 5, 6, 7, 8, 9]]


def test_an_update_applied_shard_by_shard_has_the_bits_of_the_whole_update():
    rng = np.random.default_rng(0)
    tree = {"experts": rng.standard_normal((4, 8, 1125)).astype(np.float32),
            "rows": rng.standard_normal((8, 5000)).astype(np.float32),
            "scale": rng.standard_normal(7).astype(np.float32)}
    specs = {"experts": P("expert", "fsdp"), "rows": P("fsdp"), "scale": P()}
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)
    leaves = jax.tree.leaves(tree)
    layouts = [LeafLayout(x.shape, x.dtype, NamedSharding(mesh, s)) for x, s in zip(leaves, jax.tree.leaves(specs))]
    host = [HostLeaf.of(layout, x) for layout, x in zip(layouts, leaves)]
    assert [len(h.shards) for h in host] == [4, 2, 1] and checksum(host) == checksum(leaves)
    for h, x in zip(host, leaves):
        np.testing.assert_array_equal(np.asarray(h.place()), x)
    update = {k: rng.standard_normal(v.shape).astype(np.float32) * 1e-3 for k, v in tree.items()}
    payload = codec.encode(update, "int8", 64)
    plan = codec.chunk_plan(tree, "int8", 64, 4096)
    ownership = Ownership(plan, layouts, 1)
    new = ownership.apply(host, ownership.update_sources(payload), codec.Codec("int8", 64))
    expected = jax.tree.leaves(codec.decode_and_apply(tree, payload, "int8", 64))
    for h, x, layout in zip(new, expected, layouts):
        for k, shard in h.shards.items():
            box = layout.box(k)
            assert shard.dtype == x.dtype and np.array_equal(shard.view(np.uint8), x[box].view(np.uint8))
    assert checksum(new) == checksum(expected) != checksum(host)
    # top-k contributions and a top-k update of groups of 1024 over int8 blocks of 64: the update's own plan,
    # the same chunks in its bytes
    up, down = codec.Codec("int8", 64), codec.Codec("topk", 64, 1024, 16)
    both = Ownership(codec.chunk_plan(tree, up, None, 4096, down), layouts, 1,
                     codec.chunk_plan(tree, down, None, 4096, up))
    sparse = codec.encode(update, down)
    got = both.apply(host, both.update_sources(sparse), down)
    assert checksum(got) == checksum(codec.decode_and_apply(tree, sparse, down))
    # the encoder reads the owner's pieces from its shards: the same payload as from the whole values
    placed = [jax.device_put(x, layout.sharding) for x, layout in zip(jax.tree.leaves(update), layouts)]
    local = {(i, layout.key_of(s.index)): np.asarray(s.data).reshape(-1)
             for i, (x, layout) in enumerate(zip(placed, layouts)) for s in x.addressable_shards}
    values = ownership.owner_values(lambda leaf, shard: local[(leaf, shard)])
    encoder = codec.ChunkEncoder(None, "int8", 64, ownership.share, read=values.read)
    assert encoder.tobytes() == codec.ChunkEncoder(update, "int8", 64, plan).tobytes() == payload
