"""The island's side of the gRPC exchange: the `Transport` calls over a channel.

`GrpcTransport` implements join / contribute / fetch_update like the in-process
transport, so `Island` code does not change. Status codes from the coordinator
become the same exceptions the coordinator raises in process:

  FAILED_PRECONDITION at join     -> HandshakeError
  FAILED_PRECONDITION otherwise   -> ContributionError
  OUT_OF_RANGE                    -> StaleRoundError (fetch the view)
  DATA_LOSS, INVALID_ARGUMENT     -> ExchangeError (corrupt or mis-shaped payload)
  UNAVAILABLE, DEADLINE_EXCEEDED  -> ExchangeError (coordinator unreachable or late)

Each call's bytes on the wire (serialized messages, handshake excluded) are in
`last_bytes_sent` / `last_bytes_received`.
"""

from __future__ import annotations

import json
import logging

import grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import exchange_pb2_grpc as pb_grpc
from island_jax.comm import wire
from island_jax.comm.server import channel_options
from island_jax.coordinator import ContributionError, HandshakeError, StaleRoundError


class ExchangeError(RuntimeError):
    """The exchange with the coordinator failed: unreachable, too slow, or corrupt data."""


def _error(e: grpc.RpcError, what: str, address: str) -> Exception:
    code, detail = e.code(), e.details()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        kind = HandshakeError if what == "join" else ContributionError
        return kind(detail.split(": ", 1)[1] if detail.startswith(kind.__name__) else detail)
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return StaleRoundError(detail.split(": ", 1)[1] if detail.startswith("StaleRoundError") else detail)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ExchangeError(
            f"{what}: the coordinator at {address} did not answer in time ({code.name}: {detail}); check that it "
            "runs and that --coordinator names its HOST:PORT"
        )
    return ExchangeError(f"{what}: the coordinator at {address} refused it ({code.name}: {detail})")


class GrpcTransport:
    """The island's connection to the coordinator at `address` ("HOST:PORT").

    Args:
      address: the coordinator's HOST:PORT.
      chunk_bytes: largest chunk sent or accepted (`comm.chunk_bytes`), bytes.
      join_timeout: seconds to wait for the coordinator at join (it may still be starting).
      round_timeout: seconds to wait for a round's update.
    """

    def __init__(self, address: str, chunk_bytes: int, join_timeout: float = 300.0, round_timeout: float = 3600.0):
        self.address, self.chunk_bytes = address, chunk_bytes
        self.join_timeout, self.round_timeout = join_timeout, round_timeout
        self.channel = grpc.insecure_channel(address, options=channel_options(chunk_bytes))
        self.stub = pb_grpc.ExchangeStub(self.channel)
        self.payload_bytes: int | None = None
        self.view_bytes: int | None = None
        self.layout = ""
        self.last_bytes_sent = self.last_bytes_received = 0
        self._planned: dict[str, int] = {}

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Handshake; waits up to `join_timeout` seconds for the coordinator to come up.

        Raises:
          HandshakeError: the coordinator refused (its message names what differs).
          ExchangeError: the coordinator did not answer.
        """
        request = pb.JoinRequest(
            island=island, fingerprint_json=json.dumps(config_fingerprint), params_checksum=params_checksum, round=round
        )
        try:
            reply = self.stub.Join(request, timeout=self.join_timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _error(e, "join", self.address) from None
        self.payload_bytes, self.layout, self.view_bytes = reply.payload_bytes, reply.layout, reply.view_bytes
        return dict(round=reply.round, checksum=reply.params_checksum)

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str:
        """Streams one encoded pseudo-gradient in CRC32-checked chunks; returns "accepted" or "discarded".

        Raises:
          ContributionError: the coordinator refused it (round, NaN, checksum...).
          ExchangeError: transfer failed, or the coordinator's byte count or CRC32
            differs from what was sent.
        """
        header = pb.PayloadHeader(
            round=round, island=island, tokens=tokens, layout=self.layout, params_checksum=params_checksum or "",
            step_seconds=step_seconds or 0.0,
        )
        sent = 0

        def parts():
            nonlocal sent
            for part in wire.payload_parts(header, payload, self.chunk_bytes):
                sent += wire.part_bytes(part)
                yield part

        try:
            reply = self.stub.Contribute(parts(), timeout=self.round_timeout)
        except grpc.RpcError as e:
            raise _error(e, "contribute", self.address) from None
        if reply.bytes_received != len(payload) or reply.crc32 != wire.crc32(payload):
            raise ExchangeError(
                f"the coordinator reassembled {reply.bytes_received} bytes (CRC32 {reply.crc32:08x}) of the "
                f"{len(payload)} sent (CRC32 {wire.crc32(payload):08x})"
            )
        self.last_bytes_sent = sent
        if reply.discarded:
            logging.warning(
                "island %s's contribution to round %d came after the round closed and was discarded; "
                "fetching that round's update", island, round,
            )
        return "discarded" if reply.discarded else "accepted"

    def fetch_update(self, round: int, island: str) -> bytes:
        """The round's update bytes; waits up to `round_timeout` seconds for the merge.

        Raises:
          ExchangeError: late, unreachable, or a corrupt stream (CRC32).
          StaleRoundError: the round is older than the coordinator's latest (use `fetch_view`).
        """
        header, payload = self._receive(
            "fetch_update", self.stub.FetchUpdate, pb.FetchRequest(round=round, island=island), self.payload_bytes
        )
        if header.inner_steps:
            self._planned[island] = header.inner_steps
        return payload

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round as last planned by the coordinator (None: no plan)."""
        return self._planned.get(island)

    def fetch_view(self, island: str) -> tuple[int, bytes]:
        """(round, the island view as a float32 payload) for an island that fell behind.

        Raises:
          ExchangeError: unreachable, or a corrupt stream (CRC32).
        """
        header, payload = self._receive("fetch_view", self.stub.FetchView, pb.FetchRequest(island=island), self.view_bytes)
        return header.round, payload

    def _receive(self, what: str, call, request: pb.FetchRequest, max_bytes: int | None):
        """Reassembles and checks one streamed payload; (header, payload)."""
        receiver = wire.Reassembler(max_bytes or 0, self.chunk_bytes)
        try:
            receiver.extend(call(request, timeout=self.round_timeout))
            header, payload = receiver.finish()
        except grpc.RpcError as e:
            raise _error(e, what, self.address) from None
        except wire.WireError as e:
            raise ExchangeError(f"{what}: {e}") from None
        self.last_bytes_received = receiver.wire_bytes
        return header, payload

    def close(self) -> None:
        self.channel.close()
