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
  topk  SparseLoCo's top-k (arXiv 2508.15706, `topk.py`): per group of `topk_group`
        elements, the `topk_k` largest in magnitude, each as a 12-bit index (for
        4096), a sign and one of two magnitudes {s/3, s}, with s one float32 per
        group: 116 bytes per full group of 4096 with k = 64 (0.227 bits a
        parameter). Always with error feedback on an island.

A `Codec` names one direction's kind and its parameters (`Codec.of(config.codec)`
for contributions, `Codec.of(config.codec, update=True)` for the coordinator's
update, `codec.update_kind`); every function here takes one, or a dense kind's
name with its block size.

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
The sizes above do not change: pieces start on block (and top-k group) boundaries.

Two codecs, one plan. A contribution and its update share one chunk plan element
for element (the coordinator merges chunk k and sends update chunk k). When the two
directions use different codecs (`Codec.paired`), pieces start on the boundaries of
both, in either payload encoded whole or chunk by chunk (`Codec.of` pairs a config's two
codecs), and chunks are cut by whichever codec costs more bytes, so that no chunk of either
payload exceeds `comm.chunk_bytes`: with top-k up and int8 down, a 1 MiB top-k chunk
would otherwise hold about 37M values and its int8 update chunk about 37 MB.

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

import bisect
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
from island_jax.config import update_kind
from island_jax.outer import topk

MAX_CODE = {"int8": 127, "int4": 7}  # the blockwise kinds: largest code magnitude (scale = absmax / MAX_CODE)
QUANTIZED_KINDS = tuple(MAX_CODE)  # kinds sent as codes and float32 scales
PIECE_BYTES = 1 << 16  # a full piece carries about this many bytes of codes or values
PIECE_ELEMENTS = {"none": PIECE_BYTES // 4, "bf16": PIECE_BYTES // 2, "int8": PIECE_BYTES, "int4": 2 * PIECE_BYTES}


class CodecError(ValueError):
    """A payload does not match what the codec expects (size, kind)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CodecError(f"unknown codec kind {kind!r}; choose one of {KINDS}")


@dataclasses.dataclass(frozen=True)
class Codec:
    """One direction's wire format: a kind and its parameters.

    Attributes:
      kind: one of `KINDS`.
      block_size: elements per float32 scale of int8 / int4 (and the coordinator's row width for none / bf16).
      topk_group, topk_k: topk's group length and values kept per group (elements).
      piece: elements of a full piece where the other direction's codec differs (`paired`): the pieces of both
        directions' payloads then start at the same elements; 0: the kind's own (`piece_elements`).

    Raises:
      CodecError: an unknown kind, or a size below 1.
    """

    kind: str
    block_size: int = 256
    topk_group: int = 4096
    topk_k: int = 64
    piece: int = 0

    def __post_init__(self):
        _check_kind(self.kind)
        _check_block_size(self.block_size)
        if self.topk_group < 1 or self.topk_k < 1:
            raise CodecError(f"topk group {self.topk_group} and k {self.topk_k}: both must be at least 1")

    @classmethod
    def of(cls, config: Any, update: bool = False) -> "Codec":
        """The contribution's codec of a config's `codec` section, or with `update` the update's
        (`codec.update_kind`, "" for the contribution's kind), each `paired` with the other."""
        group, k = config.get("topk_group", 4096), config.get("topk_k", 64)
        up, down = cls(config.kind, config.block_size, group, k), cls(update_kind(config), config.block_size, group, k)
        return down.paired(up) if update else up.paired(down)

    def own(self) -> "Codec":
        """This codec with its own pieces (unpaired)."""
        return dataclasses.replace(self, piece=0) if self.piece else self

    def paired(self, other: "Codec") -> "Codec":
        """This codec cut into the pieces it shares with `other`, the other direction's codec
        (`piece_elements(self, other=other)`); itself, with its own pieces, when the two are one codec."""
        mine, theirs = self.own(), other.own()
        if mine == theirs:
            return mine
        return dataclasses.replace(mine, piece=piece_elements(mine, other=theirs))

    @property
    def unit(self) -> int:
        """Elements a piece holds a whole number of: a block (an even count for int4), a top-k group, or 1."""
        if self.kind == "topk":
            return self.topk_group
        if self.kind in MAX_CODE:
            return self.block_size * 2 if self.kind == "int4" and self.block_size % 2 else self.block_size
        return 1

    @property
    def row_unit(self) -> int:
        """Elements the coordinator's rows (`chunk_step`) hold a whole number of: a top-k group, or a block."""
        return self.topk_group if self.kind == "topk" else self.block_size

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk (group {self.topk_group}, k {self.topk_k})"
        return f"{self.kind} (block {self.block_size})" if self.kind in MAX_CODE else self.kind


def as_codec(kind: "str | Codec", block_size: int | None = None) -> Codec:
    """`kind` itself when it is a `Codec`; else the `Codec` of that kind's name and `block_size` (topk with its
    default group and k).

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    if isinstance(kind, Codec):
        return kind
    _check_kind(kind)
    return Codec(kind, 256 if block_size is None else block_size)


def leaf_bytes(size: int, kind: "str | Codec", block_size: int | None = None) -> int:
    """Bytes on the wire for one leaf (or piece) of `size` elements.

    Raises:
      CodecError: an unknown kind.
    """
    fmt = as_codec(kind, block_size)
    kind, block_size = fmt.kind, fmt.block_size
    if kind == "none":
        return 4 * size
    if kind == "bf16":
        return 2 * size
    if kind == "topk":
        return topk.leaf_bytes(size, fmt.topk_group, fmt.topk_k)
    code_bytes = size if kind == "int8" else (size + 1) // 2
    return code_bytes + 4 * math.ceil(size / block_size)


def piece_elements(kind: "str | Codec", block_size: int | None = None, other: "Codec | None" = None) -> int:
    """Elements of a full piece: about 64 KiB of codes or values, in whole blocks (for int4 an even count) or
    top-k groups; a paired codec's `piece`. With the other direction's codec `other`, when it differs, the
    smaller of the two pieces in whole units (`Codec.unit`) of both."""
    fmt = as_codec(kind, block_size)
    if other is not None and other.own() != fmt.own():
        mine, theirs = fmt.own(), other.own()
        unit = math.lcm(mine.unit, theirs.unit)
        return max(1, min(piece_elements(mine), piece_elements(theirs)) // unit) * unit
    if fmt.piece:
        return fmt.piece
    if fmt.kind == "topk":
        groups = PIECE_BYTES // topk.group_bytes(fmt.topk_group, fmt.topk_group, fmt.topk_k)
        return max(1, groups) * fmt.topk_group
    if fmt.kind not in MAX_CODE:
        return PIECE_ELEMENTS[fmt.kind]
    n = max(1, PIECE_ELEMENTS[fmt.kind] // fmt.block_size) * fmt.block_size
    return 2 * n if fmt.kind == "int4" and n % 2 else n


def bytes_per_element(fmt: Codec) -> float:
    """Bytes per parameter of a long leaf in `fmt`, scales included (int8 with blocks of 256: 1 + 4 / 256; topk
    with groups of 4096 and k = 64: 116 / 4096)."""
    n = math.lcm(fmt.unit, 2 * fmt.block_size) * 1024  # whole blocks, groups and bytes: the codec's rate exactly
    return leaf_bytes(n, fmt) / n


def row_elements(fmt: Codec, other: "Codec | None" = None) -> int:
    """Elements of one of the coordinator's rows (`chunk_step`) for a contribution codec `fmt` and update codec
    `other`: a whole number of both's `row_unit`s."""
    return fmt.row_unit if other is None else math.lcm(fmt.row_unit, other.row_unit)


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


def pieces(like: Any, kind: "str | Codec", block_size: int | None = None) -> list[Piece]:
    """Every piece of a payload for a pytree shaped like `like` (arrays or ShapeDtypeStructs), in payload order
    (`piece_elements`: a paired codec's pieces start where the other direction's do).

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    fmt = as_codec(kind, block_size)
    step = piece_elements(fmt)
    out, offset = [], 0
    for i, x in enumerate(jax.tree.leaves(like)):
        n = int(np.prod(x.shape))
        for start in range(0, max(n, 1), step):
            stop = min(n, start + step)
            size = leaf_bytes(stop - start, fmt)
            out.append(Piece(i, start, stop, offset, size))
            offset += size
    return out


def chunk_plan(like: Any, kind: "str | Codec", block_size: int | None, chunk_bytes: int,
               other: Codec | None = None) -> list[Chunk]:
    """Groups the payload's pieces into chunks of at most `chunk_bytes` bytes (one larger piece stays whole).

    Both ends derive the same plan from the model, codec and `comm.chunk_bytes`,
    so a chunk is named by its index and byte offset alone.

    Args:
      like: the parameters' pytree (arrays or ShapeDtypeStructs).
      kind, block_size: this payload's codec (a `Codec`, or a dense kind's name and block size).
      chunk_bytes: the largest chunk, bytes (`comm.chunk_bytes`).
      other: the codec of the other direction (the update's for a contribution, and back), when it differs: the
        plan is cut where the costlier of the two reaches `chunk_bytes`, so `chunk_plan(like, a, None, n, b)` and
        `chunk_plan(like, b, None, n, a)` hold the same elements chunk for chunk, each in its own bytes.

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    fmt = as_codec(kind, block_size)
    if other is not None:
        fmt, other = fmt.paired(other), other.paired(fmt)
        other = None if other == fmt else other
    mine = pieces(like, fmt)
    theirs = mine if other is None else pieces(like, other)
    plan: list[Chunk] = []
    group: list[Piece] = []
    start_theirs = 0

    def close():
        if group:
            start = group[0].offset
            plan.append(Chunk(len(plan), start, group[-1].offset + group[-1].nbytes - start, tuple(group)))
            group.clear()

    for piece, twin in zip(mine, theirs):
        if group and max(piece.offset + piece.nbytes - group[0].offset, twin.offset + twin.nbytes - start_theirs) > chunk_bytes:
            close()
        if not group:
            start_theirs = twin.offset
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


def payload_bytes(like: Any, kind: "str | Codec", block_size: int | None = None) -> int:
    """Bytes of a whole payload for a pytree shaped like `like` (arrays or ShapeDtypeStructs).

    Raises:
      CodecError: an unknown kind.
    """
    fmt = as_codec(kind, block_size)
    return sum(leaf_bytes(int(np.prod(x.shape)), fmt) for x in jax.tree.leaves(like))


def layout(like: Any, kind: "str | Codec", block_size: int | None = None) -> str:
    """SHA-256 prefix (16 hex digits) of a payload's layout: leaf paths, shapes, kind, block size (top-k's group
    and k).

    Two ends whose layouts agree read each other's payloads element for element;
    the gRPC exchange refuses a payload whose layout differs from the round's.
    """
    import hashlib

    fmt = as_codec(kind, block_size)
    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    text = repr([(jax.tree_util.keystr(path), tuple(x.shape)) for path, x in leaves]) + f"|{fmt.kind}|{fmt.block_size}"
    if fmt.kind == "topk":
        text += f"|{fmt.topk_group}|{fmt.topk_k}"
    if fmt.piece:
        text += f"|piece {fmt.piece}"
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


def _check_payload(payload, like: Any, kind: "str | Codec", block_size: int | None) -> None:
    expected = payload_bytes(like, kind, block_size)
    if len(payload) != expected:
        raise CodecError(
            f"payload is {len(payload)} bytes but a {as_codec(kind, block_size)} payload for these parameters is {expected} bytes; "
            "the sender uses a different model shape, codec or block_size"
        )


def decode(payload: bytes, like: Any, kind: "str | Codec", block_size: int | None = None) -> Any:
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


def decode_piece(buf, piece: Piece, kind: "str | Codec", block_size: int | None = None) -> np.ndarray:
    """The float32 values [piece.stop - piece.start] of one piece, read from `buf` at `piece.offset`."""
    fmt = as_codec(kind, block_size)
    kind, block_size = fmt.kind, fmt.block_size
    n, offset = piece.stop - piece.start, piece.offset
    if kind == "topk":
        out = np.zeros(n, np.float32)
        positions, values = topk.decode_sparse(buf, n, fmt.topk_group, fmt.topk_k, offset)
        out[positions] = values
        return out
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


def decode_and_apply(params: Any, payload: bytes, kind: "str | Codec", block_size: int | None = None,
                     out: Any = None) -> Any:
    """The one host-side update rule: `params + decode(payload)` in float32, cast back.

    The coordinator (for its island view) and every island call this with the
    same bytes and the same parameters, so all of them hold identical bits.

    Args:
      params: pytree of NumPy-convertible arrays (any float dtype).
      payload: an update encoded for `params`' structure.
      kind, block_size: as given to `encode`.
      out: a pytree like `params` of writable, C-contiguous float32 NumPy arrays of its shapes (`params` itself
        may be it, when float32) that receive the sums, so that a caller applying update after update reuses
        its buffers instead of touching fresh pages each time; default: new arrays. No two of its leaves may
        share memory, nor one of them with another leaf of `params`. Into `params` itself, a payload that
        fails to decode part way leaves `params` part updated.

    Returns:
      A pytree of NumPy arrays with `params`' dtypes (with `out` of float32 `params`, `out`'s own arrays).

    Raises:
      CodecError: if the payload's size does not fit `params`.
      ValueError: `out` of another structure, a leaf of it not a writable, C-contiguous float32 array of its
        leaf's shape, or leaves that share memory as above.
    """
    _check_payload(payload, params, kind, block_size)
    leaves, treedef = jax.tree.flatten(params)
    given = None
    if out is None:
        out = [np.array(p, np.float32, copy=True).reshape(-1) for p in leaves]
    else:
        given, out_def = jax.tree.flatten(out)
        out = _out_leaves(given, out_def, treedef, leaves)
        for o, g, p in zip(out, given, leaves):
            if g is not p:  # params' values first, unless out is params itself
                np.copyto(o, np.asarray(p).reshape(-1), casting="same_kind")
    buf = memoryview(payload)
    for piece in pieces(params, kind, block_size):
        flat = out[piece.leaf][piece.start : piece.stop]
        np.add(flat, decode_piece(buf, piece, kind, block_size), out=flat)
    shaped = given or [x.reshape(np.shape(p)) for x, p in zip(out, leaves)]
    return jax.tree.unflatten(treedef, [x.astype(np.asarray(p).dtype, copy=False) for x, p in zip(shaped, leaves)])


def _out_leaves(out_leaves: list, out_def, treedef, leaves: list) -> list[np.ndarray]:
    """`decode_and_apply`'s `out` (its leaves and structure) as flat float32 views, checked against `params`'
    leaves (ValueError)."""
    if out_def != treedef:
        raise ValueError(f"decode_and_apply: out has the structure {out_def}, params {treedef}; pass a pytree like params")
    flat = []
    for o, p in zip(out_leaves, leaves):
        if not (isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == np.shape(p)
                and o.flags.c_contiguous and o.flags.writeable):
            raise ValueError(
                f"decode_and_apply: an out leaf is {type(o).__name__} {getattr(o, 'dtype', '')} "
                f"{getattr(o, 'shape', '')}; each must be a writable, C-contiguous float32 NumPy array of its "
                f"parameter's shape {np.shape(p)}"
            )
        flat.append(o.reshape(-1))
    spans = sorted((_span(o), k) for k, o in enumerate(out_leaves))
    for (a, k), (b, j) in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise ValueError(f"decode_and_apply: out's leaves {k} and {j} share memory; give each its own array")
    starts = [span[0] for span, _ in spans]
    for j, p in enumerate(leaves):
        if isinstance(p, np.ndarray) and p is not out_leaves[j] and p.nbytes:
            lo, hi = _span(p)
            at = bisect.bisect_right(starts, hi - 1) - 1  # the last out leaf starting before p ends
            while at >= 0 and spans[at][0][1] > lo:  # out leaves are disjoint: those reaching into p come last
                if spans[at][1] != j:
                    raise ValueError(f"decode_and_apply: out's leaf {spans[at][1]} shares memory with params' "
                                     f"leaf {j}; give out arrays of its own, or params itself")
                at -= 1
    return flat


def _span(a: np.ndarray) -> tuple[int, int]:
    """The bytes [start, end) of a C-contiguous array's memory, as addresses."""
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def decode_view(payload: bytes, like: Any) -> Any:
    """Parameters sent whole as a float32 "none" payload, cast back to `like`'s dtypes (NumPy).

    Raises:
      CodecError: if the payload's size does not fit `like`.
    """
    values = decode(payload, like, "none", 1)
    return jax.tree.map(lambda v, p: v.astype(np.asarray(p).dtype), values, like)
