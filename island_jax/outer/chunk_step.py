"""The coordinator's merge, outer step and update encoding for one chunk of the payload, in rows.

A chunk (`codec.Chunk`) is a float32 matrix of R rows of W elements (`codec.row_elements`: whole blocks or
top-k groups of both codecs), each piece from a new row, zero-padded to one R for every chunk so that one
compiled program serves all; zeros stay zero through merge, step and codec. Top-k contributions stay sparse
(kept values, row positions) until a scatter-add. Per contributor count K, `ChunkStep` compiles (DiLoCo, arXiv
2311.08105, Algorithm 1, lines 12-14; `outer/reference.py` shows it over whole trees):

  merged = sum_k weight[k] * dequantize(codes[k], scales[k])     [R * W] float32, in island order
           (weight[k] one number, or per row / element where routed experts' rows take the weights of their
           routed counts: `coordinator/expert_merge.py`)
  master, opt_state = optax outer step(merged);  delta = master - view
  update = quantize(delta) (`codec.blocks`; a top-k update is cut on the host)
  view = view + dequantize(update), rounded to bfloat16 on bfloat16 leaves' rows: a second program, since
  within one XLA fuses the multiply and add that the islands' NumPy `codec.decode_and_apply` rounds twice.
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
from island_jax.outer.codec import blocks, topk

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


def row_layouts(plan: list[codec.Chunk], width: int) -> tuple[list[RowLayout], int]:
    """The row layout of every chunk (rows of `width` elements), and the padded row count R shared by all."""
    layouts = []
    for chunk in plan:
        offsets, row = [], 0
        for p in chunk.pieces:
            offsets.append(row)
            row += -(-(p.stop - p.start) // width)
        layouts.append(RowLayout(chunk, tuple(offsets), row))
    return layouts, max((lay.rows for lay in layouts), default=1) or 1


def most_kept(layouts: list[RowLayout], fmt: codec.Codec) -> int:
    """M: the most values any chunk of a top-k payload keeps (every chunk's sparse rows are padded to it); 1 for
    the dense kinds."""
    if fmt.kind != "topk":
        return 1
    counts = [sum(topk.kept(p.stop - p.start, fmt.topk_group, fmt.topk_k) for p in lay.chunk.pieces) for lay in layouts]
    return max(counts, default=1) or 1


def wire_to_rows(buf, layout: RowLayout, fmt: codec.Codec, width: int, num_rows: int,
                 kept: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One contribution's chunk, as it came off the wire, laid out in rows (not yet dequantized).

    Args:
      buf: the chunk's bytes (`layout.chunk.nbytes` of them), bytes or a memoryview.
      layout: the chunk's rows; fmt: the contribution's codec; width: W, elements per row; num_rows: the padded R;
      kept: M (`most_kept`), for topk.

    Returns:
      Dense kinds: (values [R * W]: int8 codes for int8 / int4, bfloat16 or float32
      values otherwise; scales [R * W / block_size] float32, ones for none / bf16).
      topk: (values float32 [M]; their positions int32 [M] in the rows, R * W for the padding).
    """
    base = layout.chunk.offset
    if fmt.kind == "topk":
        values = np.zeros(kept, np.float32)
        positions = np.full(kept, num_rows * width, np.int32)
        at = 0
        for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
            where, got = topk.decode_sparse(buf, piece.stop - piece.start, fmt.topk_group, fmt.topk_k,
                                            piece.offset - base)
            positions[at : at + where.size] = where + row * width
            values[at : at + got.size] = got
            at += where.size
        return values, positions
    kind, block_size = fmt.kind, fmt.block_size
    per_row = width // block_size
    values = np.zeros(num_rows * width, _WIRE_DTYPE[kind])
    scales = np.ones(num_rows * per_row, np.float32)
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        n, offset = piece.stop - piece.start, piece.offset - base
        start = row * width
        if kind == "none" or kind == "bf16":
            values[start : start + n] = np.frombuffer(buf, _WIRE_DTYPE[kind], n, offset)
            continue
        code_bytes = n if kind == "int8" else (n + 1) // 2
        if kind == "int8":
            values[start : start + n] = np.frombuffer(buf, np.int8, n, offset)
        else:
            values[start : start + n] = blocks.unpack_int4(np.frombuffer(buf, np.uint8, code_bytes, offset), n)
        num_blocks = -(-n // block_size)
        scales[row * per_row : row * per_row + num_blocks] = np.frombuffer(buf, "<f4", num_blocks, offset + code_bytes)
    return values, scales


def finite(fmt: codec.Codec, values: np.ndarray, scales: np.ndarray) -> bool:
    """Whether a contribution's chunk (`wire_to_rows`) holds only finite numbers."""
    if fmt.kind == "topk":
        return bool(np.isfinite(values).all())
    return bool(np.isfinite(scales).all() and (fmt.kind in codec.QUANTIZED_KINDS or np.isfinite(values).all()))


def rows_to_wire(values: np.ndarray, scales: np.ndarray, layout: RowLayout, fmt: codec.Codec, width: int) -> bytes:
    """The chunk's bytes in the payload layout, from row-laid codes (or values) and scales of a dense codec."""
    out = []
    kind, block_size = fmt.kind, fmt.block_size
    per_row = width // block_size
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        n, start = piece.stop - piece.start, row * width
        v = values[start : start + n]
        if kind == "none":
            out.append(v.astype("<f4").tobytes())
        elif kind == "bf16":
            out.append(v.tobytes())
        else:
            out.append(v.tobytes() if kind == "int8" else blocks.pack_int4(v))
            out.append(scales[row * per_row : row * per_row + -(-n // block_size)].astype("<f4").tobytes())
    return b"".join(out)


def gather_rows(leaves: list[np.ndarray], layout: RowLayout, width: int, num_rows: int) -> np.ndarray:
    """The chunk's elements of `leaves` (pytree-flatten order) as float32 rows [R * width]."""
    rows = np.zeros(num_rows * width, np.float32)
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        flat = leaves[piece.leaf].reshape(-1)
        rows[row * width : row * width + piece.stop - piece.start] = flat[piece.start : piece.stop]
    return rows


def scatter_rows(rows: np.ndarray, layout: RowLayout, leaves: list[np.ndarray], width: int) -> None:
    """Writes the chunk's elements of float32 `rows` [R * width] into flat views of `leaves`, in place."""
    for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
        flat = leaves[piece.leaf].reshape(-1)
        flat[piece.start : piece.stop] = rows[row * width : row * width + piece.stop - piece.start]


def _apply_update(view, sent, bf16_rows):
    """view + sent ([R * W] float32), rounded to bfloat16 on the rows `bf16_rows` [R] marks."""
    new = view + sent
    rows = new.reshape(bf16_rows.shape[0], -1)
    rounded = jnp.where(bf16_rows[:, None], rows.astype(jnp.bfloat16).astype(jnp.float32), rows)
    return rounded.reshape(-1)


class ChunkStep:
    """The jitted per-chunk merge + outer step + update encoding (see the module docstring).

    Args:
      tx: the outer optimizer (optax), applied to each chunk with its own state.
      up, down: the contributions' and the update's codecs.
      width: W, elements per row (`codec.row_elements(up, down)`).
      num_rows: the padded row count R of every chunk.
    """

    def __init__(self, tx: optax.GradientTransformation, up: codec.Codec, down: codec.Codec, width: int,
                 num_rows: int):
        self.tx, self.up, self.down, self.width, self.num_rows = tx, up, down, width, num_rows
        self.cpu = jax.local_devices(backend="cpu")[0]  # of a coordinator shard's jax.distributed job: its own
        self._step = jax.jit(self._program)
        self._apply = jax.jit(_apply_update)

    def init(self, master_rows: np.ndarray) -> Any:
        """The outer optimizer's state for one chunk (on the CPU)."""
        with jax.default_device(self.cpu):
            return jax.device_get(self.tx.init(jnp.asarray(master_rows)))

    def _elements(self, weights):
        """Contributor k's weight of each element, [K, R * W], from per-row weights [K, R] or per-element ones."""
        if weights.shape[1] == self.num_rows * self.width:
            return weights
        return jnp.repeat(weights, self.width, axis=1)

    def _merge(self, values, scales, weights):
        """The weighted mean of K contributions' rows, sum_k w_k * g_k in island order, and their dot products
        [K, K]. `weights`: float32 [K] (one per contribution), [K, R] (per row) or [K, R * W] (per element)."""
        n, count = self.num_rows * self.width, values.shape[0]
        if self.up.kind == "topk":  # a sparse add of each island's kept values; `scales` holds their positions
            merged = jnp.zeros(n, jnp.float32)
            dense = []
            for k in range(count):
                w = weights[k] if weights.ndim == 1 else jnp.take(self._elements(weights)[k], scales[k], mode="fill",
                                                                  fill_value=0)
                merged = merged.at[scales[k]].add(w * values[k], mode="drop")
                dense.append(jnp.zeros(n, jnp.float32).at[scales[k]].set(values[k], mode="drop"))
            dots = jnp.stack([
                jnp.stack([jnp.sum(jnp.take(dense[i], scales[j], mode="fill", fill_value=0) * values[j])
                           for j in range(count)])
                for i in range(count)
            ])
            return merged, dots
        block = self.up.block_size
        shape = (count, n // block, block)
        pseudo_gradients = blocks.dequantize(values.astype(jnp.float32).reshape(shape), scales.reshape(shape[:2]))
        merged = jnp.zeros(shape[1:], jnp.float32)
        if weights.ndim == 2:  # per row or element: [K, R * W / block, block]
            weights = self._elements(weights).reshape(shape)
        for k in range(count):
            merged = merged + weights[k] * pseudo_gradients[k]
        flat = pseudo_gradients.reshape(count, -1)
        return merged.reshape(-1), flat @ flat.T  # squared norms on the diagonal

    def _program(self, values, scales, weights, master, opt_state, view):
        merged, dots = self._merge(values, scales, weights)
        updates, opt_state = self.tx.update(merged, opt_state, master)
        master = optax.apply_updates(master, updates)
        delta = master - view
        if self.down.kind == "topk":  # cut on the host from master - view (`__call__`)
            return master, opt_state, delta, None, None, dict(dots=dots)
        if self.down.kind == "none":
            codes, update_scales, sent = delta, jnp.ones(1, jnp.float32), delta
        elif self.down.kind == "bf16":
            codes = delta.astype(jnp.bfloat16)
            update_scales, sent = jnp.ones(1, jnp.float32), codes.astype(jnp.float32)
        else:
            rows = delta.reshape(-1, self.down.block_size)
            codes, update_scales = blocks.quantize(rows, codec.MAX_CODE[self.down.kind], jnp)
            sent = blocks.dequantize(codes, update_scales).reshape(-1)
            codes = codes.astype(jnp.int8).reshape(-1)
        stats = dict(dots=dots, intended_sq=jnp.sum(delta * delta), lost_sq=jnp.sum((delta - sent) ** 2))
        return master, opt_state, sent, codes, update_scales, stats

    def _topk_update(self, delta: np.ndarray, layout: RowLayout) -> tuple[bytes, np.ndarray]:
        """A top-k update's bytes for one chunk, cut piece by piece from master - view `delta` [R * W], and
        what they decode to, in rows (the values the islands add)."""
        fmt, width = self.down, self.width
        sent = np.zeros_like(delta)
        out = []
        for piece, row in zip(layout.chunk.pieces, layout.row_offsets):
            start, n = row * width, piece.stop - piece.start
            encoded = topk.encode(delta[start : start + n], fmt.topk_group, fmt.topk_k)
            where, values = topk.decode_sparse(encoded, n, fmt.topk_group, fmt.topk_k)
            sent[start + where] = values
            out.append(encoded)
        return b"".join(out), sent

    def __call__(self, values, scales, weights, master, opt_state, view, bf16_rows, layout: RowLayout):
        """One chunk: K contributions' rows (`wire_to_rows`, stacked), float32 weights [K] (or per row [K, R] or
        per element [K, R * W]), master / view rows
        [R * W], the chunk's state, which rows hold bfloat16 leaves (bool [R]), and the chunk's `layout`.

        Returns:
          (new master rows, new optimizer state, new view rows, the chunk's update bytes, stats with `dots`
          [K, K], `intended_sq`, `lost_sq`); master, state and view stay on the CPU device.
        """
        with jax.default_device(self.cpu):
            master, opt_state, sent, codes, update_scales, stats = self._step(
                values, scales, weights, master, opt_state, view
            )
            if self.down.kind == "topk":
                delta = np.asarray(jax.device_get(sent))
                payload, sent = self._topk_update(delta, layout)
                stats = dict(dots=jax.device_get(stats["dots"]), intended_sq=float(np.dot(delta, delta)),
                             lost_sq=float(np.sum(np.square(delta - sent, dtype=np.float64))))
                view = self._apply(view, self.place(sent), bf16_rows)
                return master, opt_state, view, payload, stats
            view = self._apply(view, sent, bf16_rows)
            codes, update_scales, stats = jax.device_get((codes, update_scales, stats))
            return master, opt_state, view, rows_to_wire(codes, update_scales, layout, self.down, self.width), stats

    def place(self, rows: Any) -> Any:
        """Rows (or an optimizer state over rows) on the CPU device, where the program keeps them between
        rounds, placed as its outputs are, so that round 0 and later rounds share one compiled program."""
        return jax.device_put(rows, self.cpu)
