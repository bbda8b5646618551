"""One fragment's global state on the coordinator, in chunk rows: master, outer optimizer state, island view."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import ml_dtypes
import numpy as np

from island_jax.model.init import checksum
from island_jax.outer import chunk_step, codec
from island_jax.outer.optimizer import outer_optimizer


class FragmentState:
    """A fragment's float32 master parameters, outer optimizer state and island view, held chunk by chunk.

    The payload's chunks (`codec.chunk_plan` of `comm.chunk_bytes`) are each a
    float32 row matrix [R * block_size] (`outer/chunk_step.py`, padded to the
    same R): the master's rows, one optax state over them, and the island
    view's rows (rounded to bfloat16 on the rows of bfloat16 leaves, as the
    islands' `codec.decode_and_apply` rounds them). The merge program reads and
    writes rows on the CPU device; pytrees are laid out only when asked for.

    Args:
      config: the run's config (`codec.kind`, `codec.block_size`,
        `comm.chunk_bytes`, and `outer` for the outer optimizer).
      params: the fragment's initial parameters, a pytree of float32 or
        bfloat16 NumPy arrays (the view keeps their dtypes).

    Raises:
      ValueError: a leaf of another dtype.
    """

    def __init__(self, config: ml_collections.ConfigDict, params: Any):
        self.kind, self.block_size = config.codec.kind, config.codec.block_size
        view = jax.tree.map(lambda x: np.array(x, copy=True), params)
        self._treedef = jax.tree.structure(view)
        self._leaf_specs = [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(view)]
        self._checksum: str | None = None
        self.plan = codec.chunk_plan(view, self.kind, self.block_size, config.comm.chunk_bytes)
        self.payload_bytes = codec.payload_bytes(view, self.kind, self.block_size)
        self.layouts, self.num_rows = chunk_step.row_layouts(self.plan, self.block_size)
        self._step = chunk_step.ChunkStep(outer_optimizer(config), self.kind, self.block_size, self.num_rows)
        self._bf16_rows = [self._bf16_mask(lay) for lay in self.layouts]
        self.master_rows = self._rows_of(params)
        self.opt = [self._step.place(self._step.init(m)) for m in self.master_rows]
        # The view lives in rows next to the master (the merge program updates it); `view` lays it out.
        self.view_rows = self._rows_of(view)
        self._view: Any = view

    def _bf16_mask(self, layout: chunk_step.RowLayout) -> np.ndarray:
        """bool [R]: the rows of `layout` that hold a bfloat16 leaf (its view is rounded to bfloat16)."""
        mask = np.zeros(self.num_rows, bool)
        for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
            dtype = self._leaf_specs[piece.leaf][1]
            if dtype == ml_dtypes.bfloat16:
                mask[row : row + -(-(piece.stop - piece.start) // self.block_size)] = True
            elif dtype != np.float32:
                raise ValueError(f"parameters of dtype {dtype} are not supported; use float32 or bfloat16")
        return mask

    def _rows_of(self, tree: Any) -> list:
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
        return [
            self._step.place(chunk_step.gather_rows(leaves, lay, self.block_size, self.num_rows)) for lay in self.layouts
        ]

    def _tree_of(self, rows: list, dtypes: bool) -> Any:
        """A pytree of NumPy arrays from per-chunk rows, in the leaves' dtypes (or float32)."""
        leaves = [np.empty(shape, dtype if dtypes else np.float32) for shape, dtype in self._leaf_specs]
        for chunk_rows, lay in zip(rows, self.layouts):
            chunk_step.scatter_rows(np.asarray(chunk_rows), lay, leaves, self.block_size)
        return jax.tree.unflatten(self._treedef, leaves)

    # -- the merge ---------------------------------------------------------------------------------------

    def decode(self, index: int, data) -> tuple[np.ndarray, np.ndarray]:
        """Chunk `index` of a contribution (bytes or memoryview) in rows, not yet dequantized.

        Returns:
          (values [R * block_size]: int8 codes, bfloat16 or float32 values by
          codec; scales [R] float32), as `chunk_step.wire_to_rows`.
        """
        return chunk_step.wire_to_rows(data, self.layouts[index], self.kind, self.block_size, self.num_rows)

    def step(self, index: int, values, scales, weights, master, opt, view) -> tuple:
        """Chunk `index`'s merge, outer step and update encoding (DiLoCo, arXiv 2311.08105, Algorithm 1,
        lines 12-14, on one chunk; `chunk_step.ChunkStep`).

        Args:
          values, scales: K contributions' rows, [K, R * block_size] and [K, R].
          weights: float32 [K], the token weights (summing to 1).
          master, opt, view: the chunk's rows and optimizer state to start from.

        Returns:
          (master rows, optimizer state, view rows, the chunk's update bytes in
          the payload layout, stats with `dots` [K, K], `intended_sq`, `lost_sq`).
        """
        master, opt, view, codes, update_scales, stats = self._step(
            values, scales, weights, master, opt, view, self._bf16_rows[index]
        )
        payload = chunk_step.rows_to_wire(codes, update_scales, self.layouts[index], self.kind, self.block_size)
        return master, opt, view, payload, stats

    def warm_up(self, contributors: int) -> None:
        """Compiles the chunk program for `contributors` islands now, so the first merge does not wait for XLA."""
        layout, k = self.layouts[0], contributors
        values, scales = chunk_step.wire_to_rows(
            bytes(layout.chunk.nbytes), layout, self.kind, self.block_size, self.num_rows
        )
        weights = np.full(k, np.float32(1.0 / k), np.float32)
        self._step(
            np.stack([values] * k), np.stack([scales] * k), weights, self.master_rows[0], self.opt[0],
            self.view_rows[0], self._bf16_rows[0],
        )

    def commit(self, master_rows: list, opt: list, view_rows: list) -> None:
        """Makes a merged round's rows and optimizer states (one per chunk) the fragment's state."""
        self.master_rows, self.opt, self.view_rows = master_rows, opt, view_rows
        self._view, self._checksum = None, None

    # -- views of the state ------------------------------------------------------------------------------

    @property
    def view(self) -> Any:
        """The island view (what every island holds after the latest update): a pytree of NumPy arrays
        in the parameters' dtypes, laid out from the rows when first asked for after each round."""
        if self._view is None:
            self._view = self._tree_of(self.view_rows, dtypes=True)
        return self._view

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the island view, computed when first asked for after each round.

        (SHA-256 over every parameter takes a while for a large model: left out
        of the merge, it never delays an update.)
        """
        if self._checksum is None:
            self._checksum = checksum(self.view)
        return self._checksum

    def checksum_of(self, view_rows: list) -> str:
        """`model.init.checksum` of the view held in `view_rows` (the current view's, or an older round's)."""
        return self.checksum if self.view_rows is view_rows else checksum(self._tree_of(view_rows, True))

    def state(self) -> dict:
        """`master` (float32 pytree, laid out afresh), `opt_state` (one optax state per chunk) and `view` (the
        current view's pytree, which is replaced after a round, never written in place)."""
        return dict(master=self._tree_of(self.master_rows, dtypes=False), opt_state=self.opt, view=self.view)

    def load_state(self, state: dict) -> None:
        """Continues from a `state()` (as restored from a checkpoint)."""
        self._view = jax.tree.map(lambda x: np.array(x, copy=True), state["view"])
        self.view_rows = self._rows_of(self._view)
        self.master_rows = self._rows_of(state["master"])
        self.opt = [self._step.place(x) for x in state["opt_state"]]
        self._checksum = None
