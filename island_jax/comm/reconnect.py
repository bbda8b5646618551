"""How the island's calls fail, and how they are made again after a lost connection.

Status codes from the coordinator become the exceptions the coordinator raises in process (`status_error`):
FAILED_PRECONDITION at join is HandshakeError and otherwise ContributionError, OUT_OF_RANGE is
StaleRoundError (fetch the view), INVALID_ARGUMENT (a mis-shaped payload) and DEADLINE_EXCEEDED (a round not
merged in time) are ExchangeError. A call that fails with UNAVAILABLE (coordinator down, connection reset),
or whose data arrived corrupt (DATA_LOSS, a CRC-32C mismatch; up to `CORRUPT_RETRIES` times), is retried
with capped exponential backoff (0.5 s doubling to `comm.reconnect_backoff_cap_seconds`) for up to
`comm.reconnect_seconds`, each attempt logged. Before each retry the island asks the coordinator who it is
(a Join with `reconnect`): the same incarnation means the connection merely dropped, and the call is made
again (a contribution with a new attempt number, counted once); a new one means the coordinator restarted,
and `CoordinatorRestarted` tells the island to join again (ABORTED answers a call made for the old one).
"""

from __future__ import annotations

import logging
import time

import grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm.streams import CorruptPayload
from island_jax.protocol import (
    ContributionError,
    CoordinatorRestarted,
    ExchangeError,
    HandshakeError,
    StaleRoundError,
)

CORRUPT_RETRIES = 3  # a payload that arrives corrupt this many times in a row fails the call
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNKNOWN)  # what a dropped or reset connection surfaces as


def status_error(e: grpc.RpcError, what: str, address: str) -> Exception:
    """The exception a failed call `what` to the coordinator at `address` raises, from its status code."""
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


class Reconnecting:
    """The reconnect policy of `grpc_client.GrpcTransport`, which provides what it reads: `address`,
    `incarnation` (the coordinator's, from the last join), `clock` (seconds), `finished` (None, or True once
    the run finished without this island), `reconnect_seconds`, `backoff_cap_seconds`, `_who` (island, fingerprint
    JSON of the last join), `_joining` (the island's name) and `_join` (the Join stubs, one per connection)."""

    def _retrying(self, what: str, call):
        """`call(incarnation)`, made again while the coordinator is unreachable or the data arrives corrupt (see
        the module docstring); `incarnation` is the coordinator's when the call began, which every try carries.

        Raises:
          CoordinatorRestarted: the coordinator restarted meanwhile (or had before the call).
          ExchangeError: still unreachable after `reconnect_seconds`, corrupt `CORRUPT_RETRIES` times in a
            row, the run finished, or another failure (`status_error`).
        """
        incarnation, start, attempt, corrupt = self.incarnation, self.clock(), 0, 0
        while True:
            try:
                if incarnation != self.incarnation:
                    raise self._restarted(what)
                return call(incarnation)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ABORTED:
                    raise self._restarted(what) from None
                if e.code() == grpc.StatusCode.DATA_LOSS:
                    corrupt += 1
                elif e.code() not in UNREACHABLE:
                    raise status_error(e, what, self.address) from None
                failure = f"{e.code().name}: {e.details()}"
            except CorruptPayload as e:
                corrupt, failure = corrupt + 1, str(e)
            if corrupt > CORRUPT_RETRIES:
                raise ExchangeError(f"{what}: the data arrived corrupt {corrupt} times in a row ({failure})")
            while True:  # back off, then ask who answers
                elapsed = self.clock() - start
                if self.finished is not None and self.finished():
                    raise ExchangeError(f"{what}: the coordinator finished the run ({failure})")
                if elapsed >= self.reconnect_seconds:
                    raise ExchangeError(
                        f"{what}: the coordinator at {self.address} was unreachable for {elapsed:.0f} s "
                        f"(comm.reconnect_seconds={self.reconnect_seconds:g}; last: {failure}); check that it runs"
                    )
                delay = min(0.5 * 2**attempt, self.backoff_cap_seconds, max(self.reconnect_seconds - elapsed, 0.0))
                attempt += 1
                logging.warning("island %s: %s failed (%s); reconnect attempt %d in %.1f s (%.0f of %g s)",
                                self._island(), what, failure, attempt, delay, elapsed, self.reconnect_seconds)
                time.sleep(delay)
                try:
                    now = self._probe().incarnation
                except grpc.RpcError as e:
                    failure = f"{e.code().name}: {e.details()}"
                    continue
                if now != incarnation:
                    raise self._restarted(what)
                logging.warning("island %s: reconnected to the coordinator; %s again", self._island(), what)
                break

    def _island(self) -> str:
        return self._who[0] if self._who else self._joining

    def _probe(self) -> pb.JoinReply:
        """Who the coordinator is now (a Join with `reconnect`: its incarnation and round). Raises grpc.RpcError
        if it is unreachable."""
        island, fingerprint = self._who
        request = pb.JoinRequest(island=island, fingerprint_json=fingerprint, reconnect=True)
        return self._join[0](request, timeout=10.0)

    def _restarted(self, what: str) -> CoordinatorRestarted:
        try:
            round = self._probe().round
        except grpc.RpcError:
            round = -1
        logging.warning("island %s: the coordinator restarted (at round %d); %s is void, the island joins again",
                        self._island(), round, what)
        return CoordinatorRestarted(round, f"{what}: the coordinator restarted at round {round}")
