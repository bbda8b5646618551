"""Wire codecs for pseudo-gradients.

A payload is the concatenation, in pytree-flatten order, of each leaf's encoding;
the shapes and dtypes are not sent, since both ends know the model. Kinds:

  none  float32 little-endian, 4 bytes per element.
  bf16  bfloat16, 2 bytes per element.
  int8  blockwise absmax quantization (as in 8-bit optimizers, Dettmers et al.,
        arXiv 2110.02861; used for DiLoCo pseudo-gradients by INTELLECT-1, arXiv
        2412.01152): each leaf is flattened and cut into blocks of `block_size`
        elements (the last block may be short); a block's float32 scale is
        absmax / 127 and its codes are round(x / scale) clipped to [-127, 127].
        A leaf of n elements costs n + 4 * ceil(n / block_size) bytes, so a
        model of P parameters costs about P * (1 + 4 / block_size) bytes. An
        all-zero block has scale 0 and decodes to exact zeros.
  int4  the same blockwise scheme with codes in [-7, 7] (scale = absmax / 7),
        two codes a byte (code + 8 in the low nibble for even positions, the
        high nibble for odd ones): ceil(n / 2) + 4 * ceil(n / block_size) bytes.

Pieces and chunks. A leaf longer than a piece (`PIECE_ELEMENTS`: about 64 KiB
of codes or values, so 65,536 int8 elements) is encoded as consecutive pieces,
each a whole number of blocks (the last may be short), and each piece is laid
out as its codes then its scales; a shorter leaf is one piece, exactly the
per-leaf layout above (for none and bf16 pieces change nothing at all). Every piece decodes on its own, so a
payload can be cut between pieces. `chunk_plan` groups consecutive pieces
into the chunks that travel on the wire (at most `comm.chunk_bytes` each, or
one piece if that alone is larger); the coordinator merges, steps and encodes
the update chunk by chunk (Streaming DiLoCo's observation that the outer step
is elementwise, arXiv 2501.18512), with the same bytes as a whole-payload merge.
The sizes above do not change: pieces start on block boundaries.

Error feedback (as in MuLoCo and SparseLoCo; `ChunkEncoder`'s `residual`): what
the codec lost last round is added to this round's tree before encoding, and
what it loses now is kept for the next round, so quantization error is
delayed, never dropped.

Encoding and decoding run in NumPy on the host. `ChunkEncoder` builds a
payload chunk by chunk as the transport sends it, so the encoding of later
chunks overlaps the transfer of earlier ones; `decode` and `decode_and_apply`
give every process that applies the same bytes to the same parameters the same
bits, whatever its accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from island_jax.config import CODEC_KINDS as KINDS  # every codec kind (`codec.kind` in the config)

MAX_CODE = {"int8": 127, "int4": 7}  # the blockwise kinds: largest code magnitude (scale = absmax / MAX_CODE)
QUANTIZED_KINDS = tuple(MAX_CODE)  # kinds sent as codes and float32 scales
PIECE_BYTES = 1 << 16  # a full piece carries about this many bytes of codes or values
PIECE_ELEMENTS = {"none": PIECE_BYTES // 4, "bf16": PIECE_BYTES // 2, "int8": PIECE_BYTES, "int4": 2 * PIECE_BYTES}


class CodecError(ValueError):
    """A payload does not match what the codec expects (size, kind)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CodecError(f"unknown codec kind {kind!r}; choose one of {KINDS}")


def leaf_bytes(size: int, kind: str, block_size: int) -> int:
    """Bytes on the wire for one leaf (or piece) of `size` elements.

    Raises:
      CodecError: an unknown kind.
    """
    _check_kind(kind)
    if kind == "none":
        return 4 * size
    if kind == "bf16":
        return 2 * size
    code_bytes = size if kind == "int8" else (size + 1) // 2
    return code_bytes + 4 * math.ceil(size / block_size)


def piece_elements(kind: str, block_size: int) -> int:
    """Elements of a full piece: about 64 KiB of codes or values, in whole (and for int4 even) blocks."""
    if kind not in MAX_CODE:
        return PIECE_ELEMENTS[kind]
    n = max(1, PIECE_ELEMENTS[kind] // block_size) * block_size
    return 2 * n if kind == "int4" and n % 2 else n


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of leaf `leaf` (pytree-flatten order), at bytes [offset, offset + nbytes) of the payload."""

    leaf: int
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Consecutive pieces that travel (and are merged) together: payload bytes [offset, offset + nbytes)."""

    index: int
    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]


def pieces(like: Any, kind: str, block_size: int) -> list[Piece]:
    """Every piece of a payload for a pytree shaped like `like` (arrays or ShapeDtypeStructs), in payload order.

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    _check_kind(kind)
    _check_block_size(block_size)
    step = piece_elements(kind, block_size)
    out, offset = [], 0
    for i, x in enumerate(jax.tree.leaves(like)):
        n = int(np.prod(x.shape))
        for start in range(0, max(n, 1), step):
            stop = min(n, start + step)
            size = leaf_bytes(stop - start, kind, block_size)
            out.append(Piece(i, start, stop, offset, size))
            offset += size
    return out


def chunk_plan(like: Any, kind: str, block_size: int, chunk_bytes: int) -> list[Chunk]:
    """Groups the payload's pieces into chunks of at most `chunk_bytes` bytes (one larger piece stays whole).

    Both ends derive the same plan from the model, codec and `comm.chunk_bytes`,
    so a chunk is named by its index and byte offset alone.

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    plan: list[Chunk] = []
    group: list[Piece] = []

    def close():
        if group:
            start = group[0].offset
            plan.append(Chunk(len(plan), start, group[-1].offset + group[-1].nbytes - start, tuple(group)))
            group.clear()

    for piece in pieces(like, kind, block_size):
        if group and piece.offset + piece.nbytes - group[0].offset > chunk_bytes:
            close()
        group.append(piece)
    close()
    return plan


def deal(plan: list[Chunk], parts: int) -> list[list[Chunk]]:
    """The chunks of `plan` dealt out to `parts` senders (the processes of one island), balanced by bytes.

    In index order, each chunk goes to the part with the fewest bytes so far (the lowest part on a tie), so
    every part's bytes are within one chunk of the others' and each part's chunks spread over the whole
    payload (they arrive interleaved, as the chunk-wise merge takes them). Every end derives the same deal.

    Returns:
      Per part, its chunks in index order (a part may have none when there are fewer chunks than parts).
    """
    shares: list[list[Chunk]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for chunk in plan:
        part = min(range(parts), key=lambda p: (loads[p], p))
        shares[part].append(chunk)
        loads[part] += chunk.nbytes
    return shares


def payload_bytes(like: Any, kind: str, block_size: int) -> int:
    """Bytes of a whole payload for a pytree shaped like `like` (arrays or ShapeDtypeStructs).

    Raises:
      CodecError: an unknown kind.
    """
    return sum(leaf_bytes(int(np.prod(x.shape)), kind, block_size) for x in jax.tree.leaves(like))


def layout(like: Any, kind: str, block_size: int) -> str:
    """SHA-256 prefix (16 hex digits) of a payload's layout: leaf paths, shapes, kind, block size.

    Two ends whose layouts agree read each other's payloads element for element;
    the gRPC exchange refuses a payload whose layout differs from the round's.
    """
    import hashlib

    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    text = repr([(jax.tree_util.keystr(path), tuple(x.shape)) for path, x in leaves]) + f"|{kind}|{block_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def quantize_blocks(
    x: np.ndarray, block_size: int, max_code: int, scratch: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax quantization of float32 `x` [n]: int8 codes [n] in [-max_code, max_code], float32 scales
    [ceil(n / block_size)] (absmax / max_code; 0 for an all-zero block).

    `scratch`: optional float32 work space of at least n elements, reused instead of allocating.
    """
    n = x.size
    num_blocks = -(-n // block_size)
    if n % block_size:
        padded = np.zeros(num_blocks * block_size, np.float32)
        padded[:n] = x
        x = padded
    blocks = x.reshape(num_blocks, block_size)
    if scratch is not None and scratch.size >= blocks.size:
        q = scratch[: blocks.size].reshape(blocks.shape)
    else:
        q = np.empty_like(blocks)
    np.abs(blocks, out=q)
    scale = np.max(q, axis=1) / np.float32(max_code)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    np.divide(blocks, safe[:, None], out=q)
    np.rint(q, out=q)
    np.clip(q, -max_code, max_code, out=q)
    return q.astype(np.int8).reshape(-1)[:n], scale


def dequantize_blocks(codes: np.ndarray, scale: np.ndarray, block_size: int) -> np.ndarray:
    """float32 codes x scale [n], block by block (the last block may be short): what the codes stand for."""
    n = codes.size
    full = n // block_size * block_size
    values = np.empty(n, np.float32)
    np.multiply(codes[:full].reshape(-1, block_size), scale[: full // block_size, None], out=values[:full].reshape(-1, block_size))
    if full < n:
        np.multiply(codes[full:], scale[-1], out=values[full:])
    return values


def _quantize_leaf(x: jax.Array, block_size: int, max_code: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`quantize_blocks` in jax.numpy: codes (int8) [n], float32 scales [blocks], dequantized [shape]."""
    flat = x.astype(jnp.float32).reshape(-1)
    n = flat.shape[0]
    num_blocks = -(-n // block_size)
    blocks = jnp.pad(flat, (0, num_blocks * block_size - n)).reshape(num_blocks, block_size)
    scale = jnp.max(jnp.abs(blocks), axis=1) / max_code
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(blocks / safe[:, None]), -max_code, max_code)
    dequantized = (codes * scale[:, None]).reshape(-1)[:n].reshape(x.shape)
    return codes.astype(jnp.int8).reshape(-1)[:n], scale, dequantized


@functools.partial(jax.jit, static_argnames=("kind", "block_size"))
def _encode_on_device(leaves, residuals, kind, block_size):
    """One program for the whole tree, on the leaves' devices (sharded or not).

    Returns (per leaf: codes and scales, or values), the new residuals
    (intended - sent, float32; None without `residuals`), ||intended||^2 and
    ||intended - sent||^2.
    """
    wire, new_residuals, intended_sq, lost_sq = [], [], 0.0, 0.0
    for i, x in enumerate(leaves):
        intended = x.astype(jnp.float32) if residuals is None else x.astype(jnp.float32) + residuals[i]
        if kind == "none":
            parts, sent = (intended,), intended
        elif kind == "bf16":
            b = intended.astype(jnp.bfloat16)
            parts, sent = (b,), b.astype(jnp.float32)
        else:
            codes, scale, sent = _quantize_leaf(intended, block_size, MAX_CODE[kind])
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


def _pack_int4(codes: np.ndarray) -> bytes:
    nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def _unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.int8)
    codes[0::2] = (packed & 0x0F).astype(np.int8) - 8
    codes[1::2] = (packed >> 4).astype(np.int8) - 8
    return codes[:n]


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise CodecError(f"block_size is {block_size}; it must be a positive number of elements")


class ChunkEncoder:
    """A payload that encodes itself chunk by chunk, when each chunk is asked for.

    The gRPC exchange asks for chunk k on the thread that sends it, so the
    encoding of later chunks runs while earlier ones are on the wire (NumPy
    releases the GIL in its loops), and no chunk is copied after it is built
    but into its frame.

    Where it encodes: arrays on an accelerator are encoded there, by one
    program over the whole tree (sharded arrays stay sharded), and only the
    codes come to the host (1 byte per int8 parameter over PCIe rather than
    4); the chunks are then cut from them. Arrays on the CPU are encoded on the
    host, chunk by chunk, so the encoding overlaps the transfer. Both lay out
    the same payload; a code may differ by one where XLA divides by a block's
    scale as a multiplication by its reciprocal and rounds the other way.

    Args:
      tree: pytree of float arrays (the pseudo-gradient).
      kind, block_size: the codec.
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
        block_size: int,
        plan: list["Chunk"] | None = None,
        residual: Any = None,
        measure: bool = False,
        on_device: bool | None = None,
        read: Callable[[Piece], np.ndarray] | None = None,
        residual_of: Callable[[Piece], np.ndarray] | None = None,
    ):
        _check_kind(kind)
        _check_block_size(block_size)
        self.kind, self.block_size = kind, block_size
        self.measure = measure or residual is not None or residual_of is not None
        leaves = [] if read is not None else jax.tree.leaves(tree)
        self.residuals = None if residual is None else [r.reshape(-1) for r in jax.tree.leaves(residual)]
        self._read, self._residual_of = read, residual_of
        self._sums = [0.0, 0.0]  # ||intended||^2, ||intended - sent||^2
        self._encoded: list | None = None  # per leaf, from the device program: (codes, scales) or (values,)
        if read is not None:
            if plan is None:
                raise ValueError("a ChunkEncoder that reads its pieces (`read`) needs their `plan`")
            self.leaves = None
        elif _on_accelerator(leaves) if on_device is None else on_device:
            residuals = None if residual is None else jax.tree.leaves(residual)
            wire, new_residuals, intended_sq, lost_sq = jax.device_get(
                _encode_on_device(leaves, residuals, kind, block_size)
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
            plan = [Chunk(0, 0, payload_bytes(tree, kind, block_size), tuple(pieces(tree, kind, block_size)))]
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
                x = x + residual
            if self.kind == "none":
                sent = x
                parts.append(x.astype("<f4", copy=False))
            elif self.kind == "bf16":
                b = x.astype(ml_dtypes.bfloat16)
                parts.append(b.view(np.uint16))  # the same bytes, in a buffer format every consumer reads
                sent = b.astype(np.float32) if self.measure else None
            elif x.size == 0:
                sent = x
            else:
                codes, scale = quantize_blocks(x, self.block_size, MAX_CODE[self.kind], scratch)
                parts.append(codes if self.kind == "int8" else _pack_int4(codes))
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
                parts.append(values if self.kind == "int8" else _pack_int4(values))
                first, last = piece.start // self.block_size, -(-piece.stop // self.block_size)
                parts.append(encoded[1][first:last].astype("<f4", copy=False))
        return parts

    def tobytes(self) -> bytes:
        """The whole payload: every chunk, built now."""
        return b"".join(part for chunk in self.plan for part in self.chunk(chunk.index))


def encode(tree: Any, kind: str, block_size: int) -> bytes:
    """Encodes a pytree of floating arrays into one payload (see `ChunkEncoder`).

    Args:
      tree: pytree of float arrays of any rank and size (scalars, bfloat16
        included); values must be finite.
      kind: one of `KINDS`.
      block_size: elements per float32 scale of int8 / int4 (ignored by the other kinds).

    Returns:
      The payload: `payload_bytes(tree, kind, block_size)` bytes.

    Raises:
      CodecError: on an unknown kind or a block_size <= 0.
    """
    return ChunkEncoder(tree, kind, block_size).tobytes()


def _check_payload(payload, like: Any, kind: str, block_size: int) -> None:
    _check_kind(kind)
    expected = payload_bytes(like, kind, block_size)
    if len(payload) != expected:
        raise CodecError(
            f"payload is {len(payload)} bytes but a {kind} payload for these parameters is {expected} bytes; "
            "the sender uses a different model shape, codec or block_size"
        )


def decode(payload: bytes, like: Any, kind: str, block_size: int) -> Any:
    """Decodes a payload into float32 NumPy arrays shaped like `like`.

    Args:
      payload: bytes from `encode` for a pytree with `like`'s structure and shapes.
      like: pytree of arrays or ShapeDtypeStructs giving structure and shapes.
      kind, block_size: as given to `encode`.

    Returns:
      A pytree with `like`'s structure of float32 `np.ndarray`s.

    Raises:
      CodecError: if the payload's size differs from what `like` implies.
    """
    _check_payload(payload, like, kind, block_size)
    buf = memoryview(payload)
    leaves, treedef = jax.tree.flatten(like)
    out = [np.empty(int(np.prod(x.shape)), np.float32) for x in leaves]
    for piece in pieces(like, kind, block_size):
        out[piece.leaf][piece.start : piece.stop] = decode_piece(buf, piece, kind, block_size)
    out = [values.reshape(tuple(x.shape)) for values, x in zip(out, leaves)]
    return jax.tree.unflatten(treedef, out)


def decode_piece(buf, piece: Piece, kind: str, block_size: int) -> np.ndarray:
    """The float32 values [piece.stop - piece.start] of one piece, read from `buf` at `piece.offset`."""
    n, offset = piece.stop - piece.start, piece.offset
    if kind == "none":
        return np.frombuffer(buf, "<f4", n, offset).astype(np.float32)
    if kind == "bf16":
        return np.frombuffer(buf, ml_dtypes.bfloat16, n, offset).astype(np.float32)
    num_blocks = -(-n // block_size)
    code_bytes = n if kind == "int8" else (n + 1) // 2
    if kind == "int8":
        codes = np.frombuffer(buf, np.int8, n, offset)
    else:
        codes = _unpack_int4(np.frombuffer(buf, np.uint8, code_bytes, offset), n)
    scale = np.frombuffer(buf, "<f4", num_blocks, offset + code_bytes).astype(np.float32)
    return dequantize_blocks(codes, scale, block_size)


def decode_and_apply(params: Any, payload: bytes, kind: str, block_size: int) -> Any:
    """The one host-side update rule: `params + decode(payload)` in float32, cast back.

    The coordinator (for its island view) and every island call this with the
    same bytes and the same parameters, so all of them hold identical bits.

    Args:
      params: pytree of NumPy-convertible arrays (any float dtype).
      payload: an update encoded for `params`' structure.
      kind, block_size: as given to `encode`.

    Returns:
      A pytree of NumPy arrays with `params`' dtypes.

    Raises:
      CodecError: if the payload's size does not fit `params`.
    """
    _check_payload(payload, params, kind, block_size)
    leaves, treedef = jax.tree.flatten(params)
    out = [np.array(p, np.float32, copy=True).reshape(-1) for p in leaves]
    buf = memoryview(payload)
    for piece in pieces(params, kind, block_size):
        flat = out[piece.leaf][piece.start : piece.stop]
        np.add(flat, decode_piece(buf, piece, kind, block_size), out=flat)
    return jax.tree.unflatten(
        treedef,
        [x.reshape(np.shape(p)).astype(np.asarray(p).dtype, copy=False) for x, p in zip(out, leaves)],
    )


def decode_view(payload: bytes, like: Any) -> Any:
    """Parameters sent whole as a float32 "none" payload, cast back to `like`'s dtypes (NumPy).

    Raises:
      CodecError: if the payload's size does not fit `like`.
    """
    values = decode(payload, like, "none", 1)
    return jax.tree.map(lambda v, p: v.astype(np.asarray(p).dtype), values, like)
