"""The coordinator's merge, outer step and update encoding for one chunk of the payload.

The outer step is elementwise (Streaming DiLoCo, arXiv 2501.18512, relies on
the same property), so the coordinator can merge, step and encode chunk k of
the update as soon as every contributing island's chunk k has arrived, while
later chunks are still on the wire. This module holds the per-chunk math; the
coordinator decides when a chunk is ready.

Rows. A chunk (`codec.Chunk`) is a run of pieces of leaves; here it is held as
a float32 matrix of R rows of `block_size` elements, each piece starting on a
new row and padded with zeros to whole rows, and all chunks padded to the same
R so that one compiled program serves every chunk. Zero padding stays zero
through the merge, the SGD outer step (zero gradient, zero momentum) and the
codec, and is never put on the wire.

`ChunkStep` compiles, per number of contributors K, one XLA program
(DiLoCo, arXiv 2311.08105, Algorithm 1, lines 12-14, for one chunk):

  pseudo_gradient[k] = dequantize(codes[k], scales[k])            [K, R, B] float32
  merged             = sum_k weight[k] * pseudo_gradient[k]       [R, B] float32
  master, opt_state  = optax outer step(merged)                   [R, B] float32
  delta              = master - view                              [R, B] float32
  update codes/scales = quantize(delta) with the run's codec
  view               = view + dequantize(update codes, scales)    [R, B] float32
                       (rounded to bfloat16 on the rows of bfloat16 leaves)

The last line is the islands' `codec.decode_and_apply`, bit for bit. It runs
as a second program: within one, XLA fuses the dequantizing multiply and the
add into a fused multiply-add, which rounds once where the islands' NumPy
rounds twice (an optimization barrier does not stop it).

and the partial sums the round's log needs (squared norms, dot products).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from island_jax.outer import codec

_WIRE_DTYPE = {"none": np.dtype("<f4"), "bf16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8), "int4": np.dtype(np.int8)}


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where the pieces of one chunk sit in its row matrix.

    Attributes:
      chunk: the chunk (`codec.chunk_plan`).
      row_offsets: first row of each piece.
      rows: rows the chunk's pieces use (<= the padded row count).
    """

    chunk: codec.Chunk
    row_offsets: tuple[int, ...]
    rows: int


def row_layouts(plan: list[codec.Chunk], block_size: int) -> tuple[list[RowLayout], int]:
    """The row layout of every chunk, and the padded row count R shared by all of them."""
    layouts = []
    for chunk in plan:
        offsets, row = [], 0
        for p in chunk.pieces:
            offsets.append(row)
            row += -(-(p.stop - p.start) // block_size)
        layouts.append(RowLayout(chunk, tuple(offsets), row))
    return layouts, max((lay.rows for lay in layouts), default=1) or 1


def wire_to_rows(buf, layout: RowLayout, kind: str, block_size: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """One contribution's chunk, as it came off the wire, laid out in rows (not yet dequantized).

    Args:
      buf: the chunk's bytes (`layout.chunk.nbytes` of them), bytes or a memoryview.
      layout, kind, block_size: as for the run; `num_rows` is the padded R.

    Returns:
      (values [R * block_size]: int8 codes for int8 / int4, bfloat16 or float32
      values otherwise; scales [R] float32, ones for none / bf16).
    """
    values = np.zeros(num_rows * block_size, _WIRE_DTYPE[kind])
    scales = np.ones(num_rows, np.float32)
    base = layout.chunk.offset
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        n, offset = piece.stop - piece.start, piece.offset - base
        start = row * block_size
        if kind == "none" or kind == "bf16":
            values[start : start + n] = np.frombuffer(buf, _WIRE_DTYPE[kind], n, offset)
            continue
        code_bytes = n if kind == "int8" else (n + 1) // 2
        if kind == "int8":
            values[start : start + n] = np.frombuffer(buf, np.int8, n, offset)
        else:
            values[start : start + n] = codec._unpack_int4(np.frombuffer(buf, np.uint8, code_bytes, offset), n)
        num_blocks = -(-n // block_size)
        scales[row : row + num_blocks] = np.frombuffer(buf, "<f4", num_blocks, offset + code_bytes)
    return values, scales


def rows_to_wire(values: np.ndarray, scales: np.ndarray, layout: RowLayout, kind: str, block_size: int) -> bytes:
    """The chunk's bytes in the payload layout, from row-laid codes (or values) and scales."""
    out = []
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        n, start = piece.stop - piece.start, row * block_size
        v = values[start : start + n]
        if kind == "none":
            out.append(v.astype("<f4").tobytes())
        elif kind == "bf16":
            out.append(v.tobytes())
        else:
            out.append(v.tobytes() if kind == "int8" else codec._pack_int4(v))
            out.append(scales[row : row + -(-n // block_size)].astype("<f4").tobytes())
    return b"".join(out)


def gather_rows(leaves: list[np.ndarray], layout: RowLayout, block_size: int, num_rows: int) -> np.ndarray:
    """The chunk's elements of `leaves` (pytree-flatten order) as float32 rows [R * block_size]."""
    rows = np.zeros(num_rows * block_size, np.float32)
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        flat = leaves[piece.leaf].reshape(-1)
        rows[row * block_size : row * block_size + piece.stop - piece.start] = flat[piece.start : piece.stop]
    return rows


def scatter_rows(rows: np.ndarray, layout: RowLayout, leaves: list[np.ndarray], block_size: int) -> None:
    """Writes the chunk's elements of float32 `rows` [R * block_size] into flat views of `leaves`, in place."""
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        flat = leaves[piece.leaf].reshape(-1)
        flat[piece.start : piece.stop] = rows[row * block_size : row * block_size + piece.stop - piece.start]


def _apply_update(view, sent, bf16_rows):
    """view + sent ([R * B] float32), rounded to bfloat16 on the rows `bf16_rows` [R] marks."""
    new = view + sent
    rows = new.reshape(bf16_rows.shape[0], -1)
    rounded = jnp.where(bf16_rows[:, None], rows.astype(jnp.bfloat16).astype(jnp.float32), rows)
    return rounded.reshape(-1)


class ChunkStep:
    """The jitted per-chunk merge + outer step + update encoding (see the module docstring).

    Args:
      tx: the outer optimizer (optax), applied to each chunk with its own state.
      kind, block_size: the run's codec.
      num_rows: the padded row count R of every chunk.
    """

    def __init__(self, tx: optax.GradientTransformation, kind: str, block_size: int, num_rows: int):
        self.tx, self.kind, self.block_size, self.num_rows = tx, kind, block_size, num_rows
        self.cpu = jax.devices("cpu")[0]
        self._step = jax.jit(self._program)
        self._apply = jax.jit(_apply_update)

    def init(self, master_rows: np.ndarray) -> Any:
        """The outer optimizer's state for one chunk (on the CPU)."""
        with jax.default_device(self.cpu):
            return jax.device_get(self.tx.init(jnp.asarray(master_rows)))

    def _program(self, values, scales, weights, master, opt_state, view):
        shape = (values.shape[0], self.num_rows, self.block_size)
        pseudo_gradients = values.astype(jnp.float32).reshape(shape) * scales[:, :, None]
        merged = jnp.zeros(shape[1:], jnp.float32)
        for k in range(shape[0]):  # token-weighted mean: sum_k (t_k / sum t) * g_k, in island order
            merged = merged + weights[k] * pseudo_gradients[k]
        updates, opt_state = self.tx.update(merged.reshape(-1), opt_state, master)
        master = optax.apply_updates(master, updates)
        delta = (master - view).reshape(shape[1:])
        if self.kind == "none":
            codes, update_scales, sent = delta, jnp.ones(shape[1], jnp.float32), delta
        elif self.kind == "bf16":
            codes = delta.astype(jnp.bfloat16)
            update_scales, sent = jnp.ones(shape[1], jnp.float32), codes.astype(jnp.float32)
        else:
            max_code = codec.MAX_CODE[self.kind]
            update_scales = jnp.max(jnp.abs(delta), axis=1) / max_code
            safe = jnp.where(update_scales > 0, update_scales, 1.0)
            codes = jnp.clip(jnp.round(delta / safe[:, None]), -max_code, max_code)
            sent = codes * update_scales[:, None]
            codes = codes.astype(jnp.int8)
        flat = pseudo_gradients.reshape(shape[0], -1)
        stats = dict(
            dots=flat @ flat.T,  # [K, K]: squared norms on the diagonal
            intended_sq=jnp.sum(delta * delta),
            lost_sq=jnp.sum((delta - sent) ** 2),
        )
        return master, opt_state, sent.reshape(-1), codes.reshape(-1), update_scales, stats

    def __call__(self, values, scales, weights, master, opt_state, view, bf16_rows):
        """One chunk: K contributions' rows, float32 weights [K], master / view rows [R * B], the chunk's
        state, and which rows hold bfloat16 leaves (bool [R]).

        Returns:
          (new master rows, new optimizer state, new view rows, update codes or
          values [R * B], update scales [R], stats with `dots` [K, K],
          `intended_sq`, `lost_sq`); master, state and view stay on the CPU
          device, the rest comes to the host.
        """
        with jax.default_device(self.cpu):
            master, opt_state, sent, codes, update_scales, stats = self._step(
                values, scales, weights, master, opt_state, view
            )
            view = self._apply(view, sent, bf16_rows)
            return (master, opt_state, view, *jax.device_get((codes, update_scales, stats)))

    def place(self, rows: Any) -> Any:
        """Rows (or an optimizer state over rows) on the CPU device, where the program keeps them between
        rounds, placed as its outputs are, so that round 0 and later rounds share one compiled program."""
        return jax.device_put(rows, self.cpu)
