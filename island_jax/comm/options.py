"""What both ends of an exchange channel agree on: the service's name, message sizes and keepalive.

Message limits fit one chunk frame of up to `comm.chunk_bytes` (or one whole codec piece). Keepalive is
matched on both sides (gRPC's keepalive guide, doc/keepalive.md): an island idles through minutes of inner
steps between exchanges, so its channels ping every `comm.keepalive_seconds` (10 s by default) with no call
open, and the server admits pings that often (with gRPC's server defaults such a client is sent GOAWAY
"too_many_pings"). A dead coordinator or a NAT that forgot the connection is so noticed.
"""

from __future__ import annotations

from island_jax.comm import exchange_pb2 as pb
from island_jax.config import KEEPALIVE_SECONDS
from island_jax.outer import codec

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Exchange"].full_name
PIECE_BYTES = 16 * codec.PIECE_BYTES  # more than the largest piece (codes and scales, any block size)
KEEPALIVE_TIMEOUT_SECONDS = 20  # a ping unanswered this long closes the connection
# A restarted coordinator is dialled again within this many seconds (gRPC's default backoff grows to 120 s).
RECONNECT_BACKOFF_MAX_SECONDS = 5

__all__ = ["KEEPALIVE_SECONDS", "KEEPALIVE_TIMEOUT_SECONDS", "RECONNECT_BACKOFF_MAX_SECONDS", "SERVICE_NAME",
           "client_options", "keepalive_ms", "message_limits", "server_options"]


def message_limits(chunk_bytes: int) -> list[tuple[str, int]]:
    """Send and receive limits of one chunk frame of up to `chunk_bytes` (or one piece), with 64 KiB to spare."""
    limit = max(chunk_bytes, PIECE_BYTES) + 64 * 1024
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def keepalive_ms(keepalive_seconds: float) -> int:
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
    ping_ms = keepalive_ms(keepalive_seconds)
    limits = message_limits(chunk_bytes)
    if receive_bytes is not None:
        limits = [limits[0], ("grpc.max_receive_message_length", receive_bytes)]
    return [
        *limits,
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ping_ms // 2),
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
        *message_limits(chunk_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms(keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging while idle
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_SECONDS * 1000),
    ]
