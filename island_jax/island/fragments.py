"""Streaming DiLoCo's fragments on an island (arXiv 2501.18512, Algorithm 1; one fragment is plain DiLoCo):
the pseudo-gradient anchor - params out, the coordinator's update in, on this process's shards.

The outer loop speaks the parameters' per-layer form (`model.stacking`; `OuterLeaves`): with
`model.scan_layers`, each stacked leaf of the island's parameters is U outer leaves, its layer slices. A fragment
is a group of outer leaves (`outer.fragments.partition`, cut between layers: a range of layers; `FragmentLeaves`).
Going out, a fragment's float32 pseudo-gradient is read from the island's devices as the values of the chunks
this process owns (`shards.Ownership`) and encoded for the wire, with error feedback where the codec has it.
Coming in, the update is applied to this process's host copy of the global parameters (per-layer form) with the
arithmetic of the shared `codec.decode_and_apply`; those exact bits become the fragment's anchor and, without
overlap, its parameters (with overlap, Streaming DiLoCo's mix of local and global values), written back into
the stacked leaves on the devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np

from island_jax.config import error_feedback
from island_jax.island import shards as shards_lib
from island_jax.island import step as step_lib
from island_jax.model import stacking
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib


class _Slot:
    """Where an outer leaf lives in the island's parameter tree: leaf `leaf` (`jax.tree.leaves` order), whole
    (`layer` None) or its slice `layer` of the leading, stacked axis. A pytree leaf."""

    __slots__ = ("leaf", "layer")

    def __init__(self, leaf: int, layer: int | None = None):
        self.leaf, self.layer = leaf, layer


@functools.partial(jax.jit, static_argnums=2)
def _put_layers(stacked: jax.Array, layers: list, first: int) -> jax.Array:
    """`stacked` [U, ...] with its slices first, first + 1, ... replaced by `layers` (each [...]), its sharding kept."""
    return jax.lax.dynamic_update_slice_in_dim(stacked, jax.numpy.stack(layers).astype(stacked.dtype), first, 0)


@functools.partial(jax.jit, static_argnums=2)
def _pseudo_gradient(anchors: list, params: list, spec: tuple) -> list:
    """`step.pseudo_gradient` of outer leaves, sliced inside the program (no copy of a slice is made first):
    per (argument, layer or None) of `spec`, anchors[argument] - params[argument], or its slice `layer` of the
    leading axis, in float32."""
    def take(leaves, k, u):
        return leaves[k] if u is None else leaves[k][u]

    return step_lib.pseudo_gradient([take(anchors, k, u) for k, u in spec], [take(params, k, u) for k, u in spec])


class OuterLeaves:
    """The outer loop's leaves of a parameter tree: the leaves of its per-layer form (`model.stacking.unstack`), in
    `jax.tree.leaves` order of that form. For a per-layer tree they are its own leaves; for a stacked one
    (`model.scan_layers`) each stacked leaf [U, ...] stands as U outer leaves, its layer slices [...].

    Args:
      params: a parameter-shaped pure dict in the island's form (arrays or shape structs).

    Attributes:
      treedef: the per-layer form's structure (the outer leaves').
      slots: per outer leaf, where it lives in `params`' leaves.
      stacked: whether `params` is in the stacked form.
      unit: n, the blocks of the scanned unit (1 without stacking).
    """

    def __init__(self, params: dict):
        self.stacked = stacking.is_stacked(params)
        self.unit = len(params["layers"]) if self.stacked else 1  # n, the scanned unit's blocks
        leaves, self.island_treedef = jax.tree.flatten(params)
        slots = jax.tree.unflatten(self.island_treedef, [_Slot(i) for i in range(len(leaves))])
        repeats = jax.tree.leaves(params["layers"][0])[0].shape[0] if self.stacked else None
        outer = stacking.unstack(slots, take=lambda slot, u: _Slot(slot.leaf, u), repeats=repeats)
        self.slots: list[_Slot]
        self.slots, self.treedef = jax.tree.flatten(outer)

    def of(self, tree) -> list:
        """The outer leaves of `tree` (shaped like `params`): its leaves, or their layer slices (`leaf[u]`: a view
        of a NumPy array, a `jax.Array` laid out as the per-layer leaf, sharded as the stacked one's other
        dimensions; call it under the island's mesh)."""
        leaves = jax.tree.leaves(tree)
        return [leaves[s.leaf] if s.layer is None else leaves[s.leaf][s.layer] for s in self.slots]

    def pseudo_gradient(self, anchor, params, indices: Sequence[int]) -> list:
        """anchor - params (float32) of outer leaves `indices` of two trees shaped like `params` (on the island's
        devices; call it under the island's mesh): one program that reads each stacked leaf once and writes only
        the slices asked for."""
        return _pseudo_gradient(*self._pseudo_gradient_args(anchor, params, indices))

    def lower_pseudo_gradient(self, anchor, params, indices: Sequence[int]) -> jax.stages.Lowered:
        """`pseudo_gradient`'s program lowered, not run, for `anchor` and `params` of any leaves its call takes or
        their `jax.ShapeDtypeStruct`s (sharded: compiled ahead of time, `island.aot`)."""
        return _pseudo_gradient.lower(*self._pseudo_gradient_args(anchor, params, indices))

    def _pseudo_gradient_args(self, anchor, params, indices: Sequence[int]) -> tuple[list, list, tuple]:
        anchors, current = jax.tree.leaves(anchor), jax.tree.leaves(params)
        used = sorted({self.slots[i].leaf for i in indices})
        position = {k: j for j, k in enumerate(used)}
        spec = tuple((position[self.slots[i].leaf], self.slots[i].layer) for i in indices)
        return [anchors[k] for k in used], [current[k] for k in used], spec

    def layer_shapes(self, params) -> Any:
        """The per-layer form's tree of `jax.ShapeDtypeStruct`s (unsharded) of `params` (shaped like the
        island's): each outer leaf's shape and dtype."""
        leaves = jax.tree.leaves(params)
        return jax.tree.unflatten(self.treedef, [
            jax.ShapeDtypeStruct(np.shape(leaves[s.leaf])[0 if s.layer is None else 1:], leaves[s.leaf].dtype)
            for s in self.slots])

    def put(self, tree, indices: Sequence[int], new: Sequence) -> Any:
        """`tree` (shaped like `params`, of `jax.Array`s) with outer leaves `indices` replaced by `new` (a new tree;
        `tree` is unchanged). The slices of one stacked leaf among `indices` must be consecutive layers (a
        fragment's), written with one `dynamic_update_slice`."""
        leaves = jax.tree.leaves(tree)
        slices: dict[int, list] = {}
        for i, leaf in zip(indices, new):
            slot = self.slots[i]
            if slot.layer is None:
                leaves[slot.leaf] = leaf
            else:
                slices.setdefault(slot.leaf, []).append((slot.layer, leaf))
        for k, parts in slices.items():
            first = parts[0][0]
            if [u for u, _ in parts] != list(range(first, first + len(parts))):
                raise ValueError(f"the layers {[u for u, _ in parts]} of a stacked leaf are not consecutive")
            leaves[k] = _put_layers(leaves[k], [leaf for _, leaf in parts], first)
        return jax.tree.unflatten(self.island_treedef, leaves)

    def island_tree(self, outer_leaves: Sequence) -> Any:
        """The island's parameter tree from every outer leaf (`jax.Array`s, each laid out as its per-layer leaf):
        the stacked leaves stacked again (`stacking.stack`), sharded on the mesh as their slices are."""
        tree = jax.tree.unflatten(self.treedef, list(outer_leaves))
        return stacking.stack(tree, self.unit) if self.stacked else tree


@dataclasses.dataclass(frozen=True)
class FragmentLeaves:
    """Streaming DiLoCo's fragments as outer-leaf indices of the parameters (`OuterLeaves`).

    Attributes:
      outer: the parameters' outer leaves.
      partition: per fragment, its outer-leaf indices in order (`outer.fragments.partition`).
    """

    outer: OuterLeaves
    partition: list[list[int]]

    def take(self, tree, fragment: int) -> list:
        """The fragment's outer leaves of `tree`: a tree shaped like the island's parameters (its leaves or their
        layer slices, `OuterLeaves.of`) or like their per-layer form (the global parameters), in order."""
        leaves = (jax.tree.leaves(tree) if jax.tree.structure(tree) == self.outer.treedef
                  else self.outer.of(tree))
        return [leaves[i] for i in self.partition[fragment]]

    def put(self, tree, fragment: int, new_leaves: Sequence) -> Any:
        """`tree` (either shape, as `take`) with the fragment's outer leaves replaced by `new_leaves` (a new tree;
        `tree` is unchanged)."""
        if jax.tree.structure(tree) == self.outer.treedef:
            leaves = jax.tree.leaves(tree)
            for i, leaf in zip(self.partition[fragment], new_leaves):
                leaves[i] = leaf
            return jax.tree.unflatten(self.outer.treedef, leaves)
        return self.outer.put(tree, self.partition[fragment], new_leaves)


class FragmentExchange:
    """The fragment methods of `island.Island`, mixed into it: what the outer loop (`outer_loop.StreamingSync`)
    calls to contribute a fragment and to take its update, and `load_view` to rejoin from the island view.

    They read the island's config, mesh, device lock, parameters, anchor, global parameters and leaf layouts
    (`Island.__init__`); `_plan_fragments` makes the fragments (`partition`, `fragments`), the codecs, the
    chunk plans (`fragment_plans`, `update_plans`), the chunks' owners (`ownerships`) and the error-feedback
    `residual`.
    """

    def _plan_fragments(self) -> None:
        """The fragments of the outer leaves (`OuterLeaves`, `layouts`), their chunk plans and who owns each chunk."""
        config = self.config
        # Error feedback's memory of what the codec lost, of the pieces this process owns: {(fragment, leaf, first
        # element): float32 [piece elements]}, made as the pieces are first encoded.
        self.residual: dict[tuple[int, int, int], np.ndarray] = {}
        self.codec = codec.Codec.of(config.codec)  # the contributions'
        self.update_codec = codec.Codec.of(config.codec, update=True)  # the coordinator's updates'
        like = jax.tree.unflatten(self.outer.treedef, [jax.ShapeDtypeStruct(layout.shape, layout.dtype)
                                                       for layout in self.layouts])  # the outer leaves' shapes
        self.partition = fragments_lib.partition_params(like, config.outer.fragments, self.outer.stacked)
        self.fragments = FragmentLeaves(self.outer, self.partition)
        chunk_bytes = config.comm.chunk_bytes
        # per fragment: the contribution's chunk plan, and the update's (the same elements, in its codec's bytes)
        self.fragment_plans = [
            codec.chunk_plan(self.fragments.take(like, f), self.codec, None, chunk_bytes, self.update_codec)
            for f in range(len(self.partition))
        ]
        self.update_plans = [
            codec.chunk_plan(self.fragments.take(like, f), self.update_codec, None, chunk_bytes, self.codec)
            for f in range(len(self.partition))
        ]
        # per fragment: which process owns each chunk, and what travels over the island's interconnect
        self.ownerships = [
            shards_lib.Ownership(plan, [self.layouts[i] for i in self.partition[f]], self.parts, update)
            for f, (plan, update) in enumerate(zip(self.fragment_plans, self.update_plans))
        ]

    def fragment_pseudo_gradient(self, fragment: int) -> shards_lib.OwnedValues:
        """anchor - params (float32, each leaf's shape and sharding) over the fragment's leaves, computed on the
        island's devices, as the values of the chunks this process owns (`shards.Ownership`): read from its own
        shards where it holds them, and from the other processes (a collective over the island's interconnect)
        for the few elements at shard edges that it lacks.

        Runs on the calling (training) thread and waits for the result, so the
        next inner step may take (donate) the parameters.
        """
        with self.device_lock, jax.set_mesh(self.mesh):
            pseudo_gradient = jax.block_until_ready(
                self.outer.pseudo_gradient(self.anchor, self.params, self.partition[fragment]))
        layouts = self.ownerships[fragment].layouts
        local: dict[tuple[int, int], np.ndarray] = {}
        for i, leaf in enumerate(pseudo_gradient):
            for shard in leaf.addressable_shards:
                key = (i, layouts[i].key_of(shard.index))
                if key not in local:  # a view of the device buffer on the CPU; the leaves stay alive with it
                    local[key] = np.asarray(shard.data).reshape(-1)

        def read(leaf: int, shard: int, _keep=pseudo_gradient) -> np.ndarray:
            return local[(leaf, shard)]

        return self.ownerships[fragment].owner_values(read)

    def encode_fragment(self, fragment: int, pseudo_gradient: shards_lib.OwnedValues) -> codec.ChunkEncoder:
        """This process's chunks of the fragment's pseudo-gradient for the wire (`codec.ChunkEncoder` over its share
        of `fragment_plans[fragment]`, in `self.codec`; its `nbytes` is the share's bytes).

        Safe on a background thread. With error feedback (`codec.error_feedback`, always for topk), what the codec
        lost last time is added first, and the residual of each piece is
        overwritten as it is encoded. Once the payload is sent, the encoder's
        `relative_error` is ||sent - intended|| / ||intended||.
        """
        residual_of = None
        if error_feedback(self.config.codec):
            kept = self.residual  # an encoder left running past a rejoin writes to the replaced dict, not the new one

            def residual_of(piece: codec.Piece) -> np.ndarray:
                key = (fragment, piece.leaf, piece.start)
                found = kept.get(key)
                return found if found is not None else kept.setdefault(key, np.zeros(piece.stop - piece.start, np.float32))

        share = self.ownerships[fragment].share
        return codec.ChunkEncoder(None, self.codec, None, share, measure=True, read=pseudo_gradient.read,
                                  residual_of=residual_of, decay=self.config.codec.error_feedback_decay)

    def fragment_checksum(self, fragment: int) -> str:
        """`model.init.checksum` of the fragment's global leaves (a list): what its contribution carries. With one
        fragment it equals `global_checksum`. Of an island of several processes, a collective (training thread)."""
        return checksum(self.fragments.take(self.global_params, fragment))

    def gather_update(self, fragment: int, payload: bytes) -> dict:
        """Where this process reads each update chunk of the fragment that it holds elements of: its own chunks in
        `payload` (what its transport fetched), the others' passed on by their owners over the island's
        interconnect (`shards.Ownership.update_sources`: a collective, on the training thread, when any chunk
        has holders besides its owner)."""
        return self.ownerships[fragment].update_sources(payload)

    def decode_fragment(self, fragment: int, update) -> list[shards_lib.HostLeaf]:
        """The fragment's new global leaves, this process's shards of them: the update applied with the arithmetic
        of `codec.decode_and_apply`, chunk by chunk. `update`: `gather_update`'s sources, or (an island of one
        process) the fetched payload itself.

        Safe on a background thread with one process (reads only this fragment's global leaves).

        Raises:
          CodecError: if the update does not fit the fragment.
        """
        ownership = self.ownerships[fragment]
        if not isinstance(update, dict):
            expected = sum(chunk.nbytes for chunk in self.update_plans[fragment])
            if len(update) != expected:
                raise codec.CodecError(
                    f"the update of fragment {fragment} is {len(update)} bytes but its {self.update_codec} plan holds "
                    f"{expected}; the coordinator uses another model shape or codec (codec.update_kind)")
            update = ownership.update_sources(update)
        return ownership.apply(self.fragments.take(self.global_params, fragment), update, self.update_codec)

    def place_fragment(self, fragment: int, global_leaves: list[shards_lib.HostLeaf], copies: int) -> list[list[jax.Array]]:
        """`copies` placements of a fragment's new global leaves on the island's devices, for
        `apply_fragment` (one for the anchor, one more for the parameters without mixing). Safe on a
        background thread, so the training thread does not wait for the copies."""
        placed = [[leaf.place() for leaf in global_leaves] for _ in range(copies)]
        return jax.block_until_ready(placed)

    def apply_fragment(
        self, fragment: int, global_leaves: list[np.ndarray], mix_alpha: float | None = None, placed=None
    ) -> None:
        """Takes a fragment's new global leaves: they become its anchor, and its parameters become
        `mix_alpha` x local + (1 - mix_alpha) x global (Streaming DiLoCo's mixing), or exactly the
        global values when `mix_alpha` is None (no overlap). `placed`: `place_fragment`'s copies
        (two without mixing), when already made."""
        fragments = self.fragments
        self.global_params = fragments.put(self.global_params, fragment, global_leaves)
        self._global_checksum = None
        if placed is None:
            placed = self.place_fragment(fragment, global_leaves, 1 if mix_alpha is not None else 2)
        with self.device_lock, jax.set_mesh(self.mesh):
            new_anchor = placed[0]
            if mix_alpha is None:
                new_params = placed[1]
            else:  # dispatched; the next inner step waits for it
                local = fragments.take(self.params, fragment)
                new_params = step_lib.mix(local, new_anchor, np.float32(mix_alpha))
            self.anchor = fragments.put(self.anchor, fragment, new_anchor)
            self.params = fragments.put(self.params, fragment, new_params)

    def view_chunks(self, plan: list[codec.Chunk]) -> list[codec.Chunk]:
        """The chunks of the view's plan (a float32 "none" payload of every leaf) that hold elements of this
        process's shards (`shards.view_chunks`): all of them with one process."""
        return list(plan) if not self.multi_process else shards_lib.view_chunks(plan, self.layouts)

    def load_view(self, payload: bytes) -> None:
        """Replaces the global parameters with the coordinator's view, sent whole (`Coordinator.fetch_view`,
        a float32 "none" payload); this process keeps its own shards of it, which become both anchor and
        parameters, and the error feedback starts afresh.

        Raises:
          CodecError: if the payload does not fit the model.
        """
        leaves, treedef = jax.tree.flatten(self.global_params)
        like = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        expected = codec.payload_bytes(like, "none", 1)
        if len(payload) != expected:
            raise codec.CodecError(f"the view is {len(payload)} bytes but a float32 view of these parameters is "
                                   f"{expected} bytes; the coordinator uses a different model shape")
        whole = codec.Chunk(0, 0, expected, tuple(codec.pieces(like, "none", 1)))
        ownership = shards_lib.Ownership([whole], self.layouts, self.parts)
        self.global_params = jax.tree.unflatten(treedef, ownership.apply(leaves, {0: (memoryview(payload), 0)}, codec.Codec("none"), add=False))
        self._global_checksum = None
        # what the codec lost of pseudo-gradients from the replaced anchors is no debt of the new ones
        self.residual = {}
        with jax.set_mesh(self.mesh):
            self.params = self.outer.island_tree([leaf.place() for leaf in jax.tree.leaves(self.global_params)])
            self.anchor = self.outer.island_tree([leaf.place() for leaf in jax.tree.leaves(self.global_params)])
