"""The parameters' checksum (`model.init.checksum`): digests of fixed pieces of every leaf, so that the same
values give the same string on every layout, read shard by shard and never gathered whole."""

import hashlib
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from processes import TESTS, free_port, role_env
from tiny_config import get_config

from island_jax.mesh import island_mesh
from island_jax.model.init import CHECKSUM_PIECE_ELEMENTS, checksum, init_params


def _tree() -> dict:
    """Leaves of several pieces, whose shard edges (over 2 or 4 devices) fall inside pieces."""
    rng = np.random.default_rng(0)
    return {
        "rows": rng.standard_normal((8, 5000)).astype(np.float32),  # 40,000 elements: pieces of 16384, 16384, 7232
        "experts": rng.standard_normal((4, 8, 1125)).astype(np.float32),  # 36,000: 3 pieces
        "small": np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "step": np.asarray(7, np.int32),  # int32: as placed on devices (without jax_enable_x64)
    }


SPECS = {"rows": P("fsdp"), "experts": P("expert", "fsdp"), "small": P(), "step": P()}


def test_the_checksum_hashes_each_leafs_shape_dtype_and_the_digests_of_its_pieces():
    tree = _tree()
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(f"{leaf.shape}{leaf.dtype}".encode())
        flat = np.ascontiguousarray(leaf).reshape(-1)
        for start in range(0, max(flat.size, 1), CHECKSUM_PIECE_ELEMENTS):
            h.update(hashlib.sha256(flat[start : start + CHECKSUM_PIECE_ELEMENTS].tobytes()).digest())
    assert checksum(tree) == h.hexdigest()[:16] == "e619badef8825431"
    assert checksum({"empty": np.zeros((0, 4), np.float32)}) == hashlib.sha256(
        b"(0, 4)float32" + hashlib.sha256(b"").digest()).hexdigest()[:16]


@pytest.mark.parametrize("data,fsdp,expert", [(4, 1, 1), (1, 2, 2), (2, 2, 1), (1, 4, 1), (1, 4, 2)])
def test_the_same_values_give_the_same_checksum_on_every_layout(data, fsdp, expert):
    tree = _tree()
    mesh = island_mesh(data, expert, jax.devices()[: data * fsdp * expert], fsdp=fsdp)
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}
    assert checksum(placed) == checksum(tree) == "e619badef8825431"
    # a leaf split on its last dimension (every row a run of its own, most pieces cut) and an empty one
    more = {"cols": np.random.default_rng(1).standard_normal((40, 1024)).astype(np.float32),
            "empty": np.zeros((0, 4), np.float32)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(None, "fsdp"))) for k, v in more.items()}
    assert checksum(placed) == checksum(more)
    assert checksum({"empty": jax.device_put(more["empty"], NamedSharding(mesh, P()))}) == checksum(
        {"empty": more["empty"]}) == hashlib.sha256(b"(0, 4)float32" + hashlib.sha256(b"").digest()).hexdigest()[:16]

    # the model's own parameters, placed by their partition specs
    _, params, specs = init_params(get_config())
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    assert checksum(jax.device_put(params, shardings)) == checksum(params)


TINY_INIT = "fa8f118e1ce15063"  # the checksum of tests/tiny_config.py's initial parameters


@pytest.mark.parametrize("data,fsdp,expert", [(1, 1, 1), (2, 2, 2), (1, 4, 2), (1, 2, 1)])
def test_parameters_drawn_sharded_on_a_mesh_are_the_bits_of_the_whole_draw(data, fsdp, expert):
    config = get_config()
    _, whole, specs = init_params(config)
    mesh = island_mesh(data, expert, jax.devices()[: data * fsdp * expert], fsdp=fsdp)
    _, sharded, sharded_specs = init_params(config, mesh)
    assert sharded_specs == specs
    for (path, a), b, spec in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(sharded),
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), strict=True):
        assert isinstance(b, jax.Array) and b.sharding == NamedSharding(mesh, spec), jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)), path
    assert checksum(sharded) == checksum(whole) == TINY_INIT
    with pytest.raises(ValueError, match="a sharded init draws the CPU's bits"):
        init_params(config, jax.sharding.Mesh(np.array([_FakeAccelerator()]), ("data",)))


class _FakeAccelerator:
    platform = "gpu"


@pytest.mark.parametrize("element", [0, 15000, 39999])  # a piece's first, one a shard's edge cuts, the last
def test_one_ulp_anywhere_changes_the_checksum_on_any_layout(element):
    tree = _tree()
    changed = dict(tree, rows=tree["rows"].copy())
    flat = changed["rows"].reshape(-1)
    flat[element] = np.nextafter(flat[element], np.float32(np.inf))
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)
    sharded = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in changed.items()}
    assert checksum(changed) == checksum(sharded) != checksum(tree)


TWO_PROCESSES = """
import sys
import jax
from jax.sharding import NamedSharding
from island_jax import distributed
from island_jax.config import default_config
from island_jax.mesh import island_mesh, use_cpu_devices
from island_jax.model.init import checksum
from test_checksum import SPECS, _tree

use_cpu_devices(2)
distributed.initialize(2, int(sys.argv[1]), sys.argv[2], default_config().distributed)
mesh = island_mesh(1, 2, jax.devices(), fsdp=2)  # fsdp over both processes, expert within each
tree = _tree()
placed = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i])
          for k, v in tree.items()}
assert not placed["rows"].is_fully_addressable
print("CHECKSUM", checksum(placed), flush=True)

# Each process's host copy holds only its shards (half of each split leaf), checksums alike, and is never read
# whole; to_host refuses an array shaped like a split parameter.
import numpy as np
from island_jax.island.placement import Shardings
from island_jax.island.shards import HostLeaf, LeafLayout
host = {k: HostLeaf.of(LeafLayout(v.shape, v.dtype, placed[k].sharding), placed[k]) for k, v in tree.items()}
print("HOST", checksum(host), [host[k].nbytes for k in sorted(host)], flush=True)
try:
    np.asarray(host["rows"])
except TypeError as e:
    print("ASARRAY", e, flush=True)
try:
    Shardings(mesh, SPECS, tree).to_host({"rows": placed["rows"]})
except ValueError as e:
    print("TO_HOST", e, flush=True)

# The tiny model drawn on the mesh: each process computes its own shards, and the bits are the unsharded draw's.
from island_jax.model.init import init_params
from tiny_config import get_config
_, params, _ = init_params(get_config(), mesh)
print("INIT", checksum(params), not params["embedding"].is_fully_addressable, flush=True)

# A stacked leaf (model.scan_layers) split over both processes: hashed as its per-layer slices, read in place
from jax.sharding import PartitionSpec as P
stacked = tree["rows"].reshape(2, 4, 5000)
placed = jax.make_array_from_callback(stacked.shape, NamedSharding(mesh, P(None, "fsdp")), lambda i: stacked[i])
host = HostLeaf.of(LeafLayout(stacked.shape, stacked.dtype, placed.sharding), placed)
print("STACKED", checksum({"layers": {0: {"w": placed}}}), checksum({"layers": {0: {"w": host}}}), flush=True)
"""


@pytest.mark.slow  # starts processes
def test_an_island_of_two_processes_gets_the_same_checksum_from_its_shards(tmp_path):
    address = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(p), address], env=role_env(), cwd=TESTS,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    got = [line for out, _ in outs for line in out.splitlines() if line.startswith("CHECKSUM ")]
    assert got == ["CHECKSUM e619badef8825431"] * 2 and checksum(_tree()) == "e619badef8825431"
    lines = [[line for line in out.splitlines() if line.startswith(("HOST ", "ASARRAY ", "TO_HOST ", "INIT "))]
             for out, _ in outs]
    assert [line[3] for line in lines] == [f"INIT {TINY_INIT} True"] * 2
    rows = _tree()["rows"].reshape(2, 4, 5000)
    per_layer = checksum({"blocks": {0: {"w": rows[0]}, 1: {"w": rows[1]}}})
    stacked = [line for out, _ in outs for line in out.splitlines() if line.startswith("STACKED ")]
    assert stacked == [f"STACKED {per_layer} {per_layer}"] * 2
    # bytes per leaf in sorted order (experiments, rows, small, step): halves of the split leaves, whole replicated ones
    assert [line[0] for line in lines] == ["HOST e619badef8825431 [72000, 80000, 6, 4]"] * 2
    assert [line[1] for line in lines] == ["ASARRAY a parameter leaf of shape (8, 5000) is held as this process's "
                                           "shards; read them (`shards`) or place it (`place`)"] * 2
    assert [line[2] for line in lines] == ["TO_HOST to_host of an array shaped like a parameter split over the "
                                           "island's processes ((8, 5000)) would hold it whole on every host; read "
                                           "this process's shards instead (shards.HostLeaf)"] * 2
