"""The chunk plan: where each piece of a payload sits, and how pieces are grouped into the chunks that travel.

A payload is the concatenation, in pytree-flatten order, of each leaf's encoding; shapes and dtypes are not
sent, since both ends know the model. A leaf is encoded as consecutive pieces (`kinds.piece_elements`: about
64 KiB of codes or values, each a whole number of blocks or top-k groups, the last may be short), each laid out
as its codes then its scales, so that every piece decodes on its own. `chunk_plan` groups consecutive pieces into
chunks of at most `comm.chunk_bytes` (one larger piece stays whole); the coordinator merges, steps and encodes
the update chunk by chunk (the outer step is elementwise, Streaming DiLoCo, arXiv 2501.18512).

A contribution and its update share one plan element for element (the coordinator merges chunk k and sends
update chunk k). When the two directions use different codecs (`Codec.paired`), pieces start on the boundaries
of both, and chunks are cut where the costlier codec reaches `comm.chunk_bytes`, so that no chunk of either
payload is larger.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from island_jax.outer.codec.kinds import Codec, as_codec, leaf_bytes, piece_elements


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


def chunk_ranges(plan: list[Chunk], parts: int) -> list[range]:
    """The chunk indices of `plan` cut into `parts` contiguous ranges of near-equal bytes (a coordinator of
    `coordinator.shards` processes: shard k owns range k of every fragment's plan).

    Range k ends after the first chunk whose payload end reaches k + 1 parts of the total bytes, so each range's
    bytes are within one chunk of total / parts. Every end derives the same cut from the plan alone.

    Returns:
      `parts` ranges covering 0..len(plan) - 1 in order (a range is empty when there are fewer chunks than parts).
    """
    total = sum(c.nbytes for c in plan)
    bounds, end, at = [0], 0, 0
    for k in range(1, parts):
        while at < len(plan) and end * parts < total * k:
            end += plan[at].nbytes
            at += 1
        bounds.append(at)
    bounds.append(len(plan))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


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
    fmt = as_codec(kind, block_size)
    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    text = repr([(jax.tree_util.keystr(path), tuple(x.shape)) for path, x in leaves]) + f"|{fmt.kind}|{fmt.block_size}"
    if fmt.kind == "topk":
        text += f"|{fmt.topk_group}|{fmt.topk_k}"
    if fmt.piece:
        text += f"|piece {fmt.piece}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]

