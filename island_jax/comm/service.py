"""The coordinator's gRPC service: its handlers move bytes, status codes and credentials, nothing else.

`ExchangeService` runs on grpc.aio (one event loop thread serves every stream of every island), checks each
frame, and calls the `session.ExchangeSession` and the coordinator's plain methods on worker threads under
the session's lock. As the coordinator merges chunk k, update streams send it on. Refusals come back as
gRPC status codes with the coordinator's message:

  FAILED_PRECONDITION  handshake mismatch, or a contribution the coordinator refuses (round, NaN...)
  INVALID_ARGUMENT     a payload whose size, layout or framing is wrong
  DATA_LOSS            a chunk whose CRC-32C fails, or a short stream
  DEADLINE_EXCEEDED    an update not merged before the caller's deadline
  OUT_OF_RANGE         an update older than the latest merged round (fetch the view)
  ABORTED              a call made for another incarnation of the coordinator (it restarted: join again)
  UNAUTHENTICATED      with tokens on, a call that names another island than its token's
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from absl import logging

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.comm.intake import ContributionStream, Intake
from island_jax.comm.options import SERVICE_NAME
from island_jax.comm.security.auth import authenticated_island
from island_jax.comm.session import BARRIER_LOG_SECONDS, ExchangeSession, barrier_line, share
from island_jax.outer import codec
from island_jax.protocol import ContributionError, HandshakeError, StaleRoundError

if TYPE_CHECKING:
    from island_jax.coordinator import Coordinator, FragmentCoordinator


def _raw(data: bytes) -> bytes:
    return data


class ExchangeService:
    """Serves one coordinator to the islands.

    Args:
      coordinator: the run's `Coordinator` (no gRPC knowledge of its own; `outer.fragments = 1`
        serves plain DiLoCo as one fragment).
      chunk_bytes: `comm.chunk_bytes`.
      authenticated: calls carry a token for the island they name (`security.AuthInterceptor`).

    Attributes:
      session: the `ExchangeSession`; code outside the service that changes the coordinator (the coordinator
        role's `poll`) holds `session.lock` and calls `session.notify()`.
    """

    def __init__(self, coordinator: Coordinator, chunk_bytes: int, authenticated: bool = False):
        self.coordinator = c = coordinator
        self.authenticated = authenticated
        self.session = ExchangeSession().serve(c)
        self.session.listen(self._schedule_wake)
        shapes = c.shapes
        self.view_plan = codec.chunk_plan(shapes, "none", None, chunk_bytes)
        self.view_bytes = codec.payload_bytes(shapes, "none")
        self.view_layout = codec.layout(shapes, c.fragments[0].codec)  # what Join replies with
        self.intake = Intake(self)
        self._worker = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="coordinator")
        # Reads (update chunks, trailers) never queue behind the chunks waiting to merge.
        self._reader = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="coordinator-read")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._version = 0  # counts changes; update streams wait for the next one
        self._wake_scheduled = False  # a `_wake` is queued on the event loop

    # -- helpers -----------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Binds the service to the event loop that serves it (on that loop)."""
        self.loop, self._changed = loop, asyncio.Event()

    def _schedule_wake(self) -> None:
        """Wakes the update streams after a change (the session's `notify`, holding its lock). Changes made
        before the event loop runs the wake-up already scheduled share it."""
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

    async def call(self, fn, *args, changes: bool = True):
        """Runs `fn(*args)` on a worker thread under the session's lock, then (if it `changes` state) wakes the
        waiters. Calls that change nothing run on their own threads, so an update stream reads merged chunks
        while contributions' chunks still queue to merge."""
        return await self.loop.run_in_executor(self._worker if changes else self._reader, self.locked, fn, args,
                                               changes)

    def locked(self, fn, args: tuple, changes: bool = True):
        """`fn(*args)` under the session's lock, then (if it `changes` state) wakes the waiters; on this thread."""
        with self.session.lock:
            try:
                return fn(*args)
            finally:
                if changes:
                    self.session.notify()

    async def _wait_for_change(self, version: int, timeout: float) -> None:
        """Returns once the state changed after `version` was read (or after `timeout` seconds)."""
        if self._version != version:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def fragment(self, fragment: int, what: str) -> FragmentCoordinator:
        """The coordinator of `fragment`; WireError (INVALID_ARGUMENT) for one this run does not have."""
        if not 0 <= fragment < len(self.coordinator.fragments):
            raise wire.WireError(
                f"{what} names fragment {fragment}, but this run has {len(self.coordinator.fragments)} "
                "(outer.fragments); run every role with the same config",
                code="INVALID_ARGUMENT",
            )
        return self.coordinator.fragments[fragment]

    async def check_caller(self, context, island: str) -> None:
        """Aborts with UNAUTHENTICATED when tokens are on and `island` (named in the request) is not the island
        whose token the call carries."""
        if not self.authenticated:
            return
        if authenticated_island(context) != island:
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
        return max(largest + wire.FRAMING_BYTES, max(map(len, self.session.layouts))) + 4096

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
        self.intake.close()

    # -- methods -----------------------------------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        await self.check_caller(context, request.island)
        try:
            fields = json.loads(request.fingerprint_json)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fingerprint_json is not a JSON object")
        c, session = self.coordinator, self.session
        try:
            if request.reconnect or request.replaying:  # only who the coordinator is now: the island decides
                await self.call(c.check_island, request.island, fields, changes=False)
                if request.replaying:  # a sign of life of an island that catches up
                    await self.call(c.note_replay, request.island, request.round)
                reply = dict(round=c.round, checksum="", rejoin=False)
            else:
                reply = await self.call(c.join, request.island, fields, request.params_checksum, request.round)
        except HandshakeError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"HandshakeError: {e}")
        if request.ready:  # wait for every island to be ready, so that all start their first round together
            await self.call(session.say_ready, request.island)  # wakes the others
            began = said = time.monotonic()
            while waits := await self.call(session.barrier_waits_for, changes=False):  # on a reader thread
                version = self._version
                if context.time_remaining() is not None and context.time_remaining() <= 0:
                    break
                if time.monotonic() - said >= BARRIER_LOG_SECONDS:
                    said = time.monotonic()
                    logging.warning("%s", barrier_line(request.island, waits, said - began))
                await self._wait_for_change(version, 1.0)
        return pb.JoinReply(
            round=reply["round"], params_checksum=reply["checksum"], payload_bytes=session.payload_bytes,
            incarnation=c.incarnation, rejoin=reply["rejoin"],
            kept_json=json.dumps(reply["kept"]) if reply.get("kept") else "",
            layout=self.view_layout, view_bytes=self.view_bytes,
            view_chunk_offsets=[k.offset for k in self.view_plan],
            fragments=[
                pb.FragmentPlan(payload_bytes=f.payload_bytes, layout=layout, chunk_offsets=[k.offset for k in f.plan],
                                update_payload_bytes=f.update_bytes,
                                update_chunk_offsets=[k.offset for k in f.update_plan] if f.update_plan != f.plan else [])
                for f, layout in zip(c.fragments, session.layouts)
            ],
        )

    async def Contribute(self, request_iterator, context) -> pb.ContributeReply:
        stream, session = ContributionStream(self, context), self.session
        try:
            async for frame in request_iterator:
                await stream.take(frame)
            status = await stream.finish()
        except wire.WireError as e:  # a refused stream leaves nothing of its own behind, whole or not
            await stream.settle()
            if stream.fragment is not None:
                await self.call(session.abandon, stream.header, str(e), False)
            await context.abort(grpc.StatusCode[e.code], f"WireError: {e}")
        except ContributionError as e:
            await stream.settle()
            if stream.fragment is not None and stream.header is not None:
                await self.call(session.abandon, stream.header, str(e), False)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ContributionError: {e}")
        except asyncio.CancelledError:  # the island's connection dropped mid-stream: it will send it again
            stream.dropped = True
            if stream.fragment is not None:
                self.loop.run_in_executor(self._worker, self.locked, session.abandon,
                                          (stream.header, "its connection dropped"))
            raise
        return pb.ContributeReply(
            round=stream.header.round, bytes_received=stream.received, crc32=wire.fold_crc32(stream.crcs),
            discarded=status == "discarded", duplicate=status == "duplicate",
        )

    async def FetchUpdate(self, request: pb.FetchRequest, context):
        await self.check_caller(context, request.island)
        try:
            self.check_incarnation(request.incarnation)
            c = self.fragment(request.fragment, f"island {request.island!r}'s update request")
        except wire.WireError as e:
            await context.abort(grpc.StatusCode[e.code], f"WireError: {e}")
        connection, connections = request.connection, max(request.connections, 1)
        # this stream's chunks: every connections-th of the (share of the) plan, from `connection` on
        mine = {k.index for k in share(c.plan, request)[connection::connections]}
        sent_chunks: set[int] = set()
        generation, sent = None, 0
        while True:
            version = self._version
            try:
                now_generation, chunks, final = await self.call(c.update_chunks, request.round, request.island, changes=False)
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
        trailer = wire.trailer_frame(await self.call(
            self.session.update_trailer, request.fragment, request.round, request.island, request.part,
            request.parts, request.share, changes=False))
        yield trailer
        self.session.fetched_stream(request.fragment, request.round, request.island, sent + len(trailer),
                                    request.part, request.parts, connection, connections)

    async def FetchView(self, request: pb.FetchRequest, context):
        await self.check_caller(context, request.island)
        c = self.coordinator
        while True:  # a rejoining island waits for the round it is admitted at
            version = self._version
            if await self.call(c.view_ready, request.min_round, changes=False):
                break
            await self._wait_for_change(version, 1.0)
            if context.time_remaining() is not None and context.time_remaining() <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"round {request.min_round} is not reached yet")
        rounds, payload = await self.call(c.fetch_view, request.island)
        view_checksum = await self.call(lambda: c.checksum, changes=False)  # of shards: waits for their parts
        # a process of an island of several asks for the chunks it holds elements of (FetchRequest.share)
        plan = wire.share_of(self.view_plan, request.part, request.parts, request.share) if request.share else self.view_plan
        crcs = []
        for _, frame in wire.chunk_frames(payload, plan):
            crcs.append(wire.parse(frame)[1][2])
            yield frame
        yield wire.trailer_frame(
            pb.PayloadHeader(
                round=min(rounds), island=request.island, params_checksum=view_checksum,
                total_bytes=sum(chunk.nbytes for chunk in plan), crc32=wire.fold_crc32(crcs), fragment_rounds=rounds,
            )
        )

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
