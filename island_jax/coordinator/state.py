"""One fragment's global state on the coordinator, in chunk rows: master, outer optimizer state, island view."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import ml_dtypes
import numpy as np

from island_jax.coordinator import expert_merge
from island_jax.model.init import checksum, checksum_parts
from island_jax.model.transformer import routing_shape
from island_jax.outer import chunk_step, codec
from island_jax.outer.optimizer import outer_optimizer


class FragmentState:
    """A fragment's float32 master parameters, outer optimizer state and island view, held chunk by chunk.

    The payload's chunks (`codec.chunk_plan` of `comm.chunk_bytes`, one plan for the
    contributions and the update) are each a
    float32 row matrix [R * W] (`outer/chunk_step.py`, padded to the
    same R): the master's rows, one optax state over them, and the island
    view's rows (rounded to bfloat16 on the rows of bfloat16 leaves, as the
    islands' `codec.decode_and_apply` rounds them). The merge program reads and
    writes rows on the CPU device; pytrees are laid out only when asked for.

    Args:
      config: the run's config (`codec`: both directions' codecs, `comm.chunk_bytes`, and `outer` for the outer
        optimizer).
      params: the fragment's initial parameters, a pytree of float32 or
        bfloat16 NumPy arrays (the view keeps their dtypes).
      owner: a coordinator shard (`shards.Shard`), whose range of the plan (`owned`) this holds; None: every
        chunk. The plan, layouts and padded row count are the whole plan's either way, so each chunk's
        program and bits are the same; rows of other chunks are None and never allocated.
      expert_layers: per leaf of `params`, the MoE layer whose routed experts it holds
        (`expert_merge.expert_leaves`) or None; None: no leaf does. `expert_slots` follows from it.
      router_layers: likewise the MoE layer whose router a leaf is (`expert_merge.router_leaves`), for
        `router_masks`.

    Raises:
      ValueError: a leaf of another dtype.
    """

    def __init__(self, config: ml_collections.ConfigDict, params: Any, owner=None, expert_layers=None,
                 router_layers=None):
        self.codec = codec.Codec.of(config.codec)
        self.update_codec = codec.Codec.of(config.codec, update=True)
        self._treedef = jax.tree.structure(params)
        self._leaf_specs = [(tuple(np.shape(x)), np.asarray(x).dtype) for x in jax.tree.leaves(params)]
        self._checksum: str | None = None
        chunk_bytes = config.comm.chunk_bytes
        self.plan = codec.chunk_plan(params, self.codec, None, chunk_bytes, self.update_codec)
        self.update_plan = codec.chunk_plan(params, self.update_codec, None, chunk_bytes, self.codec)
        self.payload_bytes = codec.payload_bytes(params, self.codec)
        self.update_bytes = codec.payload_bytes(params, self.update_codec)
        self.width = codec.row_elements(self.codec, self.update_codec)  # elements per row
        self.layouts, self.num_rows = chunk_step.row_layouts(self.plan, self.width)
        self.kept = chunk_step.most_kept(self.layouts, self.codec)
        if self.num_rows * self.width >= 2**31:  # top-k positions in a chunk's rows are int32
            raise ValueError(
                f"one chunk of the payload holds {self.num_rows * self.width:,} elements in the coordinator's rows, "
                f"more than int32 positions reach; lower comm.chunk_bytes (now {chunk_bytes:,})")
        self.owned = range(len(self.plan)) if owner is None else owner.owned(self.plan)
        self.sharded = owner is not None
        self._pieces_of_leaf = self._leaf_pieces()
        self._step = chunk_step.ChunkStep(outer_optimizer(config), self.codec, self.update_codec, self.width,
                                          self.num_rows)
        self._bf16_rows = [self._bf16_mask(lay) for lay in self.layouts]
        self.routing_shape = routing_shape(config)[:2]  # (MoE layers, experts): a contribution's counts
        # per chunk: the weight slot of each row or element (`expert_merge.expert_slots`); None: no routed expert
        layers = expert_layers if expert_layers is not None else [None] * len(self._leaf_specs)
        self.has_experts = any(x is not None for x in layers)  # of the whole fragment, whatever this shard owns
        sizes = [int(np.prod(shape)) for shape, _ in self._leaf_specs]
        self.expert_slots = [
            expert_merge.expert_slots(layers, sizes, self.routing_shape[1], lay, self.width, self.num_rows)
            if k in self.owned and self.has_experts else None
            for k, lay in enumerate(self.layouts)
        ]
        # per chunk: which elements of its rows are routers' (bool [R * W]), or None
        routers = router_layers if router_layers is not None else [None] * len(self._leaf_specs)
        self.router_masks = [
            expert_merge.leaf_mask(routers, lay, self.width, self.num_rows) if k in self.owned else None
            for k, lay in enumerate(self.layouts)
        ]
        self.master_rows = self._rows_of(params)
        self.opt = [None if m is None else self._step.place(self._step.init(m)) for m in self.master_rows]
        # The view lives in rows next to the master (the merge program replaces them; `view` lays them out). At
        # the start both hold the initial parameters, so they share their (immutable) arrays until the first merge.
        self.view_rows = list(self.master_rows)

    def _bf16_mask(self, layout: chunk_step.RowLayout) -> np.ndarray:
        """bool [R]: the rows of `layout` that hold a bfloat16 leaf (its view is rounded to bfloat16)."""
        mask = np.zeros(self.num_rows, bool)
        for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
            dtype = self._leaf_specs[piece.leaf][1]
            if dtype == ml_dtypes.bfloat16:
                mask[row : row + -(-(piece.stop - piece.start) // self.width)] = True
            elif dtype != np.float32:
                raise ValueError(f"parameters of dtype {dtype} are not supported; use float32 or bfloat16")
        return mask

    def _rows_of(self, tree: Any) -> list:
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
        return [
            self._step.place(chunk_step.gather_rows(leaves, lay, self.width, self.num_rows)) if k in self.owned
            else None for k, lay in enumerate(self.layouts)
        ]

    def _leaf_pieces(self) -> list[list[tuple[int, codec.Piece, int]]]:
        """For each leaf, (chunk index, piece, first row) of its pieces in element order."""
        pieces: list[list] = [[] for _ in self._leaf_specs]
        for index, lay in enumerate(self.layouts):
            if index not in self.owned:
                continue
            for piece, row in zip(lay.chunk.pieces, lay.row_offsets):
                pieces[piece.leaf].append((index, piece, row))
        return [sorted(p, key=lambda x: x[1].start) for p in pieces]

    def _row_leaves(self, rows: list) -> list["RowsLeaf"]:
        """The leaves held in per-chunk `rows`, each read in place (`RowsLeaf`), in pytree-flatten order."""
        return [
            RowsLeaf(shape, dtype, rows, pieces, self.width)
            for (shape, dtype), pieces in zip(self._leaf_specs, self._pieces_of_leaf)
        ]

    def _tree_of(self, rows: list, dtypes: bool) -> Any:
        """A pytree of NumPy arrays from per-chunk rows, in the leaves' dtypes (or float32)."""
        empty = np.zeros if self.sharded else np.empty  # a shard's leaves hold its ranges' elements, zeros elsewhere
        leaves = [empty(shape, dtype if dtypes else np.float32) for shape, dtype in self._leaf_specs]
        for chunk_rows, lay in zip(rows, self.layouts):
            if chunk_rows is None:
                continue
            chunk_step.scatter_rows(np.asarray(chunk_rows), lay, leaves, self.width)
        return jax.tree.unflatten(self._treedef, leaves)

    # -- the merge ---------------------------------------------------------------------------------------

    def decode(self, index: int, data) -> tuple[np.ndarray, np.ndarray]:
        """Chunk `index` of a contribution (bytes or memoryview) in rows, not yet dequantized: (values, scales), or
        for topk (values, positions), as `chunk_step.wire_to_rows`."""
        return chunk_step.wire_to_rows(data, self.layouts[index], self.codec, self.width, self.num_rows, self.kept)

    def finite(self, values, scales) -> bool:
        """Whether a decoded chunk (`decode`) holds only finite numbers."""
        return chunk_step.finite(self.codec, values, scales)

    def step(self, index: int, values, scales, weights, master, opt, view) -> tuple:
        """Chunk `index`'s merge, outer step and update encoding (DiLoCo, arXiv 2311.08105, Algorithm 1,
        lines 12-14, on one chunk; `chunk_step.ChunkStep`).

        Args:
          values, scales: K contributions' chunks (`decode`), stacked.
          weights: float32 [K], the contributors' weights (summing to 1); or per row [K, R] or per element
            [K, R * W] (`PartialMerge.chunk_weights`, experts merged by their routed counts: each row's or
            element's weights sum to 1, or to 0 for an expert no contributor routed to).
          master, opt, view: the chunk's rows and optimizer state to start from.

        Returns:
          (master rows, optimizer state, view rows, the chunk's update bytes in
          the payload layout, stats with `dots` [K, K], `intended_sq`, `lost_sq`).
        """
        return self._step(values, scales, weights, master, opt, view, self._bf16_rows[index], self.layouts[index])

    def dequantized(self, values, scales) -> np.ndarray:
        """A contribution's chunk (`decode`) as float32 rows [R * W], on the host: what the merge adds of it."""
        n = self.num_rows * self.width
        if self.codec.kind == "topk":  # `scales` holds the kept values' positions (R * W for padding)
            dense = np.zeros(n + 1, np.float32)
            dense[np.minimum(scales, n)] = values
            return dense[:n]
        block = self.codec.block_size
        return (np.asarray(values, np.float32).reshape(-1, block) * np.asarray(scales)[:, None]).reshape(-1)

    def warm_up(self, contributors: int) -> None:
        """Compiles the chunk program for `contributors` islands now, so the first merge does not wait for XLA: with
        one weight per contributor, and per row or per element where `expert_slots` asks for them."""
        if not self.owned:
            return
        first, k = self.owned[0], contributors
        layout = self.layouts[first]
        values, scales = self.decode(first, bytes(layout.chunk.nbytes))
        sizes = {len(s) for s in self.expert_slots if s is not None}  # R (per row) and / or R * W (per element)
        for weights in [np.full(k, np.float32(1.0 / k), np.float32), *(np.full((k, n), 1.0 / k, np.float32) for n in sizes)]:
            self._step(
                np.stack([values] * k), np.stack([scales] * k), weights, self.master_rows[first], self.opt[first],
                self.view_rows[first], self._bf16_rows[first], layout,
            )

    def commit(self, master_rows: list, opt: list, view_rows: list) -> None:
        """Makes a merged round's rows and optimizer states (one per chunk) the fragment's state."""
        self.master_rows, self.opt, self.view_rows = master_rows, opt, view_rows
        self._checksum = None

    # -- views of the state ------------------------------------------------------------------------------

    @property
    def view(self) -> Any:
        """The island view (what every island holds after the latest update): a new pytree of NumPy arrays in
        the parameters' dtypes, laid out from the rows at each call (the rows are the state: a kept copy would
        add 4 bytes per parameter to the coordinator's peak)."""
        return self._tree_of(self.view_rows, dtypes=True)

    @property
    def shapes(self) -> Any:
        """The parameters' pytree as `jax.ShapeDtypeStruct`s (for layouts and plans; nothing is laid out)."""
        return jax.tree.unflatten(self._treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self._leaf_specs])

    def view_leaves(self) -> list["RowsLeaf"]:
        """The island view's leaves as `RowsLeaf`s, read in place from the current rows (what `checksum` reads)."""
        return self._row_leaves(self.view_rows)

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the island view, read from the view's rows piece by piece (no laid-out
        copy) when first asked for after each round.

        (SHA-256 over every parameter takes a while for a large model: left out
        of the merge, it never delays an update.)
        """
        if self.sharded:
            raise RuntimeError("a shard holds part of the view: its checksum combines every shard's checksum_parts")
        if self._checksum is None:
            self._checksum = checksum(self._row_leaves(self.view_rows))
        return self._checksum

    def checksum_of(self, view_rows: list) -> str:
        """`model.init.checksum` of the view held in `view_rows` (the current view's, or an older round's)."""
        return self.checksum if self.view_rows is view_rows else checksum(self._row_leaves(view_rows))

    def state(self) -> dict:
        """`master` (float32 pytree, laid out afresh), `opt_state` (one optax state per chunk, as read-only NumPy
        views of its arrays on the CPU device, which the merge replaces and never writes or donates) and `view`
        (laid out afresh): arrays no later round writes, so a checkpoint may keep them as they are
        (`Checkpointer.save(frozen_numpy=True)`). A shard's (`owned` given): `master`, `opt_state` and `view` of
        its chunks only, as lists of rows [R * W] float32 in chunk order."""
        if self.sharded:
            owned = list(self.owned)
            return dict(master=[np.asarray(self.master_rows[k]) for k in owned],
                        opt_state=[jax.tree.map(np.asarray, self.opt[k]) for k in owned],
                        view=[np.asarray(self.view_rows[k]) for k in owned])
        opt = jax.tree.map(np.asarray, self.opt)
        return dict(master=self._tree_of(self.master_rows, dtypes=False), opt_state=opt, view=self.view)

    def load_state(self, state: dict) -> None:
        """Continues from a `state()` (as restored from a checkpoint).

        Raises:
          ValueError: its optimizer state was saved for another chunk layout (another codec, `codec.update_kind`
            or `comm.chunk_bytes`, or another shard's range): its momentum would not line up with these rows.
        """
        mine = [self.opt[k] for k in self.owned]
        ours = [jax.tree.map(np.shape, o) for o in mine]
        theirs = [jax.tree.map(np.shape, o) for o in state["opt_state"]]
        if ours != theirs:
            raise ValueError(
                f"the checkpoint's outer optimizer state is laid out in {len(theirs)} chunks of rows that differ from "
                f"this run's {len(ours)} (its codecs, comm.chunk_bytes or coordinator.shards changed): resume under "
                "the settings it was saved with")
        if self.sharded:
            self.view_rows, self.master_rows, self.opt = [None] * len(self.plan), [None] * len(self.plan), [None] * len(self.plan)
            for k, view, master, opt in zip(self.owned, state["view"], state["master"], state["opt_state"]):
                self.view_rows[k], self.master_rows[k] = self._step.place(view), self._step.place(master)
                self.opt[k] = self._step.place(opt)
        else:
            self.view_rows = self._rows_of(state["view"])
            self.master_rows = self._rows_of(state["master"])
            self.opt = [self._step.place(x) for x in state["opt_state"]]
        self._checksum = None

    def checksum_parts(self, view_rows: list | None = None) -> dict:
        """This shard's `model.init.checksum_parts` of the view held in `view_rows` (default: the current view)."""
        return checksum_parts(self._row_leaves(self.view_rows if view_rows is None else view_rows))


class RowsLeaf:
    """One leaf of the coordinator's state, read in place from per-chunk float32 rows: what `model.init.checksum`
    needs of a leaf (`shape`, `dtype`, `checksum_runs`) without laying the leaf out.

    Args:
      shape, dtype: the leaf's (float32 or bfloat16).
      rows: the per-chunk rows [R * width] float32 (NumPy or single-device CPU `jax.Array`s).
      pieces: (chunk index, piece, first row) of each of the leaf's pieces, in element order.
      width: elements per row (W).
    """

    def __init__(self, shape: tuple, dtype, rows: list, pieces: list, width: int):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self._rows, self._pieces, self._width = rows, pieces, width

    def checksum_runs(self):
        """(first flat element, uint8 bytes in the leaf's dtype) of each piece, in element order; a bfloat16
        piece is rounded from its float32 row values one piece at a time."""
        for index, piece, row in self._pieces:
            start = row * self._width
            values = np.asarray(self._rows[index])[start : start + piece.stop - piece.start]
            yield piece.start, np.ascontiguousarray(values.astype(self.dtype, copy=False)).view(np.uint8)
