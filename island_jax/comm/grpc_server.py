"""The coordinator's gRPC server: its lifecycle on an event loop thread of its own, and `serve`, which starts it.

`serve` puts the Exchange service (`service.ExchangeService`, grpc.aio: one event loop thread serves every
stream of every island) behind the run's credentials (`security`: TLS, and a token per island checked by an
interceptor), with the options both sides agree on (`options`), and registers the standard gRPC health
service (grpc.health.v1), SERVING while the coordinator runs.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm import security
from island_jax.comm.options import KEEPALIVE_SECONDS, SERVICE_NAME, keepalive_ms, server_options
from island_jax.comm.service import ExchangeService

if TYPE_CHECKING:
    from island_jax.coordinator import Coordinator


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
        service.start(self.loop)
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
    coordinator: Coordinator, address: str, chunk_bytes: int, tls=None, tokens_file: str = "",
    insecure: bool = False, keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> tuple[ExchangeServer, ExchangeService, int]:
    """Starts the exchange and health services on `address` ("HOST:PORT"; port 0 picks a free one).

    Args:
      coordinator: the run's `Coordinator`.
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
      TypeError: `coordinator` is not a `Coordinator`.
      ValueError: `keepalive_seconds` is not a positive number.
    """
    security.check_exposure(address, tls, tokens_file, insecure)
    keepalive_ms(keepalive_seconds)  # a bad interval is refused before anything is built
    service = ExchangeService(coordinator, chunk_bytes, authenticated=bool(tokens_file))
    server = ExchangeServer(service, address, chunk_bytes, tls, tokens_file, keepalive_seconds)
    return server, service, server.port
