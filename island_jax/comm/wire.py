"""Payloads as streams of CRC32-checked chunks, and their checked reassembly.

A payload (an encoded pseudo-gradient or update, up to gigabytes) never travels
as one protobuf message: protobuf caps a message at 2 GiB and gRPC's default
receive limit is 4 MiB. The sender streams one `PayloadHeader` (round, island,
tokens, total size, CRC32 of the whole payload, layout) and then chunks of at
most `comm.chunk_bytes`, each with the CRC32 of its own data. `Reassembler`
checks every chunk as it arrives and the whole payload at the end, so a corrupt
or short transfer is refused before any of it reaches the coordinator's merge.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Iterator

from island_jax.comm import exchange_pb2 as pb


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
    """CRC32 (zlib, IEEE 802.3 polynomial) of bytes or a buffer, as an unsigned 32-bit int."""
    return zlib.crc32(data) & 0xFFFFFFFF


def payload_parts(header: pb.PayloadHeader, payload: bytes, chunk_bytes: int) -> Iterator[pb.PayloadPart]:
    """The stream for one payload: its header (size and CRC32 filled in), then its chunks.

    Args:
      header: round, island, tokens, layout and params_checksum of the payload;
        `total_bytes` and `crc32` are set here.
      payload: the encoded bytes.
      chunk_bytes: largest chunk data, bytes (`comm.chunk_bytes`).
    """
    view = memoryview(payload)
    header.total_bytes = len(view)
    header.crc32 = crc32(view)
    yield pb.PayloadPart(header=header)
    for offset in range(0, len(view), chunk_bytes):
        data = view[offset : offset + chunk_bytes]
        yield pb.PayloadPart(chunk=pb.Chunk(offset=offset, data=bytes(data), crc32=crc32(data)))


def part_bytes(part: pb.PayloadPart) -> int:
    """Serialized size of one streamed message, bytes (what it costs on the wire, before HTTP/2 framing)."""
    return part.ByteSize()


class Reassembler:
    """Receives one payload's stream and checks it as it arrives.

    Args:
      max_bytes: largest payload accepted (the round's expected size).
      chunk_bytes: largest chunk accepted.

    After `add` has consumed every part, `finish()` returns (header, payload).
    Raises `WireError` at the first problem: a missing or repeated header, a
    chunk over `chunk_bytes`, an offset out of order, a chunk's CRC32, a total
    other than the header's, or the whole payload's CRC32.
    """

    def __init__(self, max_bytes: int, chunk_bytes: int):
        self.max_bytes, self.chunk_bytes = max_bytes, chunk_bytes
        self.header: pb.PayloadHeader | None = None
        self._buffer: bytearray | None = None
        self._received = 0
        self.wire_bytes = 0  # serialized bytes of every part received

    def add(self, part: pb.PayloadPart) -> None:
        self.wire_bytes += part_bytes(part)
        kind = part.WhichOneof("part")
        if kind == "header":
            if self.header is not None:
                raise WireError("a second payload header arrived in one stream; send one header per payload")
            h = part.header
            if not 0 <= h.total_bytes <= self.max_bytes:
                raise WireError(
                    f"payload of {h.total_bytes} bytes from island {h.island!r}, round {h.round}, but this round "
                    f"expects {self.max_bytes} bytes; the island's model or codec differs from the coordinator's"
                )
            self.header, self._buffer = h, bytearray(h.total_bytes)
            return
        if kind != "chunk":
            raise WireError("an empty stream part arrived; every part is a header or a chunk")
        if self.header is None:
            raise WireError("a chunk arrived before the payload header; send the header first")
        c = part.chunk
        if len(c.data) > self.chunk_bytes:
            raise WireError(f"a chunk of {len(c.data)} bytes exceeds comm.chunk_bytes={self.chunk_bytes}")
        if c.offset != self._received:
            raise WireError(f"chunk at offset {c.offset} arrived where offset {self._received} was due")
        if c.offset + len(c.data) > self.header.total_bytes:
            raise WireError(
                f"chunk at offset {c.offset} of {len(c.data)} bytes runs past the payload's {self.header.total_bytes}"
            )
        if crc32(c.data) != c.crc32:
            raise WireError(
                f"CRC32 mismatch in the chunk at offset {c.offset} ({len(c.data)} bytes) of island "
                f"{self.header.island!r}, round {self.header.round}: the data was corrupted in transit and the "
                "payload was refused",
                code="DATA_LOSS",
            )
        self._buffer[c.offset : c.offset + len(c.data)] = c.data
        self._received += len(c.data)

    def extend(self, parts: Iterable[pb.PayloadPart]) -> "Reassembler":
        for part in parts:
            self.add(part)
        return self

    def finish(self) -> tuple[pb.PayloadHeader, bytes]:
        if self.header is None:
            raise WireError("the stream ended before a payload header arrived", code="DATA_LOSS")
        if self._received != self.header.total_bytes:
            raise WireError(
                f"the stream ended after {self._received} of {self.header.total_bytes} bytes", code="DATA_LOSS"
            )
        payload = bytes(self._buffer)
        if crc32(payload) != self.header.crc32:
            raise WireError("the reassembled payload's CRC32 differs from its header's; refused", code="DATA_LOSS")
        return self.header, payload
