"""The coordinator's gRPC service: it moves bytes and status codes, nothing else.

`ExchangeService` runs on grpc.aio (one event loop thread serves every stream
of every island: Python's thread-per-stream server slowed to a few percent of
its one-stream rate with 8 and more concurrent streams here), checks each
frame, and hands chunks to the coordinator's plain methods on a worker thread
under one lock. As the coordinator merges chunk k, update streams send it on.
Refusals come back as gRPC status codes with the coordinator's message:

  FAILED_PRECONDITION  handshake mismatch (fingerprint fields, round, checksum),
                       or a contribution the coordinator refuses (round, NaN...)
  INVALID_ARGUMENT     a payload whose size, layout or framing is wrong
  DATA_LOSS            a chunk whose CRC-32C fails, or a short stream
  DEADLINE_EXCEEDED    an update not merged before the caller's deadline
  OUT_OF_RANGE         an update older than the latest merged round (fetch the view)
  ABORTED              a call made for another incarnation of the coordinator (it restarted:
                       the island joins again)

`serve` also registers the standard gRPC health service (grpc.health.v1),
SERVING while the coordinator runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import security, wire
from island_jax.comm.transport import BARRIER_LOG_SECONDS, barrier_line
from island_jax.config import KEEPALIVE_SECONDS
from island_jax.outer import codec
from island_jax.protocol import ContributionError, ContributionHeader, HandshakeError, StaleRoundError

if TYPE_CHECKING:
    from island_jax.coordinator import FragmentCoordinator, FragmentedCoordinator

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Exchange"].full_name
_CHUNKS_QUEUED = 8  # per contribution stream: chunks read while the coordinator is still taking earlier ones
_PIECE_BYTES = 16 * codec.PIECE_BYTES  # more than the largest piece (codes and scales, any block size)


# Keepalive, matched on both sides (gRPC's keepalive guide, doc/keepalive.md). An island idles through minutes
# of inner steps between exchanges; its channels ping every `comm.keepalive_seconds` (KEEPALIVE_SECONDS, 10 s, by
# default) with no call open, so a dead coordinator or a NAT that forgot the connection is noticed, and the server
# admits pings that often. With gRPC's server defaults (no pings without calls, at most one per 5 minutes) such a
# client is sent GOAWAY "too_many_pings".
KEEPALIVE_TIMEOUT_SECONDS = 20  # a ping unanswered this long closes the connection
# A restarted coordinator is dialled again within this many seconds (gRPC's default backoff grows to 120 s).
RECONNECT_BACKOFF_MAX_SECONDS = 5


def _message_limits(chunk_bytes: int) -> list[tuple[str, int]]:
    limit = max(chunk_bytes, _PIECE_BYTES) + 64 * 1024
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _keepalive_ms(keepalive_seconds: float) -> int:
    """`keepalive_seconds` in whole milliseconds (at least 1); raises ValueError unless it is a positive number."""
    if not keepalive_seconds > 0:
        raise ValueError(f"keepalive_seconds is {keepalive_seconds!r}; it must be a positive number of seconds")
    return max(1, round(keepalive_seconds * 1000))


def server_options(
    chunk_bytes: int, receive_bytes: int | None = None, keepalive_seconds: float = KEEPALIVE_SECONDS
) -> list[tuple[str, int]]:
    """The coordinator's gRPC server options: messages of one chunk frame of up to `chunk_bytes` (or one
    whole piece), and pings admitted as often as `client_options` sends them, with or without calls.

    Args:
      chunk_bytes: `comm.chunk_bytes`, bytes.
      receive_bytes: the largest message it takes, bytes (`ExchangeService.receive_limit`, from the chunk
        plans); a larger one is refused (RESOURCE_EXHAUSTED) before it is buffered. None: the chunk's limit.
      keepalive_seconds: the islands' ping interval, seconds (`comm.keepalive_seconds`); pings without data
        are admitted down to half of it (in whole ms).

    Raises:
      ValueError: `keepalive_seconds` is not a positive number.
    """
    keepalive_ms = _keepalive_ms(keepalive_seconds)
    limits = _message_limits(chunk_bytes)
    if receive_bytes is not None:
        limits = [limits[0], ("grpc.max_receive_message_length", receive_bytes)]
    return [
        *limits,
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
        # a port another process listens on is refused (gRPC's default on Linux shares it, and splits the
        # islands' connections between two coordinators)
        ("grpc.so_reuseport", 0),
    ]


def client_options(chunk_bytes: int, keepalive_seconds: float = KEEPALIVE_SECONDS) -> list[tuple[str, int]]:
    """An island's gRPC channel options: the message limits of `server_options`, a keepalive ping every
    `keepalive_seconds` even with no call open (unanswered for `KEEPALIVE_TIMEOUT_SECONDS`, it closes the
    connection), and reconnects at most `RECONNECT_BACKOFF_MAX_SECONDS` apart.

    Args:
      chunk_bytes: `comm.chunk_bytes`, bytes.
      keepalive_seconds: seconds between pings (`comm.keepalive_seconds`), rounded to whole ms.

    Raises:
      ValueError: `keepalive_seconds` is not a positive number.
    """
    return [
        *_message_limits(chunk_bytes),
        ("grpc.keepalive_time_ms", _keepalive_ms(keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging while idle
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_SECONDS * 1000),
    ]


def _raw(data: bytes) -> bytes:
    return data


@dataclasses.dataclass
class _Open:
    """A contribution being streamed in: the coordinator's answer to its header, its streams and how many ended."""

    status: str  # "accepted", "discarded" or "duplicate" (a retry of a contribution already in)
    streams: int
    attempt: int  # PayloadHeader.attempt: the streams of one attempt share it
    ended: int = 0
    chunks: set = dataclasses.field(default_factory=set)  # of a share (parts > 1): the chunks it handed on


def _share(plan: list[codec.Chunk], request) -> list[codec.Chunk]:
    """The chunks of `plan` a contribution's header or an update request names: share `part` of `parts`
    (`wire.share_of`), or all."""
    return wire.share_of(plan, request.part, request.parts, request.share)


def _key(header: pb.PayloadHeader) -> tuple[int, int, str, int]:
    return header.fragment, header.round, header.island, header.part


class _OpenContributions:
    """The contributions in flight, keyed by (fragment, round, island, part), each over one or more streams.

    The first stream's header opens the contribution at the fragment's
    coordinator and the last stream's end closes it. A header with another
    `attempt` is a retry after a dropped connection: the attempt before it is
    forgotten (its chunks never reach the merge) unless it was complete, in
    which case the retry is a duplicate and counted once. Every method runs
    under the service's lock, on its worker threads.

    An island of several processes sends its contribution in `parts` shares
    (the chunks each process owns, named in the header's `share`), one per process, each with attempts of its own: the first
    share to arrive opens the contribution, a share that fails or is sent
    again loses only its own chunks, and the contribution closes when every
    share's streams have ended. A share whose streams all end without every
    chunk of it (a connection that closed can read as a stream's end) is
    refused with ContributionError, and it too loses only its own chunks.
    """

    def __init__(self, coordinator: FragmentedCoordinator):
        self.coordinator = coordinator
        self._open: dict[tuple[int, int, str, int], _Open] = {}
        self._shares_ended: dict[tuple[int, int, str], set[int]] = {}  # parts > 1: the shares that ended well

    def _forget_share(self, header: pb.PayloadHeader, entry: _Open, reason: str, keep_complete: bool) -> None:
        c = self.coordinator.fragments[header.fragment]
        if header.round != c.round or entry.status != "accepted":
            return
        if header.parts > 1 and keep_complete:
            self._shares_ended.get(_key(header)[:3], set()).discard(header.part)
            c.forget_chunks(header.island, entry.chunks, reason)
        else:
            c.abandon(header.island, reason, keep_complete=keep_complete)

    def begin(self, header: pb.PayloadHeader) -> _Open:
        key = _key(header)
        entry = self._open.get(key)
        c = self.coordinator.fragments[header.fragment]
        if entry is not None and entry.attempt != header.attempt:  # a retry: the last attempt is over
            logging.warning("island %s resends round %d of fragment %d (a retry)", header.island, header.round,
                            header.fragment)
            del self._open[key]
            self._forget_share(header, entry, "the island sent it again", keep_complete=True)
            entry = None
        if entry is None:
            if header.parts > 1 and c.is_open(header.round, header.island):  # another share opened it
                status = "accepted"
            else:
                status = c.begin_contribution(ContributionHeader(
                    header.round, header.island, header.tokens, header.params_checksum or None,
                    header.step_seconds or None, header.fragment,
                ))
            entry = self._open[key] = _Open(status, max(header.streams, 1), header.attempt)
            for old in [k for k in self._open if k[0] == header.fragment and k[1] < c.round - 1]:
                del self._open[old]
            for old in [k for k in self._shares_ended if k[0] == header.fragment and k[1] < c.round - 1]:
                del self._shares_ended[old]
        return entry

    def add_chunks(self, header: pb.PayloadHeader, chunks: list) -> None:
        entry = self._open.get(_key(header))
        if entry is None or entry.attempt != header.attempt:  # a retry replaced this attempt
            return
        c = self.coordinator.fragments[header.fragment]
        for index, data in chunks:
            c.add_chunk(header.round, header.island, index, data)
            if header.parts > 1:
                entry.chunks.add(index)

    def end(self, header: pb.PayloadHeader, entry: _Open) -> str:
        entry.ended += 1
        if entry.status != "accepted" or entry.ended < entry.streams:
            return entry.status
        if self._open.get(_key(header)) is not entry:
            raise ContributionError(f"island {header.island!r}'s contribution to round {header.round} was sent "
                                    "again while this attempt was still open; the retry counts")
        if header.parts > 1:
            c = self.coordinator.fragments[header.fragment]
            missing = sorted({k.index for k in _share(c.plan, header)} - entry.chunks)
            if missing:  # its streams ended, some early (a closed connection can read as the end of the requests)
                del self._open[_key(header)]
                self._forget_share(header, entry, "a stream of it ended early", keep_complete=True)
                raise ContributionError(
                    f"island {header.island!r}'s contribution to round {header.round}: share {header.part} of "
                    f"{header.parts} ended without chunks {missing[:8]}; send that share again"
                )
            ended = self._shares_ended.setdefault(_key(header)[:3], set())
            ended.add(header.part)
            if len(ended) < header.parts:  # this share is in; the last share's end closes the contribution
                return entry.status
        return self.coordinator.fragments[header.fragment].end_contribution(header.round, header.island)

    def abandon(self, header: pb.PayloadHeader, reason: str, keep_complete: bool = True) -> None:
        """Forgets the attempt `header` opened (a stream failed), unless a retry replaced it already. With
        `keep_complete` (a dropped connection), a contribution whose every chunk arrived intact is kept (of an
        island of several processes, the other shares' chunks are kept too); a stream refused for what it
        sent keeps nothing."""
        key = _key(header)
        entry = self._open.get(key)
        if entry is None or entry.attempt != header.attempt:
            return
        del self._open[key]
        self._forget_share(header, entry, reason, keep_complete)


def _check_header(header: pb.PayloadHeader, c: FragmentCoordinator, layout: str) -> None:
    """Raises WireError (INVALID_ARGUMENT) for a header whose payload size or layout is not the fragment's."""
    if header.total_bytes != c.payload_bytes:
        raise wire.WireError(
            f"payload of {header.total_bytes} bytes from island {header.island!r}, round "
            f"{header.round}, fragment {header.fragment}, but it should be {c.payload_bytes} bytes; "
            "the island's model or codec differs from the coordinator's"
        )
    if header.layout != layout:
        raise wire.WireError(
            f"island {header.island!r} encoded round {header.round} for payload layout {header.layout}, "
            f"but the coordinator expects {layout} (leaf shapes, codec, block size differ); refused"
        )
    _share(c.plan, header)  # a share's bitmap must fit the plan


def _check_chunk(header: pb.PayloadHeader, c: FragmentCoordinator, index: int, offset: int, crc: int, data) -> None:
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


class _Intake:
    """Checked chunks on their way from the event loop to the coordinator, from every contribution stream at once.

    The event loop queues each chunk it has read (`put`) and goes on reading;
    one thread of the service takes whatever is queued, from every stream,
    checks each chunk's CRC-32C and hands the chunks to the coordinator under
    the service's lock, a stream's chunks at a time. The loop hears back only
    when a stream waits: one with `_CHUNKS_QUEUED` chunks not yet taken, or one
    that has ended (`flush`). A chunk the check or the coordinator refuses
    sets the stream's error (WireError or ContributionError), raised at the
    stream's next chunk or at its end, and none of that stream's later
    chunks is handed on.
    """

    def __init__(self, service: "ExchangeService"):
        self.service = service
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first chunk

    async def put(self, stream: "_ContributionStream", index: int, offset: int, crc: int, data) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="coordinator-intake", daemon=True)
            self._thread.start()
        stream.queued += 1
        self._queue.put((stream, index, offset, crc, data))
        if stream.queued - stream.taken >= _CHUNKS_QUEUED:
            await self._until(stream, _CHUNKS_QUEUED - 1)

    async def flush(self, stream: "_ContributionStream") -> None:
        """Returns once every chunk `stream` queued has been taken (or refused: see `stream.error`)."""
        await self._until(stream, 0)

    async def drop(self, stream: "_ContributionStream") -> None:
        """Takes none of `stream`'s chunks still queued, and returns once none is being taken (a failing stream)."""
        stream.dropped = True
        await self._until(stream, 0)

    def close(self) -> None:
        """Ends the thread once it has taken what is queued."""
        if self._thread is not None:
            self._queue.put(None)

    async def _until(self, stream: "_ContributionStream", waiting: int) -> None:
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
            batches: dict["_ContributionStream", list] = {}
            for item in items:
                if item is not None:
                    batches.setdefault(item[0], []).append(item[1:])
            for stream, chunks in batches.items():
                self._take(stream, chunks)
            if None in items:
                return

    def _take(self, stream: "_ContributionStream", chunks: list) -> None:
        try:
            if not stream.dropped and stream.error is None:
                for index, offset, crc, data in chunks:
                    _check_chunk(stream.header, stream.fragment, index, offset, crc, data)
                self.service._locked(self.service._contributions.add_chunks,
                                     (stream.header, [(k, d) for k, _, _, d in chunks]))
        except Exception as e:  # noqa: BLE001 - raised in the stream it belongs to
            stream.error = e
        stream.taken += len(chunks)  # before reading `waiter`: `_until` sets it, then reads `taken`
        waiter = stream.waiter
        if waiter is not None:
            try:
                self.service.loop.call_soon_threadsafe(_release, waiter)
            except RuntimeError:  # the event loop closed (the server stopped): nobody waits any more
                pass


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _ContributionStream:
    """One Contribute stream as it is read: its header, the chunks it has counted, the coordinator's error."""

    def __init__(self, service: "ExchangeService", context):
        self.service, self.context = service, context
        self.header: pb.PayloadHeader | None = None
        self.fragment: FragmentCoordinator | None = None  # set once the header names a fragment this run has
        self.entry: _Open | None = None
        self.received, self.crcs = 0, []  # chunk bytes and CRC-32Cs, in arrival order
        # `_Intake`'s: chunks queued (counted on the event loop) and taken (counted on its thread), the error for
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

    async def _open(self, header: pb.PayloadHeader) -> None:
        s = self.service
        await s._check_caller(self.context, header.island)
        s.check_incarnation(header.incarnation)
        self.header = header
        self.fragment = s._fragment(header.fragment, f"island {header.island!r}'s contribution")
        _check_header(header, self.fragment, s.layouts[header.fragment])
        self.entry = await s._call(s._contributions.begin, header)

    async def _chunk(self, index: int, offset: int, crc: int, data) -> None:
        if self.error is not None:
            raise self.error
        self.received += len(data)
        self.crcs.append(crc)
        if self.entry.status == "accepted":  # checked, then handed on, by the intake's thread
            await self.service._intake.put(self, index, offset, crc, data)
        else:  # discarded (the round closed), or a duplicate of one already in: checked, and let go
            _check_chunk(self.header, self.fragment, index, offset, crc, data)

    async def finish(self) -> str:
        """After the last frame: hands on what is queued and ends this stream's part; "accepted" or "discarded"."""
        if self.header is None:
            raise wire.WireError("the stream ended before a payload header arrived", code="DATA_LOSS")
        await self.service._intake.flush(self)
        if self.error is not None:
            raise self.error
        return await self.service._call(self.service._contributions.end, self.header, self.entry)

    async def settle(self) -> None:
        """Lets this stream's queued chunks go, once none of them is being taken (the stream is failing)."""
        await self.service._intake.drop(self)


class ExchangeService:
    """Serves one coordinator to the islands.

    Args:
      coordinator: the run's `FragmentedCoordinator` (no gRPC knowledge of its
        own; `outer.fragments = 1` serves plain DiLoCo as one fragment).
      chunk_bytes: `comm.chunk_bytes`.

    Raises:
      TypeError: `coordinator` has no `fragments` (a single fragment's `FragmentCoordinator`).

    Attributes:
      lock: a threading.Condition guarding the coordinator; notified after every
        change. Code outside the service that changes the coordinator (the
        coordinator role's `poll`) holds it and calls `notify()`.
      wire_bytes: {island: {"received", "sent"}}, frame bytes per island.
    """

    def __init__(self, coordinator: FragmentedCoordinator, chunk_bytes: int, authenticated: bool = False):
        self.coordinator = c = coordinator
        self.authenticated = authenticated  # calls carry a token for the island they name (`security.AuthInterceptor`)
        self.layouts = [codec.layout(f.shapes, f.codec) for f in c.fragments]
        self.payload_bytes = sum(f.payload_bytes for f in c.fragments)  # one round of every fragment
        self.update_bytes = sum(f.update_bytes for f in c.fragments)  # one round's update, every fragment
        first = c.fragments[0]
        shapes = c.shapes
        self.view_plan = codec.chunk_plan(shapes, "none", None, chunk_bytes)
        self.view_bytes = codec.payload_bytes(shapes, "none")
        self.view_layout = codec.layout(shapes, first.codec)  # what Join replies with
        self.lock = threading.Condition()
        self.fetched: dict[tuple[int, int], set[str]] = {}  # (fragment, round) -> islands that received its update
        self.wire_bytes = {name: dict(received=0, sent=0) for name in c.islands}
        self.ready: set[str] = set()  # islands that said they are ready to train (Join with ready)
        self._contributions = _OpenContributions(c)
        self._intake = _Intake(self)
        self._worker = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="coordinator")
        # Reads (update chunks, trailers) never queue behind the chunks waiting to merge.
        self._reader = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="coordinator-read")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._version = 0  # counts changes; update streams wait for the next one
        self._wake_scheduled = False  # a `_wake` is queued on the event loop
        self._streams_done: dict[tuple[int, int, str], dict[int, tuple[int, set[int]]]] = {}  # per share
        self._update_crc: dict[int, tuple[int, int]] = {}  # fragment -> (round, CRC-32C of its update's chunk CRCs)

    # -- helpers -----------------------------------------------------------------------------------------

    def notify(self) -> None:
        """Wakes every waiter after the coordinator changed; call it holding `lock`. Changes made before the event
        loop runs the wake-up already scheduled share it."""
        self.lock.notify_all()
        if self.loop is not None and not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the event loop closed (the server stopped): no waiter is left to wake
                self._wake_scheduled = False

    def _wake(self) -> None:
        self._wake_scheduled = False
        self._version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _call(self, fn, *args, changes: bool = True):
        """Runs `fn(*args)` on a worker thread under `lock`, then (if it `changes` state) wakes the waiters.

        Calls that change nothing run on their own threads, so an update stream
        reads merged chunks while contributions' chunks still queue to merge.
        """
        return await self.loop.run_in_executor(self._worker if changes else self._reader, self._locked, fn, args,
                                               changes)

    def _locked(self, fn, args: tuple, changes: bool = True):
        """`fn(*args)` under `lock`, then (if it `changes` state) wakes the waiters; on the calling thread."""
        with self.lock:
            try:
                return fn(*args)
            finally:
                if changes:
                    self.notify()

    async def _wait_for_change(self, version: int, timeout: float) -> None:
        """Returns once the state changed after `version` was read (or after `timeout` seconds)."""
        if self._version != version:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _fragment(self, fragment: int, what: str) -> FragmentCoordinator:
        """The coordinator of `fragment`; WireError (INVALID_ARGUMENT) for one this run does not have."""
        if not 0 <= fragment < len(self.coordinator.fragments):
            raise wire.WireError(
                f"{what} names fragment {fragment}, but this run has {len(self.coordinator.fragments)} "
                "(outer.fragments); run every role with the same config",
                code="INVALID_ARGUMENT",
            )
        return self.coordinator.fragments[fragment]

    async def _check_caller(self, context, island: str) -> None:
        """Aborts with UNAUTHENTICATED when tokens are on and `island` (named in the request) is not the island
        whose token the call carries."""
        if not self.authenticated:
            return
        if security.authenticated_island(context) != island:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the call names island {island!r} but carries the token of another; each island uses its own",
            )
        if island not in self.coordinator.islands:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"island {island!r} is not in this run")

    def receive_limit(self) -> int:
        """Bytes of the largest message an island sends: a frame of the largest chunk of any fragment's plan, or
        a header frame (its layout string and fields), with 4 KiB to spare."""
        largest = max(k.nbytes for f in self.coordinator.fragments for k in f.plan)
        return max(largest + wire.FRAMING_BYTES, max(map(len, self.layouts))) + 4096

    def check_incarnation(self, incarnation: str) -> None:
        """Raises WireError (ABORTED) for a call made to another incarnation of the coordinator ("" passes)."""
        if incarnation and incarnation != self.coordinator.incarnation:
            raise wire.WireError(
                f"the coordinator restarted (incarnation {self.coordinator.incarnation}, the call was made for "
                f"{incarnation}); join again", code="ABORTED",
            )

    def close(self) -> None:
        """Stops the worker threads (after the server stopped)."""
        self._worker.shutdown(wait=False)
        self._reader.shutdown(wait=False)
        self._intake.close()

    # -- methods -----------------------------------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        await self._check_caller(context, request.island)
        try:
            fields = json.loads(request.fingerprint_json)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fingerprint_json is not a JSON object")
        c = self.coordinator
        try:
            if request.reconnect:  # only who the coordinator is now: the island decides what follows
                await self._call(c.check_island, request.island, fields, changes=False)
                reply = dict(round=c.round, checksum="", rejoin=False)
            else:
                reply = await self._call(c.join, request.island, fields, request.params_checksum, request.round)
        except HandshakeError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"HandshakeError: {e}")
        if request.ready:  # wait for every island to be ready, so that all start their first round together
            self.ready.add(request.island)
            await self._call(lambda: None)  # wakes the others
            began = said = time.monotonic()
            # read under the lock (joins change the sets it reads), on a reader thread
            while waits := await self._call(c.barrier_waits_for, set(self.ready), changes=False):
                version = self._version
                if context.time_remaining() is not None and context.time_remaining() <= 0:
                    break
                if time.monotonic() - said >= BARRIER_LOG_SECONDS:
                    said = time.monotonic()
                    logging.warning("%s", barrier_line(request.island, waits, said - began))
                await self._wait_for_change(version, 1.0)
        return pb.JoinReply(
            round=reply["round"], params_checksum=reply["checksum"], payload_bytes=self.payload_bytes,
            incarnation=c.incarnation, rejoin=reply["rejoin"],
            layout=self.view_layout, view_bytes=self.view_bytes,
            view_chunk_offsets=[k.offset for k in self.view_plan],
            fragments=[
                pb.FragmentPlan(payload_bytes=f.payload_bytes, layout=layout, chunk_offsets=[k.offset for k in f.plan],
                                update_payload_bytes=f.update_bytes,
                                update_chunk_offsets=[k.offset for k in f.update_plan] if f.update_plan != f.plan else [])
                for f, layout in zip(c.fragments, self.layouts)
            ],
        )

    async def Contribute(self, request_iterator, context) -> pb.ContributeReply:
        stream = _ContributionStream(self, context)
        try:
            async for frame in request_iterator:
                await stream.take(frame)
            status = await stream.finish()
        except wire.WireError as e:  # a refused stream leaves nothing of its own behind, whole or not
            await stream.settle()
            if stream.fragment is not None:
                await self._call(self._contributions.abandon, stream.header, str(e), False)
            await context.abort(grpc.StatusCode[e.code], f"WireError: {e}")
        except ContributionError as e:
            await stream.settle()
            if stream.fragment is not None and stream.header is not None:
                await self._call(self._contributions.abandon, stream.header, str(e), False)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ContributionError: {e}")
        except asyncio.CancelledError:  # the island's connection dropped mid-stream: it will send it again
            stream.dropped = True
            if stream.fragment is not None:
                self.loop.run_in_executor(self._worker, self._locked, self._contributions.abandon,
                                          (stream.header, "its connection dropped"))
            raise
        header = stream.header
        if header.island in self.wire_bytes:
            self.wire_bytes[header.island]["received"] += stream.received
        return pb.ContributeReply(
            round=header.round, bytes_received=stream.received, crc32=wire.fold_crc32(stream.crcs),
            discarded=status == "discarded", duplicate=status == "duplicate",
        )

    async def FetchUpdate(self, request: pb.FetchRequest, context):
        await self._check_caller(context, request.island)
        try:
            self.check_incarnation(request.incarnation)
            c = self._fragment(request.fragment, f"island {request.island!r}'s update request")
        except wire.WireError as e:
            await context.abort(grpc.StatusCode[e.code], f"WireError: {e}")
        connection, connections = request.connection, max(request.connections, 1)
        # this stream's chunks: every connections-th of the (share of the) plan, from `connection` on
        mine = {k.index for k in _share(c.plan, request)[connection::connections]}
        sent_chunks: set[int] = set()
        generation, sent = None, 0
        while True:
            version = self._version
            try:
                now_generation, chunks, final = await self._call(c.update_chunks, request.round, changes=False)
            except StaleRoundError as e:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"StaleRoundError: {e}")
            if generation is not None and now_generation != generation:
                frame = wire.restart_frame(now_generation)
                sent += len(frame)
                yield frame
                sent_chunks.clear()
            generation = now_generation
            for k in sorted(chunks):
                if k in mine and k not in sent_chunks:
                    frame = wire.chunk_frame(k, c.update_plan[k].offset, chunks[k])
                    sent += len(frame)
                    yield frame
                    sent_chunks.add(k)
            if final:
                break
            await self._wait_for_change(version, 1.0)
            if context.time_remaining() is not None and context.time_remaining() <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"round {request.round} is not merged yet")
        trailer = await self._call(self._update_trailer, request, changes=False)
        yield trailer
        self._count_fetched(request, connections, sent + len(trailer))

    def _count_fetched(self, request: pb.FetchRequest, connections: int, sent: int) -> None:
        """Books an update stream's `sent` frame bytes; the island has the update once all its streams ended."""
        with self.lock:
            if request.island in self.wire_bytes:
                self.wire_bytes[request.island]["sent"] += sent
            # per share (one of an island of one process): its streams' count, and those that ended
            done = self._streams_done.setdefault((request.fragment, request.round, request.island), {})
            done.setdefault(request.part, (connections, set()))[1].add(request.connection)
            if len(done) == max(request.parts, 1) and all(len(ended) == n for n, ended in done.values()):
                self.fetched.setdefault((request.fragment, request.round), set()).add(request.island)
            self.notify()

    def _update_trailer(self, request: pb.FetchRequest) -> bytes:
        c = self.coordinator.fragments[request.fragment]
        _, chunks, _ = c.update_chunks(request.round)
        if request.parts > 1:  # a share: its own bytes and CRC
            share = [k.index for k in _share(c.plan, request)]
            total, crc = sum(len(chunks[k]) for k in share), wire.fold_crc32(wire.crc32(chunks[k]) for k in share)
        else:
            known = self._update_crc.get(request.fragment)
            if known is None or known[0] != request.round:
                known = (request.round, wire.fold_crc32(wire.crc32(chunks[k]) for k in range(len(chunks))))
                self._update_crc[request.fragment] = known
            total, crc = sum(len(x) for x in chunks.values()), known[1]
        header = pb.PayloadHeader(
            round=request.round, island=request.island, layout=self.layouts[request.fragment],
            inner_steps=self.coordinator.planned_inner_steps(request.island) or 0,
            total_bytes=total, crc32=crc, fragment=request.fragment, part=request.part, parts=request.parts,
        )
        return wire.trailer_frame(header)

    async def FetchView(self, request: pb.FetchRequest, context):
        await self._check_caller(context, request.island)
        c = self.coordinator
        while True:  # a rejoining island waits for the round it is admitted at
            version = self._version
            if await self._call(c.view_ready, request.min_round, changes=False):
                break
            await self._wait_for_change(version, 1.0)
            if context.time_remaining() is not None and context.time_remaining() <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"round {request.min_round} is not reached yet")
        rounds, payload = await self._call(c.fetch_view, request.island)
        # a process of an island of several asks for the chunks it holds elements of (FetchRequest.share)
        plan = wire.share_of(self.view_plan, request.part, request.parts, request.share) if request.share else self.view_plan
        crcs = []
        for _, frame in wire.chunk_frames(payload, plan):
            crcs.append(wire.parse(frame)[1][2])
            yield frame
        yield wire.trailer_frame(
            pb.PayloadHeader(
                round=min(rounds), island=request.island, params_checksum=self.coordinator.checksum,
                total_bytes=sum(chunk.nbytes for chunk in plan), crc32=wire.fold_crc32(crcs), fragment_rounds=rounds,
            )
        )

    def fetched_by(self, fragment: int, round: int) -> set[str]:
        """The islands that received the whole update of `round` of `fragment`."""
        with self.lock:
            return set(self.fetched.get((fragment, round), ()))

    def wait_until_fetched(self, round: int, islands=None, timeout: float | None = None) -> bool:
        """Blocks until `islands` (default: all) have received the whole update of `round` of every
        fragment; False on timeout (seconds)."""
        islands = set(self.coordinator.islands if islands is None else islands)
        keys = [(f, round) for f in range(len(self.coordinator.fragments))]
        with self.lock:
            return self.lock.wait_for(lambda: all(self.fetched.get(k, set()) >= islands for k in keys), timeout=timeout)

    # -- registration ------------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        """The Exchange service's methods: protobuf for Join, raw frames for the payload streams."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Join": grpc.unary_unary_rpc_method_handler(
                    self.Join, request_deserializer=pb.JoinRequest.FromString,
                    response_serializer=pb.JoinReply.SerializeToString,
                ),
                "Contribute": grpc.stream_unary_rpc_method_handler(
                    self.Contribute, request_deserializer=_raw, response_serializer=pb.ContributeReply.SerializeToString
                ),
                "FetchUpdate": grpc.unary_stream_rpc_method_handler(
                    self.FetchUpdate, request_deserializer=pb.FetchRequest.FromString, response_serializer=_raw
                ),
                "FetchView": grpc.unary_stream_rpc_method_handler(
                    self.FetchView, request_deserializer=pb.FetchRequest.FromString, response_serializer=_raw
                ),
            },
        )


class ExchangeServer:
    """A running exchange: its event loop thread and the aio server; `stop(grace)` ends both.

    Raises (from the constructor): ValueError for a `keepalive_seconds` that is not a positive number of seconds,
    and what `serve` lists for the address and the credentials.
    """

    def __init__(
        self, service: ExchangeService, address: str, chunk_bytes: int, tls=None, tokens_file: str = "",
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ):
        self.service, self.tls, self.tokens_file = service, tls, tokens_file
        options = server_options(chunk_bytes, service.receive_limit(), keepalive_seconds)  # checked before the thread
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, options), name="exchange", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, address: str, options: list[tuple[str, int]]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start(address, options))
        except BaseException as e:  # noqa: BLE001 - any failure to start is the constructor's to raise
            self._error = e
        finally:
            self._started.set()  # the constructor waits for this, so it is set however the start ends
        if self._error is None:
            self.loop.run_forever()
        else:
            self.loop.close()

    async def _start(self, address: str, options: list[tuple[str, int]]) -> None:
        service = self.service
        service.loop, service._changed = self.loop, asyncio.Event()
        try:
            interceptors = []
            if self.tokens_file:  # every exchange call needs its island's token; the health service does not
                interceptors.append(security.AuthInterceptor(security.TokenTable(self.tokens_file), SERVICE_NAME))
            credentials = None
            if self.tls is not None and self.tls.cert_file:
                credentials = security.server_credentials(
                    self.tls.cert_file, self.tls.key_file, self.tls.ca_file,
                    require_client_cert=bool(self.tls.require_client_cert),
                )
        except security.SecurityError as e:
            self._error = e
            return
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.server.add_generic_rpc_handlers((service.handler(),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError as e:
            self._error = RuntimeError(f"cannot listen on {address} ({e}); pick a free port with --coordinator=HOST:PORT")
            await self.server.stop(None)  # nothing it made outlives the failed start
            return
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None = None) -> None:
        """Stops serving (waiting up to `grace` seconds for calls in flight) and ends the loop thread."""
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.service.close()


def serve(
    coordinator: FragmentedCoordinator, address: str, chunk_bytes: int, tls=None, tokens_file: str = "",
    insecure: bool = False, keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> tuple[ExchangeServer, ExchangeService, int]:
    """Starts the exchange and health services on `address` ("HOST:PORT"; port 0 picks a free one).

    Args:
      coordinator: the run's `FragmentedCoordinator`.
      address: where to listen; chunk_bytes: `comm.chunk_bytes`.
      tls: `comm.tls` (TLS when its cert_file is set; mutual TLS when client certificates are set too).
      tokens_file: `comm.auth.tokens_file`: every exchange call then needs its island's bearer token.
      insecure: listen off loopback without TLS and tokens all the same (`security.check_exposure`).
      keepalive_seconds: `comm.keepalive_seconds`, the islands' ping interval, seconds (`server_options`).

    Returns:
      (server, service, port): stop with `server.stop(grace_seconds)`.

    Raises:
      RuntimeError: if the address cannot be bound (port in use).
      SecurityError: off loopback without TLS and tokens (and not `insecure`), or unreadable credentials.
      TypeError: `coordinator` is not a `FragmentedCoordinator`.
      ValueError: `keepalive_seconds` is not a positive number.
    """
    security.check_exposure(address, tls, tokens_file, insecure)
    _keepalive_ms(keepalive_seconds)  # a bad interval is refused before anything is built
    service = ExchangeService(coordinator, chunk_bytes, authenticated=bool(tokens_file))
    server = ExchangeServer(service, address, chunk_bytes, tls, tokens_file, keepalive_seconds)
    return server, service, server.port
