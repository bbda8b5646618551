"""The two forms of a model's parameters, and the conversion between them.

Per layer (`model.scan_layers` False): `blocks.{i}` holds block i's parameters, i in 0..L-1.
Stacked (`model.scan_layers` True, `transformer.scan_unit`): with n = `moe.every_n_layers` and U = L // n,
`layers.{j}` holds blocks j, n + j, ..., (U - 1) n + j stacked on a new leading axis of U, for j in 0..n-1,
and `tail.{k}` holds block U n + k unstacked, for the L mod n dense blocks left over. Everything outside the
blocks (embedding, positions, final norm, head) is the same in both.

Block i = u n + j of the stacked form is `layers[j]`'s slice u along the leading axis: since that axis is never
split over the mesh (`mesh.LOGICAL_RULES`), the slice is a run of consecutive elements of every shard, laid
out as the per-layer parameter is.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

STACKED_KEYS = ("layers", "tail")  # the stacked form's groups of blocks
PER_LAYER_KEY = "blocks"  # the per-layer form's


def is_stacked(params: dict) -> bool:
    """Whether a parameter-shaped dict is in the stacked form (it has `layers`)."""
    return "layers" in params


def num_layers(params: dict) -> int:
    """L, the blocks a parameter-shaped dict holds, in either form."""
    if not is_stacked(params):
        return len(params[PER_LAYER_KEY])
    repeats = jax.tree.leaves(params["layers"][0])[0].shape[0]
    return repeats * len(params["layers"]) + len(params.get("tail", {}))


def layer_ndim(params: dict) -> dict:
    """Each leaf's rank in the per-layer form, shaped like `params` (either form): a stacked leaf's rank less
    its leading `layers` axis. What rank-based rules (weight decay on matrices only) read."""
    def rank(path, leaf):
        return len(np.shape(leaf)) - (1 if path and getattr(path[0], "key", None) == "layers" else 0)

    return jax.tree_util.tree_map_with_path(rank, params)


def layer_index(params: dict, repeats: int | None = None) -> list[tuple[str, int, int | None]]:
    """Where each block lives in a stacked dict, in layer order: (group, key, slice of the leading axis or None
    for an unstacked block) for blocks 0..L-1. `repeats`: U, by default the leading axis of the first leaf."""
    n = len(params["layers"])
    repeats = repeats if repeats is not None else jax.tree.leaves(params["layers"][0])[0].shape[0]
    out = [("layers", j, u) for u in range(repeats) for j in range(n)]
    return out + [("tail", k, None) for k in range(len(params.get("tail", {})))]


def unstack(params: dict, take: Callable[[Any, int], Any] | None = None, repeats: int | None = None) -> dict:
    """The per-layer form of a parameter-shaped dict (returned unchanged if it has no stacked blocks).

    Args:
      params: a pure dict of the model's shape (`nnx.to_pure_dict`), in the stacked form; its leaves NumPy
        arrays, `jax.Array`s, or anything `take` reads.
      take: `take(leaf, u)`, the leaf's slice u along its leading (stacked) axis; by default `leaf[u]` (a view
        of a NumPy array; a `jax.Array`'s slice keeps its sharding on the other dimensions).
      repeats: U, for leaves that have no shape (PartitionSpecs, with `take` dropping their first entry).

    Returns:
      A new dict with `blocks` {i: block i's parameters} in place of `layers` and `tail`; other entries are
      the same objects.
    """
    if not is_stacked(params):
        return params
    take = take or (lambda leaf, u: leaf[u])
    blocks = {}
    for i, (group, key, u) in enumerate(layer_index(params, repeats)):
        block = params[group][key]
        blocks[i] = block if u is None else jax.tree.map(lambda leaf, u=u: take(leaf, u), block)
    out = {k: v for k, v in params.items() if k not in STACKED_KEYS}
    out[PER_LAYER_KEY] = blocks
    return out


def stack(params: dict, every_n_layers: int) -> dict:
    """The stacked form of a per-layer parameter dict (`unstack`'s inverse), as `model.scan_layers` lays it out.

    Args:
      params: a pure dict in the per-layer form (`blocks` {i: ...}); NumPy leaves are stacked with `np.stack`,
        others with `jnp.stack` (a `jax.Array` keeps its sharding, with the new axis whole).
      every_n_layers: n, `moe.every_n_layers`: the unit scanned.

    Returns:
      A new dict with `layers` {j: ...} (leaves [U, ...]) and, when L mod n > 0, `tail` {k: ...} in place of
      `blocks`.

    Raises:
      ValueError: `params` is already stacked, or its blocks of one unit position differ in structure.
    """
    if is_stacked(params):
        raise ValueError("the parameters are already stacked (they have `layers`); `stack` takes the per-layer form")
    blocks = params[PER_LAYER_KEY]
    total = len(blocks)
    repeats = total // every_n_layers

    def stacked(*leaves):
        return np.stack(leaves) if all(isinstance(x, np.ndarray) for x in leaves) else jnp.stack(leaves)

    layers = {}
    for j in range(every_n_layers):
        group = [blocks[u * every_n_layers + j] for u in range(repeats)]
        structures = {jax.tree.structure(b) for b in group}
        if len(structures) != 1:
            raise ValueError(f"blocks {j}, {j + every_n_layers}, ... differ in structure; with moe.every_n_layers="
                             f"{every_n_layers} they must all be MoE blocks or all dense ones")
        layers[j] = jax.tree.map(stacked, *group)
    out = {k: v for k, v in params.items() if k != PER_LAYER_KEY}
    out["layers"] = layers
    if total % every_n_layers:  # as `nnx.to_pure_dict` gives it: no `tail` when every block is scanned
        out["tail"] = {k: blocks[repeats * every_n_layers + k] for k in range(total % every_n_layers)}
    return out


def to_layout(params: dict, scan_layers: bool, every_n_layers: int) -> dict:
    """`params` (either form) in the form `model.scan_layers` = `scan_layers` uses."""
    if scan_layers:
        return params if is_stacked(params) else stack(params, every_n_layers)
    return unstack(params)
