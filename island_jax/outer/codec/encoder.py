"""Encoding a pseudo-gradient pytree for the wire, chunk by chunk, with error feedback.

`ChunkEncoder` builds a payload (`chunks.py`'s layout) chunk by chunk as the transport sends it, so the
encoding of later chunks overlaps the transfer of earlier ones: on the host in NumPy, or for arrays on an
accelerator in one XLA program over the whole tree that brings only the codes to the host. int8 and int4 use
the blockwise quantizer (`blocks.py`), topk its own groups (`topk.py`).

Error feedback (MuLoCo, SparseLoCo arXiv 2508.15706; the encoder's `residual`): what the codec lost last round,
scaled by beta (`codec.error_feedback_decay`), is added to this round's tree before encoding, and what it loses
now (intended - sent, float32) is kept for the next round, so quantization error is delayed, never dropped.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from island_jax.outer.codec import topk
from island_jax.outer.codec.blocks import dequantize_blocks, pack_int4, quantize_array, quantize_blocks
from island_jax.outer.codec.chunks import Chunk, Piece, payload_bytes, pieces
from island_jax.outer.codec.kinds import MAX_CODE, Codec, as_codec


@functools.partial(jax.jit, static_argnames=("kind", "block_size", "decay"))
def _encode_on_device(leaves, residuals, kind, block_size, decay=1.0):
    """One program for the whole tree, on the leaves' devices (sharded or not).

    Returns (per leaf: codes and scales, or values), the new residuals
    (intended - sent, float32; None without `residuals`), ||intended||^2 and
    ||intended - sent||^2.
    """
    wire, new_residuals, intended_sq, lost_sq = [], [], 0.0, 0.0
    for i, x in enumerate(leaves):
        intended = x.astype(jnp.float32) if residuals is None else x.astype(jnp.float32) + decay * residuals[i]
        if kind == "none":
            parts, sent = (intended,), intended
        elif kind == "bf16":
            b = intended.astype(jnp.bfloat16)
            parts, sent = (b,), b.astype(jnp.float32)
        else:
            codes, scale, sent = quantize_array(intended, block_size, MAX_CODE[kind])
            parts = (codes, scale)
        lost = intended - sent
        wire.append(parts)
        if residuals is not None:
            new_residuals.append(lost)
        intended_sq += jnp.sum(intended * intended)
        lost_sq += jnp.sum(lost * lost)
    return wire, new_residuals if residuals is not None else None, intended_sq, lost_sq


def _on_accelerator(leaves) -> bool:
    return any(isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices()) for x in leaves)


class ChunkEncoder:
    """A payload that encodes itself chunk by chunk, when each chunk is asked for.

    The gRPC exchange asks for chunk k on the thread that sends it, so the
    encoding of later chunks runs while earlier ones are on the wire (NumPy
    releases the GIL in its loops), and no chunk is copied after it is built
    but into its frame.

    Where it encodes: arrays on an accelerator are encoded there (topk: on the
    host), by one program over the whole tree (sharded arrays stay sharded), and only the
    codes come to the host (1 byte per int8 parameter over PCIe rather than
    4); the chunks are then cut from them. Arrays on the CPU are encoded on the
    host, chunk by chunk, so the encoding overlaps the transfer. Both lay out
    the same payload; a code may differ by one where XLA divides by a block's
    scale as a multiplication by its reciprocal and rounds the other way.

    Args:
      tree: pytree of float arrays (the pseudo-gradient).
      kind, block_size: the codec (a `Codec`, or a dense kind's name and block size).
      plan: the chunks (`chunk_plan` of `tree`); default: one chunk.
      residual: None, or a pytree like `tree` of float32 NumPy arrays (error
        feedback): added before encoding, and overwritten, chunk by chunk, with
        what the codec lost (intended - sent).
      measure: also accumulate ||intended||^2 and ||intended - sent||^2.
      on_device: encode with the one device program (True), chunk by chunk on
        the host (False), or by where the arrays live (None).
      read: instead of `tree` (then None): piece -> its float32 values [stop - start], read on the host when the
        chunk is encoded (an island's own shards, `island.shards.OwnedValues.read`); `plan` is then required.
      residual_of: with `read`, instead of `residual`: piece -> its float32 residual [stop - start], a writable
        array the encoder overwrites with what it lost.
      decay: beta, what of the residual is carried: intended = x + beta x residual (`codec.error_feedback_decay`;
        SparseLoCo's error feedback, arXiv 2508.15706, e <- beta e + delta, with beta 0.95).

    `len(encoder)` is the payload's size in bytes; `chunk(k)` returns chunk
    k's bytes as a list of buffers, in payload order; `tobytes()` the whole
    payload. After `start()`, one background thread encodes the chunks in
    order (the order the link carries them, with one reused work buffer) and
    `chunk(k)` waits for chunk k. Once every chunk is built, `relative_error`
    is ||intended - sent|| / ||intended|| (with `measure`).

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """

    def __init__(
        self,
        tree: Any,
        kind: str,
        block_size: int | None = None,
        plan: list["Chunk"] | None = None,
        residual: Any = None,
        measure: bool = False,
        on_device: bool | None = None,
        read: Callable[[Piece], np.ndarray] | None = None,
        residual_of: Callable[[Piece], np.ndarray] | None = None,
        decay: float = 1.0,
    ):
        self.codec = fmt = as_codec(kind, block_size)
        self.kind, self.block_size = fmt.kind, fmt.block_size
        self.measure = measure or residual is not None or residual_of is not None
        self.decay = float(decay)
        leaves = [] if read is not None else jax.tree.leaves(tree)
        self.residuals = None if residual is None else [r.reshape(-1) for r in jax.tree.leaves(residual)]
        self._read, self._residual_of = read, residual_of
        self._sums = [0.0, 0.0]  # ||intended||^2, ||intended - sent||^2
        self._encoded: list | None = None  # per leaf, from the device program: (codes, scales) or (values,)
        if read is not None:
            if plan is None:
                raise ValueError("a ChunkEncoder that reads its pieces (`read`) needs their `plan`")
            self.leaves = None
        elif self.kind != "topk" and (_on_accelerator(leaves) if on_device is None else on_device):
            residuals = None if residual is None else jax.tree.leaves(residual)
            wire, new_residuals, intended_sq, lost_sq = jax.device_get(
                _encode_on_device(leaves, residuals, self.kind, self.block_size, self.decay)
            )
            self._encoded = [tuple(np.asarray(a).reshape(-1) for a in parts) for parts in wire]
            self._sums = [float(intended_sq), float(lost_sq)]
            for mine, new in zip(self.residuals or (), new_residuals or ()):
                mine[:] = np.asarray(new, np.float32).reshape(-1)
            self.leaves = None
        else:
            host = jax.device_get(leaves)
            self.leaves = [np.ascontiguousarray(x, np.float32).reshape(-1) for x in host]
        if plan is None:
            plan = [Chunk(0, 0, payload_bytes(tree, fmt), tuple(pieces(tree, fmt)))]
        self.plan = plan
        self._chunks = {c.index: c for c in plan}  # a share of a payload's plan is a plan too
        self.nbytes = sum(c.nbytes for c in plan)
        self._lock = threading.Lock()
        self._ready: dict[int, threading.Event] | None = None  # after start(): chunk k is encoded
        self._built: dict[int, list | None] = {}
        self._error: BaseException | None = None
        self._scratch: np.ndarray | None = None

    def start(self) -> "ChunkEncoder":
        """Encodes every chunk, in order, on a background thread; `chunk(k)` then waits for chunk k."""
        if self._ready is None:
            self._ready = {c.index: threading.Event() for c in self.plan}
            self._built = dict.fromkeys(self._ready)
            threading.Thread(target=self._produce, name="encode", daemon=True).start()
        return self

    def _produce(self) -> None:
        longest = max((p.stop - p.start for c in self.plan for p in c.pieces), default=0)
        self._scratch = np.empty(longest + self.block_size, np.float32)  # a piece, padded to whole blocks
        try:
            for chunk in self.plan:
                self._built[chunk.index] = self._encode(chunk.index, self._scratch)
                self._ready[chunk.index].set()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that asks for the chunk
            self._error = e
            for event in self._ready.values():
                event.set()
        finally:
            self._scratch = None

    def __len__(self) -> int:
        return self.nbytes

    @property
    def relative_error(self) -> float:
        """||intended - sent|| / ||intended|| over the chunks built so far (kept with `measure`)."""
        return float(np.sqrt(self._sums[1]) / max(np.sqrt(self._sums[0]), 1e-30))

    def chunk(self, index: int) -> list:
        """Chunk `index`'s bytes, as buffers (NumPy arrays or bytes) to be joined in order.

        Raises:
          Whatever encoding the chunk raised (after `start()`, on the thread that asks).
        """
        if self._ready is None:
            return self._encode(index)
        self._ready[index].wait()
        if self._error is not None:
            raise self._error
        parts, self._built[index] = self._built[index], None
        return parts

    def _encode(self, index: int, scratch: np.ndarray | None = None) -> list:
        if self._encoded is not None:
            return self._cut(index)
        parts, intended_sq, lost_sq = [], 0.0, 0.0
        for piece in self._chunks[index].pieces:
            if self._read is not None:
                x = self._read(piece)
                residual = None if self._residual_of is None else self._residual_of(piece)
            else:
                x = self.leaves[piece.leaf][piece.start : piece.stop]
                residual = None if self.residuals is None else self.residuals[piece.leaf][piece.start : piece.stop]
            if residual is not None:
                x = x + residual if self.decay == 1.0 else x + np.float32(self.decay) * residual
            if self.kind == "none":
                sent = x
                parts.append(x.astype("<f4", copy=False))
            elif self.kind == "bf16":
                b = x.astype(ml_dtypes.bfloat16)
                parts.append(b.view(np.uint16))  # the same bytes, in a buffer format every consumer reads
                sent = b.astype(np.float32) if self.measure else None
            elif x.size == 0:
                sent = x
            elif self.kind == "topk":
                fmt = self.codec
                encoded = topk.encode(x, fmt.topk_group, fmt.topk_k)
                parts.append(encoded)
                sent = topk.decode(encoded, x.size, fmt.topk_group, fmt.topk_k) if self.measure else None
            else:
                codes, scale = quantize_blocks(x, self.block_size, MAX_CODE[self.kind], scratch)
                parts.append(codes if self.kind == "int8" else pack_int4(codes))
                parts.append(scale.astype("<f4", copy=False))
                sent = dequantize_blocks(codes, scale, self.block_size) if self.measure else None
            if self.measure:
                lost = x - sent
                intended_sq += float(np.dot(x, x))
                lost_sq += float(np.dot(lost, lost))
                if residual is not None:
                    residual[:] = lost
        if self.measure:
            with self._lock:
                self._sums[0] += intended_sq
                self._sums[1] += lost_sq
        return parts

    def _cut(self, index: int) -> list:
        """Chunk `index` cut from the device program's codes (the same layout, piece by piece)."""
        parts = []
        for piece in self._chunks[index].pieces:
            encoded = self._encoded[piece.leaf]
            values = encoded[0][piece.start : piece.stop]
            if self.kind == "none":
                parts.append(values.astype("<f4", copy=False))
            elif self.kind == "bf16":
                parts.append(values.view(np.uint16))
            elif piece.stop > piece.start:
                parts.append(values if self.kind == "int8" else pack_int4(values))
                first, last = piece.start // self.block_size, -(-piece.stop // self.block_size)
                parts.append(encoded[1][first:last].astype("<f4", copy=False))
        return parts

    def tobytes(self) -> bytes:
        """The whole payload: every chunk, built now."""
        return b"".join(part for chunk in self.plan for part in self.chunk(chunk.index))


def encode(tree: Any, kind: "str | Codec", block_size: int | None = None) -> bytes:
    """Encodes a pytree of floating arrays into one payload (see `ChunkEncoder`).

    Args:
      tree: pytree of float arrays of any rank and size (scalars, bfloat16
        included); values must be finite.
      kind: a `Codec`, or the name of one of `KINDS`.
      block_size: with a name, elements per float32 scale of int8 / int4 (ignored by the other kinds).

    Returns:
      The payload: `payload_bytes(tree, kind, block_size)` bytes.

    Raises:
      CodecError: on an unknown kind or a block_size <= 0.
    """
    return ChunkEncoder(tree, kind, block_size).tobytes()

