"""The island's payload streams: one payload out over n streams, an update or the view in over n.

`Upload` sends chunk k of a payload on stream k % n, each stream's header frame first, encoding a
`codec.ChunkEncoder`'s chunks on the threads that send them while the chunks before are on the wire. `Fetch`
receives an update (or the island view) over every connection at once, reassembling it with
`wire.ChunkAssembler`. With a `LinkEmulator`, every chunk in both directions is held until it would have
arrived over the emulated link.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import TYPE_CHECKING

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.outer import codec
from island_jax.protocol import ExchangeError

if TYPE_CHECKING:
    from island_jax.comm.grpc_client import GrpcTransport


class CorruptPayload(Exception):
    """A payload arrived corrupt (its CRC-32C failed); the call may be made again."""


def plan_of(offsets, total: int) -> list[codec.Chunk]:
    """The chunk plan of a payload of `total` bytes whose chunks start at `offsets` (as `JoinReply` names them)."""
    ends = [*offsets[1:], total]
    return [codec.Chunk(i, o, e - o, ()) for i, (o, e) in enumerate(zip(offsets, ends))]


class Fetch:
    """An update being received over every connection; `result()` waits for it."""

    def __init__(
        self, transport: GrpcTransport, round: int, island: str, what: str, plan, methods: list, fragment: int = 0,
        incarnation: str = "", min_round: int = 0, share=None, part: int = 0, parts: int = 1, bitmap: bytes = b"",
    ):
        self.assembler = wire.ChunkAssembler(plan, share)
        self.lock = threading.Lock()
        self.trailers: list[pb.PayloadHeader] = []
        self.first_receipt: float | None = None
        self.last_arrival = 0.0
        self.transport, self.what = transport, what
        self.calls: list = []  # the streams' gRPC calls, to cancel
        self.cancelled = False
        n = len(methods)
        self.futures = [
            transport.pool.submit(
                self._receive,
                method,
                pb.FetchRequest(round=round, island=island, connection=i, connections=n, fragment=fragment,
                                incarnation=incarnation, min_round=min_round, part=part,
                                parts=parts if parts > 1 else 0, share=bitmap),
                i,
                n,
            )
            for i, method in enumerate(methods)
        ]

    def cancel(self) -> None:
        """Ends every stream of this fetch (one opened for an attempt that failed, or a coordinator that restarted)."""
        with self.lock:
            self.cancelled = True
            calls = list(self.calls)
        for f in self.futures:
            f.cancel()
        for call in calls:
            call.cancel()

    def _receive(self, method, request: pb.FetchRequest, connection: int, connections: int) -> None:
        t = self.transport
        call = method(request, timeout=t.round_timeout)
        with self.lock:
            self.calls.append(call)
            if self.cancelled:
                call.cancel()
        for frame in call:
            receipt = t.clock()
            kind, value = wire.parse(frame)
            with self.lock:
                self.assembler.wire_bytes += len(frame)
                if self.first_receipt is None:
                    self.first_receipt = receipt
                if t.link is not None:
                    self.last_arrival = max(self.last_arrival, t.link.arrival("down", connection, len(frame), now=receipt))
                else:
                    self.last_arrival = max(self.last_arrival, receipt)
                if kind == wire.CHUNK:
                    self.assembler.add(*value)
                elif kind == wire.RESTART:  # the merge restarted: this connection's chunks so far are void
                    self.assembler.forget(c.index for c in self.assembler.share[connection::connections])
                elif kind == wire.TRAILER:
                    self.trailers.append(value)
                else:
                    raise wire.WireError(f"a {kind!r} frame arrived in an update stream")

    def result(self) -> tuple[pb.PayloadHeader, bytes]:
        t = self.transport
        try:
            for f in self.futures:
                f.result()
            if not self.trailers:
                raise wire.WireError("the update streams ended without a trailer", code="DATA_LOSS")
            payload = self.assembler.finish(self.trailers[0])
        except wire.WireError as e:
            raise CorruptPayload(f"{self.what}: {e}") from None
        if t.link is not None:
            t.link.sleep_until(self.last_arrival)
        return self.trailers[0], payload


class Upload:
    """One payload going out over `n` streams: chunk k on stream k % n, each stream's header first.

    With a link emulator every chunk is booked on the link in chunk order (so
    the coordinator can merge in that order) and held until it would have
    arrived. A `codec.ChunkEncoder` payload is encoded chunk by chunk by the
    threads that send it, while the chunks before are on the wire.

    Raises:
      ExchangeError: the encoder's chunk plan is not the coordinator's.
    """

    def __init__(
        self, transport: GrpcTransport, plan: list[codec.Chunk], n: int, header: bytes, payload, start: float,
        cache: dict | None = None,
    ):
        self.transport, self.plan, self.n, self.header = transport, plan, n, header
        # {chunk index: (frame, CRC-32C)}: kept for a retry, which sends the same frames (an encoder's chunks
        # are built once: its error feedback must not be applied twice)
        self.cache = {} if cache is None else cache
        self.arrivals = {}
        if transport.link is not None:
            for position, chunk in enumerate(plan):
                frame_bytes = wire.FRAMING_BYTES + chunk.nbytes
                self.arrivals[chunk.index] = transport.link.arrival("up", position % n, frame_bytes, now=start)
        self.encoder = None if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        if self.encoder is not None and not {c.offset for c in plan} <= {c.offset for c in self.encoder.plan}:
            raise ExchangeError(
                "contribute: the encoder's chunk plan differs from the coordinator's; build it with "
                "codec.chunk_plan(params, kind, block_size, comm.chunk_bytes) of the run's config"
            )
        self.view = memoryview(payload) if self.encoder is None else None
        if self.encoder is not None and not self.cache:
            self.encoder.start()  # one thread encodes the chunks in the order they go out
        self.bytes_sent = len(header) * n + len(payload) + wire.FRAMING_BYTES * len(plan)  # frame bytes
        self.crcs: list[list[int]] = [[] for _ in range(n)]
        self.last_frame_out = [start] * n  # when gRPC took each stream's last frame

    def frames(self, conn: int):
        """Stream `conn`'s frames: the header, then its chunks (each CRC-32C recorded)."""
        t = self.transport
        yield self.header
        for chunk in self.plan[conn :: self.n]:
            if chunk.index in self.cache:
                frame, crc = self.cache[chunk.index]
            else:
                if self.encoder is None:
                    parts = [self.view[chunk.offset : chunk.offset + chunk.nbytes]]
                else:  # encoded here, while the chunks before it are on the wire
                    parts = self.encoder.chunk(chunk.index)
                crc = wire.crc32_parts(parts)
                frame = wire.chunk_frame(chunk.index, chunk.offset, parts, crc)
                if self.encoder is not None:
                    self.cache[chunk.index] = (frame, crc)
            self.crcs[conn].append(crc)
            if t.link is not None:
                t.link.sleep_until(self.arrivals[chunk.index])
            yield frame
        self.last_frame_out[conn] = t.clock()

    def check(self, replies: list[pb.ContributeReply]) -> None:
        """Raises ExchangeError if a stream's reply counts other bytes or another CRC-32C than it sent."""
        for i, reply in enumerate(replies):
            sent = sum(k.nbytes for k in self.plan[i :: self.n])
            crc = wire.fold_crc32(self.crcs[i])
            if reply.bytes_received != sent or reply.crc32 != crc:
                raise ExchangeError(
                    f"connection {i}: the coordinator took {reply.bytes_received} bytes (CRC of chunk CRCs "
                    f"{reply.crc32:08x}) of the {sent} sent ({crc:08x})"
                )



def done(call) -> futures.Future:
    """A concurrent.futures.Future that completes with the gRPC future `call` (whatever its outcome)."""
    future = futures.Future()
    call.add_done_callback(lambda _: future.set_result(None))
    return future
