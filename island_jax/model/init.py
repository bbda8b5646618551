"""Initial parameters, produced the same way in every process, and their checksum."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from island_jax.mesh import shard_runs, sharded_init
from island_jax.model import stacking
from island_jax.model.transformer import Transformer, partition_specs


def init_params(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None) -> tuple[nnx.GraphDef, dict, dict]:
    """Builds the model from `config.seed` (or, with `model.init_from`, from a transformers checkpoint's tensors,
    `model.hf`), on the CPU backend or sharded on a CPU `mesh`.

    Initialising on the CPU, whatever accelerator a process has, gives every
    island and the coordinator the same bits. On a `mesh` (an island's, of
    CPU devices) each parameter is drawn directly sharded by its partition
    spec (`mesh.sharded_init`): each process computes only its own shards,
    and the values are those of the unsharded draw, bit for bit.

    Returns:
      (graphdef, params, specs): the model's static structure; its `nnx.Param`
      values as a nested dict of NumPy arrays (`config.model.param_dtype`,
      except the float32 routers), or of `jax.Array`s sharded on `mesh`; and a
      matching dict of PartitionSpecs.

    Raises:
      ValueError: `mesh` is not of CPU devices.
      config.hf.InteropError: `model.init_from`'s checkpoint lacks a tensor, holds one of another shape, or holds
        tensors the model has no place for (named).
    """
    if config.model.get("init_from", ""):
        return _imported(config, mesh)
    with contextlib.ExitStack() as scope:
        if mesh is None:
            scope.enter_context(jax.default_device(jax.local_devices(backend="cpu")[0]))
        else:
            if any(d.platform != "cpu" for d in mesh.devices.flat):
                raise ValueError("a sharded init draws the CPU's bits: give a mesh of CPU devices, or none (the "
                                 "whole model is then drawn on this process's CPU)")
            scope.enter_context(jax.set_mesh(mesh))
            scope.enter_context(sharded_init(mesh))
        model = Transformer(config, rngs=nnx.Rngs(config.seed))
        graphdef, state = nnx.split(model, nnx.Param)
        specs = partition_specs(state)
        params = nnx.to_pure_dict(state)
    return graphdef, params if mesh is not None else jax.tree.map(np.asarray, params), specs


def _imported(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None):
    """`init_params` of a config with `model.init_from`: the transformers checkpoint's tensors (`model.hf`), in
    the config's layout, placed on `mesh` by their partition specs (each device given its own slice)."""
    from island_jax.config.hf import read_hf_config
    from island_jax.model import hf

    folder = config.model.init_from
    if mesh is not None and any(d.platform != "cpu" for d in mesh.devices.flat):
        raise ValueError("a checkpoint is placed from the CPU: give a mesh of CPU devices, or none")
    graphdef, like, specs = abstract_params(config)
    arch = read_hf_config(folder)["model_type"]
    hf.check_shapes(config, like, arch, *hf.held_shapes(folder))
    params = hf.from_tensors(config, hf.unstack_shapes(like), arch, hf.read_weights(folder)[0])
    params = stacking.to_layout(params, config.model.get("scan_layers", False), config.moe.every_n_layers)
    if mesh is None:
        return graphdef, params, specs
    placed = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, jax.sharding.NamedSharding(mesh, s), lambda i: x[i]),
        params, specs)
    return graphdef, placed, specs


def abstract_params(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None) -> tuple[nnx.GraphDef, dict, dict]:
    """`init_params`' (graphdef, params, specs) with nothing drawn or allocated: each parameter a
    `jax.ShapeDtypeStruct` of its shape and dtype (`nnx.eval_shape`), placed on `mesh` by its partition spec
    when one is given (a `NamedSharding`; any devices, compile-only ones of a target included)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(config.seed))), nnx.Param)
    specs = partition_specs(state)
    params = nnx.to_pure_dict(state)
    if mesh is not None:
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, s)),
            params, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    else:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return graphdef, params, specs


CHECKSUM_PIECE_ELEMENTS = 1 << 14  # elements of one checksum piece (64 KiB of float32)


def checksum(tree: Any) -> str:
    """The checksum of a parameter-shaped pytree, whatever its layout: 16 hex digits of a SHA-256.

    Each leaf is read as its flat elements in C order and cut into pieces of `CHECKSUM_PIECE_ELEMENTS` (the
    last may be short; an empty leaf is one empty piece), and each piece's bytes get a SHA-256 digest of their
    own. The checksum hashes, leaf after leaf in pytree order, the leaf's shape and dtype and then its pieces'
    digests in order. So the same values give the same string whether a leaf is one NumPy array, a `jax.Array`
    sharded over any mesh, or spread over the processes of an island. Each piece is hashed where its elements
    are, from views of the shards (nothing is copied in one process). Between processes travel the digests
    (32 bytes a piece) and the parts of the pieces that shard edges cut: at most one piece per edge for a leaf
    split on its leading dimension, but most of the leaf for one split on a later dimension, whose every row
    is a run of its own (sending each cut piece to one owner instead is left for later).

    A parameter dict in the stacked form (`model.scan_layers`: `layers` and `tail`, `model.stacking`) is hashed
    as its per-layer form (`stacking.unstack`): each block's slice of a stacked leaf's leading axis is a leaf of
    its own, read in place from the stacked leaf's runs (`LayerSlice`), so a scanned and an unscanned run of the
    same parameters have the same checksum. Other pytrees (a list of leaves, a fragment's) are hashed as given.

    Args:
      tree: a pytree of NumPy arrays, scalars, `jax.Array`s or `island.shards.HostLeaf`s (a process's host
        copy of its shards). A `jax.Array` is read shard by shard (one replica of each element), never gathered
        whole; one that spans several processes (and a `HostLeaf` of such a layout) makes this a collective over
        them (`distributed.allgather_json`): every process calls it at the same point.

    Returns:
      16 lowercase hex digits, the same on every process.
    """
    return _combine(_leaf_digests(per_layer(tree)))


class LayerSlice:
    """Slice `u` of a stacked leaf's leading axis, as `checksum` reads it: `shape` (the leaf's less its leading
    axis), `dtype`, `is_fully_addressable` (the leaf's) and `checksum_runs`, with nothing copied.

    Args:
      leaf: a stacked leaf [U, ...]: a NumPy array, a `jax.Array` (sharded, maybe over processes), or anything
        with `checksum_runs` (`island.shards.HostLeaf`, `coordinator.state.RowsLeaf`).
      u: 0..U-1.
    """

    def __init__(self, leaf: Any, u: int):
        self.leaf, self.u = leaf, u
        self.shape = tuple(int(d) for d in np.shape(leaf)[1:])
        self.dtype = _dtype(leaf)
        self.is_fully_addressable = getattr(leaf, "is_fully_addressable", True)

    def checksum_runs(self):
        """(first flat element of the slice, uint8 bytes) of each run of the slice's elements this process reads:
        the leaf's runs (`_runs`) cut to elements [u S, (u + 1) S) and rebased, S the slice's elements. (`checksum`
        reads a stacked leaf's runs once for all its slices, `_sliced_runs`.)"""
        for u, start, data in _sliced_runs(self.leaf, math.prod(self.shape), self.dtype.itemsize):
            if u == self.u:
                yield start, data


def per_layer(tree: Any) -> Any:
    """`tree` in the per-layer form when it is a parameter dict in the stacked form (`stacking.is_stacked`), each
    slice of a stacked leaf a `LayerSlice`; otherwise `tree` itself."""
    if not (isinstance(tree, dict) and isinstance(tree.get("layers"), dict) and stacking.is_stacked(tree)):
        return tree
    return stacking.unstack(tree, take=LayerSlice)


def leaf_checksums(tree: Any) -> list[str]:
    """`checksum` of each leaf on its own, in `jax.tree.leaves` order: 16 hex digits each, whatever the layout.

    Computed from the same piece digests as `checksum`, in one pass (and, for leaves spread over processes,
    one collective: every process calls it at the same point). The leaves are `tree`'s as given, stacked ones
    whole (a checkpoint's record of what it holds, `checkpoint.describe_leaves`).
    """
    return [_combine([leaf]) for leaf in _leaf_digests(tree)]


def _combine(leaves: list[tuple[bytes, list[bytes]]]) -> str:
    """16 hex digits of the SHA-256 over each leaf's head and then its pieces' digests, leaf after leaf."""
    h = hashlib.sha256()
    for head, pieces in leaves:
        h.update(head)
        for digest in pieces:
            h.update(digest)
    return h.hexdigest()[:16]


def checksum_parts(tree: Any) -> dict:
    """What this holder has of `checksum`'s pieces of `tree`, as JSON: {"digests": {"LEAF,PIECE": hex SHA-256} of
    the pieces it holds whole, "cut": {"LEAF,PIECE": [[first element, elements, base64 bytes], ...]} of the parts
    it holds of the others}. Leaves whose `checksum_runs` yield only some of their elements (a coordinator
    shard's rows, `coordinator.state.RowsLeaf`) give some of the pieces; `combine_parts` puts every holder's
    together."""
    _, _, digests, held = _local_digests(jax.tree.leaves(tree))
    return _as_json(digests, held)


def _as_json(digests: dict, held: dict) -> dict:
    """`checksum_parts`'s JSON of the digests of whole pieces and the parts of the others."""
    return dict(
        digests={f"{i},{p}": d.hex() for (i, p), d in digests.items()},
        cut={f"{i},{p}": [[first, n, base64.b64encode(part).decode()] for first, n, part in parts]
             for (i, p), parts in held.items() if (i, p) not in digests},
    )


def combine_parts(tree: Any, parts: list[dict]) -> str:
    """`checksum` of `tree` (leaves with `shape` and `dtype`; their elements are not read) from every holder's
    `checksum_parts`, which together hold each piece whole or in parts.

    Raises:
      KeyError: a piece no holder has.
    """
    leaves = jax.tree.leaves(tree)
    heads = [f"{tuple(int(d) for d in np.shape(x))}{_dtype(x)}".encode() for x in leaves]
    sizes = [math.prod(np.shape(x)) for x in leaves]
    digests: dict[tuple[int, int], bytes] = {}
    for i, size in enumerate(sizes):
        if size == 0:
            digests[(i, 0)] = hashlib.sha256(b"").digest()
    _add_parts(digests, [(p["digests"], p["cut"]) for p in parts])
    return _combine(_pieces(heads, sizes, digests))


def _add_parts(digests: dict, everyone: list) -> None:
    """Adds every holder's (digests, cut parts) in `checksum_parts`'s JSON form to `digests`, hashing each cut
    piece from its parts."""
    parts_of: dict[tuple[int, int], list] = {}
    for theirs, theirs_cut in everyone:
        digests.update({_key(k): bytes.fromhex(v) for k, v in theirs.items()})
        for k, parts in theirs_cut.items():
            parts_of.setdefault(_key(k), []).extend((first, n, base64.b64decode(b)) for first, n, b in parts)
    digests.update({key: _digest(parts) for key, parts in parts_of.items()})


def _pieces(heads: list[bytes], sizes: list[int], digests: dict) -> list[tuple[bytes, list[bytes]]]:
    return [(heads[i], [digests[(i, piece)] for piece in range(max(1, -(-size // CHECKSUM_PIECE_ELEMENTS)))])
            for i, size in enumerate(sizes)]


def _leaf_digests(tree: Any) -> list[tuple[bytes, list[bytes]]]:
    """Per leaf of `tree` (`jax.tree.leaves` order): (its shape and dtype as bytes, the SHA-256 digest of each of
    its pieces in order), as `checksum` describes; a collective over processes for leaves spread over them."""
    leaves = jax.tree.leaves(tree)
    heads, sizes, digests, held = _local_digests(leaves)
    if any(not getattr(x, "is_fully_addressable", True) for x in leaves):  # spread over processes (a slice: its leaf)
        from island_jax import distributed

        mine = _as_json(digests, held)
        _add_parts(digests, [(x["digests"], x["cut"]) for x in distributed.allgather_json(mine)])
    return _pieces(heads, sizes, digests)


def _local_digests(leaves: list) -> tuple[list[bytes], list[int], dict, dict]:
    """(heads, sizes, digests of the pieces held whole here, parts of the pieces cut) of `leaves`."""
    digests: dict[tuple[int, int], bytes] = {}  # (leaf, piece) -> the digest of a piece held whole here
    held: dict[tuple[int, int], list] = {}  # (leaf, piece) -> [(first element, elements, bytes)] of a cut piece
    heads, sizes = [], []
    sliced: dict[int, tuple[Any, dict]] = {}  # id of a stacked leaf -> (it, {u: [leaf index of its slice u]})
    for i, leaf in enumerate(leaves):
        shape = tuple(int(d) for d in np.shape(leaf))
        heads.append(f"{shape}{_dtype(leaf)}".encode())
        sizes.append(math.prod(shape))
        if sizes[-1] == 0:  # an empty leaf is one empty piece, on every process and layout
            digests[(i, 0)] = hashlib.sha256(b"").digest()
        elif isinstance(leaf, LayerSlice):  # read below with the stacked leaf's other slices
            sliced.setdefault(id(leaf.leaf), (leaf.leaf, {}))[1].setdefault(leaf.u, []).append(i)
        else:
            itemsize = _dtype(leaf).itemsize
            for start, data in _runs(leaf):
                _hash_run(i, start, data, itemsize, sizes, digests, held)
    for stacked, slices in sliced.values():  # a stacked leaf's runs are read once, for all its slices
        itemsize, size = _dtype(stacked).itemsize, sizes[next(iter(slices.values()))[0]]
        for u, start, data in _sliced_runs(stacked, size, itemsize):
            for i in slices.get(u, ()):
                _hash_run(i, start, data, itemsize, sizes, digests, held)
    digests.update({key: _digest(parts) for key, parts in held.items() if _whole(key, parts, sizes)})
    return heads, sizes, digests, held


def _hash_run(i: int, start: int, data, itemsize: int, sizes: list[int], digests: dict, held: dict) -> None:
    """Hashes the checksum pieces of leaf `i` that a run (`start`, its first element; `data`, its bytes) holds
    whole into `digests`, and keeps the parts of those it cuts in `held` ((leaf, piece) keys both)."""
    for piece, first, n, part in _cut(start, data, itemsize):
        if _whole((i, piece), [(first, n, None)], sizes):  # hashed in place: no copy of the bytes
            digests[(i, piece)] = hashlib.sha256(part).digest()
        else:  # shard edges cut it: its parts (views of the shards) are put together below
            held.setdefault((i, piece), []).append((first, n, part))


def _key(text: str) -> tuple[int, int]:
    leaf, piece = text.split(",")
    return int(leaf), int(piece)


def _runs(leaf):
    """(first flat element, uint8 bytes) of each contiguous run of `leaf`'s elements that this process holds,
    with one replica of each element over the whole job: a `jax.Array`'s shards of replica_id 0, or the runs of
    a `island.shards.HostLeaf` (a host copy of one process's shards) that it says are this process's to read."""
    if hasattr(leaf, "checksum_runs"):
        yield from leaf.checksum_runs()
        return
    if not isinstance(leaf, jax.Array):
        yield 0, _bytes(np.asarray(leaf))
        return
    for shard in leaf.addressable_shards:
        if shard.replica_id != 0:
            continue
        flat = _bytes(np.asarray(shard.data))
        for start, n, offset in shard_runs(leaf.shape, shard.index):
            yield start, flat[offset * shard.data.dtype.itemsize : (offset + n) * shard.data.dtype.itemsize]


def _sliced_runs(leaf, size: int, itemsize: int):
    """(u, first flat element of slice u, uint8 bytes) of each part of `leaf`'s runs (`_runs`) cut at the edges of
    its slices of `size` elements along the leading axis, in the order the runs come."""
    for start, data in _runs(leaf):
        count = data.size // itemsize
        if count == 0:
            continue
        for u in range(start // size, (start + count - 1) // size + 1):
            lo, hi = max(start, u * size), min(start + count, (u + 1) * size)
            yield u, lo - u * size, data[(lo - start) * itemsize : (hi - start) * itemsize]


def _dtype(leaf) -> np.dtype:
    """A leaf's dtype (a scalar's as NumPy reads it)."""
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _bytes(a: np.ndarray) -> np.ndarray:
    """`a`'s elements in C order as uint8 (a view where `a` is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _cut(start: int, data: np.ndarray, itemsize: int):
    """(piece, its first element in this run, its elements in this run, a view of their bytes) for each checksum
    piece a run of elements meets."""
    count = data.size // itemsize
    if count == 0:
        yield start // CHECKSUM_PIECE_ELEMENTS, start, 0, memoryview(b"")
        return
    for piece in range(start // CHECKSUM_PIECE_ELEMENTS, (start + count - 1) // CHECKSUM_PIECE_ELEMENTS + 1):
        lo = max(start, piece * CHECKSUM_PIECE_ELEMENTS)
        hi = min(start + count, (piece + 1) * CHECKSUM_PIECE_ELEMENTS)
        yield piece, lo, hi - lo, memoryview(data[(lo - start) * itemsize : (hi - start) * itemsize])


def _whole(key: tuple[int, int], parts: list, sizes: list[int]) -> bool:
    """Whether `parts` ((first element, elements, bytes) each) hold every element of piece `key` (leaf, piece)."""
    leaf, piece = key
    expected = min(sizes[leaf], (piece + 1) * CHECKSUM_PIECE_ELEMENTS) - piece * CHECKSUM_PIECE_ELEMENTS
    return sum(n for _, n, _ in parts) == max(expected, 0)


def _digest(parts: list) -> bytes:
    """SHA-256 of a piece's bytes, from its parts ((first element, elements, bytes) each) in element order."""
    h = hashlib.sha256()
    for _, _, part in sorted(parts, key=lambda p: p[0]):
        h.update(part)
    return h.digest()


def count(tree: Any) -> int:
    """Number of elements over all leaves."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))
