"""The coordinator's gRPC service: it moves bytes and status codes, nothing else.

`ExchangeService` reassembles and checks streamed payloads (`comm.wire`), then
calls the coordinator's plain methods under one lock; refusals come back as
gRPC status codes with the coordinator's message:

  FAILED_PRECONDITION  handshake mismatch (fingerprint fields, round, checksum),
                       or a contribution the coordinator refuses (round, NaN...)
  INVALID_ARGUMENT     a payload whose size, layout or framing is wrong
  DATA_LOSS            a chunk or payload whose CRC32 fails, or a short stream
  DEADLINE_EXCEEDED    an update not merged before the caller's deadline
  OUT_OF_RANGE         an update older than the latest merged round (fetch the view)

`serve` also registers the standard gRPC health service (grpc.health.v1),
SERVING while the coordinator runs.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import exchange_pb2_grpc as pb_grpc
from island_jax.comm import wire
from island_jax.coordinator import (
    ContributionError,
    Coordinator,
    HandshakeError,
    StaleRoundError,
    UpdateNotReady,
)
from island_jax.outer import codec

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Exchange"].full_name
_FRAMING_BYTES = 64 * 1024  # room for a chunk's header fields in a message


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC options that admit one chunk of `chunk_bytes` per message, on both ends."""
    limit = chunk_bytes + _FRAMING_BYTES
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class ExchangeService(pb_grpc.ExchangeServicer):
    """Serves one coordinator to the islands.

    Args:
      coordinator: the run's coordinator (no gRPC knowledge of its own).
      chunk_bytes: largest chunk sent or accepted (`comm.chunk_bytes`).
    """

    def __init__(self, coordinator: Coordinator, chunk_bytes: int):
        self.coordinator = coordinator
        self.chunk_bytes = chunk_bytes
        c = coordinator
        self.payload_bytes = codec.payload_bytes(c.master, c.kind, c.block_size)
        self.layout = codec.layout(c.master, c.kind, c.block_size)
        self.view_bytes = codec.payload_bytes(c.master, "none", c.block_size)
        self.lock = threading.Condition()  # guards the coordinator; notified after every merge
        self.fetched: dict[int, set[str]] = {}  # round -> islands that received its whole update
        self.wire_bytes = {name: dict(received=0, sent=0) for name in c.islands}

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            fields = json.loads(request.fingerprint_json)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fingerprint_json is not a JSON object")
        with self.lock:
            try:
                reply = self.coordinator.join(request.island, fields, request.params_checksum, request.round)
            except HandshakeError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"HandshakeError: {e}")
        return pb.JoinReply(
            round=reply["round"], params_checksum=reply["checksum"], payload_bytes=self.payload_bytes, layout=self.layout,
            view_bytes=self.view_bytes,
        )

    def Contribute(self, request_iterator, context: grpc.ServicerContext) -> pb.ContributeReply:
        receiver = wire.Reassembler(self.payload_bytes, self.chunk_bytes)
        try:
            header, payload = receiver.extend(request_iterator).finish()
        except wire.WireError as e:
            context.abort(grpc.StatusCode[e.code], f"WireError: {e}")
        if header.layout != self.layout:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"island {header.island!r} encoded round {header.round} for payload layout {header.layout}, but the "
                f"coordinator expects {self.layout} (leaf shapes, codec, block size differ); refused",
            )
        with self.lock:
            try:
                status = self.coordinator.contribute(
                    header.round, header.island, header.tokens, payload, header.params_checksum or None,
                    header.step_seconds or None,
                )
            except ContributionError as e:
                self.lock.notify_all()  # a refusal can close the round for the others
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ContributionError: {e}")
            if header.island in self.wire_bytes:
                self.wire_bytes[header.island]["received"] += receiver.wire_bytes
            self.lock.notify_all()
        return pb.ContributeReply(
            round=header.round, bytes_received=len(payload), crc32=wire.crc32(payload), discarded=status == "discarded"
        )

    def FetchUpdate(self, request: pb.FetchRequest, context: grpc.ServicerContext):
        with self.lock:
            while True:
                try:
                    payload = self.coordinator.fetch_update(request.round, request.island)
                    break
                except UpdateNotReady as e:
                    remaining = context.time_remaining()
                    if not context.is_active() or (remaining is not None and remaining <= 0):
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
                    self.lock.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))
                    if self.coordinator.poll():  # a quorum's grace window may have ended
                        self.lock.notify_all()
                except StaleRoundError as e:
                    context.abort(grpc.StatusCode.OUT_OF_RANGE, f"StaleRoundError: {e}")
                except ContributionError as e:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ContributionError: {e}")
            header = pb.PayloadHeader(
                round=request.round, island=request.island, layout=self.layout, params_checksum=self.coordinator.checksum,
                inner_steps=self.coordinator.planned_inner_steps(request.island) or 0,
            )
        sent = 0
        for part in wire.payload_parts(header, payload, self.chunk_bytes):
            sent += wire.part_bytes(part)
            yield part
        with self.lock:
            self.fetched.setdefault(request.round, set()).add(request.island)
            if request.island in self.wire_bytes:
                self.wire_bytes[request.island]["sent"] += sent
            self.lock.notify_all()

    def FetchView(self, request: pb.FetchRequest, context: grpc.ServicerContext):
        with self.lock:
            round, payload = self.coordinator.fetch_view()
            header = pb.PayloadHeader(round=round, island=request.island, params_checksum=self.coordinator.checksum)
        yield from wire.payload_parts(header, payload, self.chunk_bytes)

    def wait_until_fetched(self, round: int, islands=None, timeout: float | None = None) -> bool:
        """Blocks until `islands` (default: all) have received the whole update of `round`; False on timeout."""
        islands = set(self.coordinator.islands if islands is None else islands)
        with self.lock:
            return self.lock.wait_for(lambda: self.fetched.get(round, set()) >= islands, timeout=timeout)


def serve(coordinator: Coordinator, address: str, chunk_bytes: int) -> tuple[grpc.Server, ExchangeService, int]:
    """Starts the exchange and health services on `address` ("HOST:PORT"; port 0 picks a free one).

    Returns:
      (server, service, port): stop with `server.stop(grace_seconds)`.

    Raises:
      RuntimeError: if the address cannot be bound (port in use).
    """
    service = ExchangeService(coordinator, chunk_bytes)
    # Each island holds up to one contribute and one fetch at a time.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4 * len(coordinator.islands) + 4),
        options=channel_options(chunk_bytes),
    )
    pb_grpc.add_ExchangeServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address} ({e}); pick a free port with --coordinator=HOST:PORT") from e
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, service, port
