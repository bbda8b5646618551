"""How the gRPC service takes contribution streams in: frames read on the event loop, chunks checked and handed
to the session on a thread of its own.

`ContributionStream` reads one Contribute stream (its header frame, then chunk frames) and `Intake` carries
the chunks of every stream at once from the event loop to the coordinator: the loop queues each chunk and
goes on reading; one thread takes whatever is queued, checks each chunk's plan fit and CRC-32C, and hands a
stream's chunks at a time to `ExchangeSession.add_chunks` under the session's lock. The loop hears back only
when a stream waits: one with `CHUNKS_QUEUED` chunks not yet taken, or one that has ended.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire

if TYPE_CHECKING:
    from island_jax.comm.service import ExchangeService
    from island_jax.comm.session import Attempt
    from island_jax.coordinator import FragmentCoordinator

CHUNKS_QUEUED = 8  # per contribution stream: chunks read while the coordinator is still taking earlier ones


def check_chunk(header: pb.PayloadHeader, c: FragmentCoordinator, index: int, offset: int, crc: int, data) -> None:
    """Raises WireError for a chunk off the fragment's plan (INVALID_ARGUMENT) or with a bad CRC-32C (DATA_LOSS)."""
    if not 0 <= index < len(c.plan) or c.plan[index].offset != offset or c.plan[index].nbytes != len(data):
        raise wire.WireError(
            f"chunk {index} at offset {offset} with {len(data)} bytes does not fit this round's payload of "
            f"{c.payload_bytes} bytes in {len(c.plan)} chunks; the island's model, codec or "
            "comm.chunk_bytes differs from the coordinator's"
        )
    if wire.crc32(data) != crc:
        raise wire.WireError(
            f"CRC-32C mismatch in chunk {index} (offset {offset}, {len(data)} bytes) of island "
            f"{header.island!r}, round {header.round}: the data was corrupted in transit and the payload "
            "was refused",
            code="DATA_LOSS",
        )


class Intake:
    """Checked chunks on their way from the event loop to the coordinator, from every contribution stream at once.

    A chunk the check or the coordinator refuses sets the stream's error (WireError or ContributionError),
    raised at the stream's next chunk or at its end, and none of that stream's later chunks is handed on.
    """

    def __init__(self, service: ExchangeService):
        self.service = service
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first chunk

    async def put(self, stream: ContributionStream, index: int, offset: int, crc: int, data) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="coordinator-intake", daemon=True)
            self._thread.start()
        stream.queued += 1
        self._queue.put((stream, index, offset, crc, data))
        if stream.queued - stream.taken >= CHUNKS_QUEUED:
            await self._until(stream, CHUNKS_QUEUED - 1)

    async def flush(self, stream: ContributionStream) -> None:
        """Returns once every chunk `stream` queued has been taken (or refused: see `stream.error`)."""
        await self._until(stream, 0)

    async def drop(self, stream: ContributionStream) -> None:
        """Takes none of `stream`'s chunks still queued, and returns once none is being taken (a failing stream)."""
        stream.dropped = True
        await self._until(stream, 0)

    def close(self) -> None:
        """Ends the thread once it has taken what is queued."""
        if self._thread is not None:
            self._queue.put(None)

    async def _until(self, stream: ContributionStream, waiting: int) -> None:
        """Waits until at most `waiting` of `stream`'s chunks are not yet taken."""
        while stream.queued - stream.taken > waiting:
            stream.waiter = self.service.loop.create_future()
            if stream.queued - stream.taken > waiting:  # else the intake took them before it could see the waiter
                await stream.waiter
            stream.waiter = None

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            try:
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            batches: dict[ContributionStream, list] = {}
            for item in items:
                if item is not None:
                    batches.setdefault(item[0], []).append(item[1:])
            for stream, chunks in batches.items():
                self._take(stream, chunks)
            if None in items:
                return

    def _take(self, stream: ContributionStream, chunks: list) -> None:
        service = self.service
        try:
            if not stream.dropped and stream.error is None:
                for index, offset, crc, data in chunks:
                    check_chunk(stream.header, stream.fragment, index, offset, crc, data)
                service.locked(service.session.add_chunks, (stream.header, [(k, d) for k, _, _, d in chunks]))
        except Exception as e:  # noqa: BLE001 - raised in the stream it belongs to
            stream.error = e
        stream.taken += len(chunks)  # before reading `waiter`: `_until` sets it, then reads `taken`
        waiter = stream.waiter
        if waiter is not None:
            try:
                service.loop.call_soon_threadsafe(_release, waiter)
            except RuntimeError:  # the event loop closed (the server stopped): nobody waits any more
                pass


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ContributionStream:
    """One Contribute stream as it is read: its header, the chunks it has counted, the coordinator's error.

    Attributes:
      received: chunk bytes read (the reply's `bytes_received`); frame_bytes: every frame's bytes, header included.
      crcs: the chunks' CRC-32Cs, in arrival order.
    """

    def __init__(self, service: ExchangeService, context):
        self.service, self.context = service, context
        self.header: pb.PayloadHeader | None = None
        self.fragment: FragmentCoordinator | None = None  # set once the header names a fragment this run has
        self.entry: Attempt | None = None
        self.received, self.frame_bytes, self.crcs = 0, 0, []
        # `Intake`'s: chunks queued (counted on the event loop) and taken (counted on its thread), the error for
        # a chunk it refused, whether the stream is failing, and the future the event loop waits on
        self.queued, self.taken = 0, 0
        self.error: Exception | None = None
        self.dropped = False
        self.waiter: asyncio.Future | None = None

    async def take(self, frame: bytes) -> None:
        """Checks one frame and hands it on; raises WireError or the coordinator's ContributionError."""
        kind, value = wire.parse(frame)
        if self.header is None:
            if kind != wire.HEADER:
                raise wire.WireError("a contribution stream must start with its header frame")
            await self._open(value)
        elif kind != wire.CHUNK:
            raise wire.WireError(f"a {kind!r} frame arrived inside a contribution; only chunks may follow the header")
        else:
            await self._chunk(*value)
        self.frame_bytes += len(frame)

    async def _open(self, header: pb.PayloadHeader) -> None:
        s = self.service
        await s.check_caller(self.context, header.island)
        s.check_incarnation(header.incarnation)
        self.header = header
        self.fragment = s.fragment(header.fragment, f"island {header.island!r}'s contribution")
        self.entry = await s.call(s.session.begin, header)

    async def _chunk(self, index: int, offset: int, crc: int, data) -> None:
        if self.error is not None:
            raise self.error
        self.received += len(data)
        self.crcs.append(crc)
        if self.entry.status == "accepted":  # checked, then handed on, by the intake's thread
            await self.service.intake.put(self, index, offset, crc, data)
        else:  # discarded (the round closed), or a duplicate of one already in: checked, and let go
            check_chunk(self.header, self.fragment, index, offset, crc, data)

    async def finish(self) -> str:
        """After the last frame: hands on what is queued and ends this stream's part; "accepted", "discarded" or
        "duplicate"."""
        if self.header is None:
            raise wire.WireError("the stream ended before a payload header arrived", code="DATA_LOSS")
        s = self.service
        await s.intake.flush(self)
        if self.error is not None:
            raise self.error
        return await s.call(s.session.end, self.header, self.entry, self.frame_bytes, 1, self.received)

    async def settle(self) -> None:
        """Lets this stream's queued chunks go, once none of them is being taken (the stream is failing)."""
        await self.service.intake.drop(self)
