"""Payloads as frames of CRC-32C-checked chunks, and their checked reassembly.

A payload (an encoded pseudo-gradient or update, up to gigabytes) is cut by `codec.chunk_plan` into chunks of
at most `comm.chunk_bytes` that both ends derive from the model, and sent as raw frames (layout in
exchange.proto; protobuf caps a message at 2 GiB and gRPC's default receive limit is 4 MiB):

  'H' + CRC-32C u32 + PayloadHeader                 header (first frame of a contribution stream)
  'C' + index u32 + offset u64 + crc32 u32 + data   one chunk (built with one copy, read with none)
  'R' + generation u64                              restart (update streams only)
  'T' + CRC-32C u32 + PayloadHeader                 trailer (end of an update or view stream)

`ChunkAssembler` takes chunks in any order, from any stream, checks each chunk's index, offset, size and
CRC-32C, and the whole payload against the trailer's CRC of chunk CRCs, so a corrupt, short or misplaced
transfer is refused before any of it is merged (docs/wire.md).
"""

from __future__ import annotations

import random
import struct

import crc32c
import numpy as np
from google.protobuf.message import DecodeError

from island_jax.comm import exchange_pb2 as pb
from island_jax.outer import codec
from island_jax.protocol import ContributionHeader

HEADER, CHUNK, RESTART, TRAILER = b"H", b"C", b"R", b"T"
_CHUNK = struct.Struct("<cIQI")  # kind, index, offset, crc32
_RESTART = struct.Struct("<cQ")
FRAMING_BYTES = _CHUNK.size


class WireError(ValueError):
    """A streamed payload is malformed or corrupt.

    Attributes:
      code: the gRPC status code name the server answers with: "DATA_LOSS" for a
        CRC mismatch or a short stream, "INVALID_ARGUMENT" for a payload whose
        size, layout or framing disagrees with what the round expects.
    """

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


def crc32(data) -> int:
    """CRC-32C (Castagnoli, RFC 3720) of bytes or a buffer, as an unsigned 32-bit int.

    The crc32c package computes it with the CPU's CRC instructions (about 12 GB/s
    here, against about 2 GB/s for zlib's CRC-32), so checking every chunk on
    both ends costs little next to moving it.
    """
    return crc32c.crc32c(data)


def crc32_parts(parts) -> int:
    """CRC-32C of buffers as if joined, without joining them."""
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return crc


def fold_crc32(crcs) -> int:
    """CRC-32C of a sequence of CRCs (4 bytes each, little-endian): a payload's check without a second pass."""
    return crc32(b"".join(int(c).to_bytes(4, "little") for c in crcs))


def _checked(kind: bytes, header: pb.PayloadHeader) -> bytes:
    body = header.SerializeToString()
    return kind + crc32(body).to_bytes(4, "little") + body


def header_frame(header: pb.PayloadHeader) -> bytes:
    """The 'H' frame that opens a contribution stream: the kind, the CRC-32C of the header (u32), the header."""
    return _checked(HEADER, header)


def trailer_frame(header: pb.PayloadHeader) -> bytes:
    """The 'T' frame that ends an update or view stream, laid out as `header_frame`."""
    return _checked(TRAILER, header)


def restart_frame(generation: int) -> bytes:
    return _RESTART.pack(RESTART, generation)


def chunk_frame(index: int, offset: int, data, crc: int | None = None) -> bytes:
    """One chunk's frame: 17 bytes of framing and `data`, copied once.

    `data` is bytes, a buffer, or a list of buffers (a `codec.ChunkEncoder`
    chunk) joined in order.
    """
    parts = data if isinstance(data, list) else [data]
    crc = crc32_parts(parts) if crc is None else crc
    return b"".join((_CHUNK.pack(CHUNK, index, offset, crc), *parts))


def stream_count(connections: int, plan: list[codec.Chunk]) -> int:
    """Streams a payload travels on: one per chunk, up to `connections` (`comm.connections`)."""
    return max(1, min(connections, len(plan)))


def share_bitmap(share: list[codec.Chunk], plan: list[codec.Chunk]) -> bytes:
    """`PayloadHeader.share` / `FetchRequest.share`: bit k (little-endian within each byte) set for each chunk k of
    `plan` in `share`."""
    bits = np.zeros(len(plan), np.uint8)
    bits[[c.index for c in share]] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def owned_ranges(plans: list[list[codec.Chunk]], shard: tuple[int, int] | None) -> list[range] | None:
    """Per fragment's plan, the chunk indices coordinator shard k of K owns (`codec.chunk_ranges`), for
    `shard` = (k, K); None for None (one coordinator process)."""
    if shard is None:
        return None
    k, count = shard
    return [codec.chunk_ranges(plan, count)[k] for plan in plans]


def share_of(plan: list[codec.Chunk], part: int, parts: int, bitmap: bytes = b"") -> list[codec.Chunk]:
    """The chunks of `plan` in share `part` of `parts`: those `bitmap` names (`share_bitmap`), or when it is empty
    the plan dealt out by bytes (`codec.deal`); the whole plan when `parts` <= 1 and no bitmap is given (an island
    of one process sends a coordinator shard its range by a bitmap).

    Raises:
      WireError: a bitmap of another length than the plan's chunks need.
    """
    if parts <= 1 and not bitmap:
        return plan
    if not bitmap:
        return codec.deal(plan, parts)[part]
    if len(bitmap) != -(-len(plan) // 8):
        raise WireError(f"share {part} of {parts} names chunks in {len(bitmap)} bytes, but the fragment's plan of "
                        f"{len(plan)} chunks needs {-(-len(plan) // 8)}; the island and the coordinator derive "
                        "different plans (model, codec or comm.chunk_bytes)")
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=len(plan), bitorder="little")
    return [c for c in plan if bits[c.index]]


def payload_header(
    header: ContributionHeader, layout: str, streams: int, total_bytes: int, attempt: int = 0, incarnation: str = "",
    part: int = 0, parts: int = 1, share: bytes = b"",
) -> pb.PayloadHeader:
    """The 'H' frame's header of a contribution sent over `streams` streams (`codec.layout` of its payload), for
    one `attempt` (a random 64-bit number per try) to the coordinator `incarnation` the island joined; of an
    island of several processes, share `part` of `parts`, its chunks named by `share` (`share_bitmap`)."""
    return pb.PayloadHeader(
        round=header.round, island=header.island, tokens=header.tokens, layout=layout,
        params_checksum=header.params_checksum or "", step_seconds=header.step_seconds or 0.0, streams=streams,
        total_bytes=total_bytes, fragment=header.fragment, attempt=attempt, incarnation=incarnation, part=part,
        overlap_steps=0 if header.overlap_steps is None else header.overlap_steps + 1,  # 0: the config's tau
        parts=parts if parts > 1 else 0,  # one process: the header of before (no share fields)
        share=share,  # b"" but of several processes, or of a coordinator shard's range
        routed_counts=() if header.routed_counts is None else np.asarray(header.routed_counts, np.int64).reshape(-1),
        routing_probe=b"" if header.routing_probe is None else np.ascontiguousarray(header.routing_probe).tobytes(),
        post_sync_loss_change=header.post_sync_loss_change,
        unrouted_tokens=header.unrouted_tokens if header.routed_counts is not None else 0,
    )


def new_attempt() -> int:
    """A random nonzero 64-bit attempt number (`PayloadHeader.attempt`; always 8 bytes on the wire)."""
    return random.getrandbits(64) | 1 << 63


def contribution_frame_bytes(header: pb.PayloadHeader, plan: list[codec.Chunk], streams: int) -> int:
    """Bytes of the frames of one contribution: a header frame per stream, then one chunk frame per chunk."""
    return len(header_frame(header)) * streams + sum(c.nbytes + FRAMING_BYTES for c in plan)


def update_frame_bytes(trailer: pb.PayloadHeader, plan: list[codec.Chunk], streams: int) -> int:
    """Bytes of the frames of one update (no restart): one chunk frame per chunk, a trailer frame per stream."""
    return sum(c.nbytes + FRAMING_BYTES for c in plan) + len(trailer_frame(trailer)) * streams


def parse(frame: bytes):
    """(kind, value) of a frame: a PayloadHeader for 'H' / 'T', (index, offset, crc32, data view) for 'C',
    the generation for 'R'.

    Raises:
      WireError: an empty frame, an unknown kind or a truncated frame.
    """
    if not frame:
        raise WireError("an empty frame arrived; every frame starts with its kind byte")
    kind = frame[:1]
    try:
        if kind == CHUNK:
            _, index, offset, crc = _CHUNK.unpack_from(frame)
            return kind, (index, offset, crc, memoryview(frame)[_CHUNK.size :])
        if kind in (HEADER, TRAILER):
            body = memoryview(frame)[5:]
            if len(frame) < 5 or crc32(body) != int.from_bytes(frame[1:5], "little"):
                raise WireError(f"a {kind!r} frame arrived corrupt (its CRC-32C does not match)", code="DATA_LOSS")
            return kind, pb.PayloadHeader.FromString(bytes(body))
        if kind == RESTART:
            return kind, _RESTART.unpack(frame)[1]
    except WireError:
        raise
    except (struct.error, ValueError, DecodeError) as e:
        raise WireError(f"a truncated or malformed {kind!r} frame arrived ({type(e).__name__}: {e})") from None
    raise WireError(f"a frame of unknown kind {kind!r} arrived; this peer speaks frames H, C, R and T")


def chunk_frames(payload, plan: list[codec.Chunk], connection: int = 0, connections: int = 1):
    """The chunk frames of `payload` that travel on `connection` of `connections` (chunk k on k % connections).

    Yields (chunk index, frame bytes); each frame's CRC-32C is that of its chunk.
    """
    view = memoryview(payload)
    for chunk in plan[connection::connections]:
        yield chunk.index, chunk_frame(chunk.index, chunk.offset, view[chunk.offset : chunk.offset + chunk.nbytes])


class ChunkAssembler:
    """Reassembles one payload from chunk frames that come in any order, over any number of streams.

    Args:
      plan: the payload's chunks (`codec.chunk_plan`), which fixes every chunk's
        offset and size.
      share: the chunks expected (a process's share of an island's payload, `island.shards.Ownership`); default:
        all.

    `add` checks one chunk and copies it into place; `finish(header)` checks
    that every expected chunk came and that the CRC of their CRCs equals the
    header's, then returns the payload (the chunks outside the share left zero:
    pages the share does not touch are never written, so a process holds only
    its share's bytes).
    `forget(indices)` drops chunks (a restart).
    """

    def __init__(self, plan: list[codec.Chunk], share: list[codec.Chunk] | None = None):
        self.plan = plan
        self.share = plan if share is None else share
        self._expected = {c.index for c in self.share}
        self.total = sum(c.nbytes for c in plan)
        self.buffer = np.zeros(self.total, np.uint8)  # zero pages, mapped when first written
        self.crcs: dict[int, int] = {}
        self.wire_bytes = 0  # frame bytes received, all kinds

    def forget(self, indices) -> None:
        """Drops the chunks `indices` (after a restart they are sent again)."""
        for k in indices:
            self.crcs.pop(k, None)

    def add(self, index: int, offset: int, crc: int, data) -> None:
        """Checks chunk `index` (its offset, size and CRC-32C) and copies it into the payload.

        Raises:
          WireError: an unknown or repeated index, an offset or size other than
            the plan's (INVALID_ARGUMENT), or a CRC-32C mismatch (DATA_LOSS).
        """
        if not 0 <= index < len(self.plan):
            raise WireError(f"chunk {index} is not in this payload's plan of {len(self.plan)} chunks")
        if index not in self._expected:
            raise WireError(f"chunk {index} is not in this process's share of the payload ({len(self.share)} chunks)")
        if index in self.crcs:
            raise WireError(f"chunk {index} arrived twice")
        chunk = self.plan[index]
        if offset != chunk.offset or len(data) != chunk.nbytes:
            raise WireError(
                f"chunk {index} came at offset {offset} with {len(data)} bytes, but the plan puts it at offset "
                f"{chunk.offset} with {chunk.nbytes} bytes; both ends must use the same comm.chunk_bytes, model and codec"
            )
        if crc32(data) != crc:
            raise WireError(
                f"CRC-32C mismatch in chunk {index} (offset {offset}, {len(data)} bytes): the data was corrupted in "
                "transit and the payload was refused",
                code="DATA_LOSS",
            )
        self.buffer[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        self.crcs[index] = crc

    @property
    def complete(self) -> bool:
        return len(self.crcs) == len(self.share)

    def finish(self, header: pb.PayloadHeader) -> memoryview:
        """The whole payload (a view of the assembler's own buffer, not a copy), once every chunk is in and the
        header's size and CRC agree.

        Raises:
          WireError: missing chunks or a size / CRC other than the header's (DATA_LOSS).
        """
        if not self.complete:
            missing = sorted({c.index for c in self.share} - set(self.crcs))
            raise WireError(
                f"the stream ended with {len(missing)} of {len(self.share)} chunks missing (first: {missing[:4]})",
                code="DATA_LOSS",
            )
        total = sum(c.nbytes for c in self.share)
        if header.total_bytes != total or header.crc32 != fold_crc32(self.crcs[c.index] for c in self.share):
            raise WireError(
                f"the reassembled payload ({total} bytes) disagrees with its trailer ({header.total_bytes} "
                "bytes, or the CRC of its chunks); refused",
                code="DATA_LOSS",
            )
        return memoryview(self.buffer)
