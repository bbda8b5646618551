"""The island <-> coordinator interface: what an island's outer loop and driver call.

Two implementations: `comm.inprocess.InProcessTransport` (islands and the
coordinator on threads of one process) and `comm.grpc_client.GrpcTransport` (over
gRPC); `comm.link.LinkEmulator` sits under either one.

`fragment` names the parameter group a payload encodes (Streaming DiLoCo,
`outer.fragments`; 0 for plain DiLoCo), and rounds are counted per fragment.
`config_fingerprint` is `config.fingerprint_fields(config)`, so a mismatch can
be named field by field; `params_checksum` is `model.init.checksum` of the
island's global parameters (at the start of the round, for `contribute`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

from absl import logging

from island_jax.comm.link import LinkEmulator
from island_jax.coordinator.contribution import ContributionHeader

BARRIER_LOG_SECONDS = 5.0  # how often a start barrier that still waits says for whom


def barrier_line(island: str, waits: dict[str, str], seconds: float) -> str:
    """The line a start barrier logs while `island` waits: for which islands (`waits`: name -> why, from
    `FragmentedCoordinator.barrier_waits_for`) and for how long, seconds."""
    return f"island {island} has waited {seconds:.0f} s at the start barrier for islands {_why(waits)}"


def _why(waits: dict[str, str]) -> str:
    return ", ".join(f"{n} ({reason})" for n, reason in sorted(waits.items()))


def log_barrier_wait(island: str, waits: dict[str, str] | None, seconds: float, timeout: float) -> None:
    """Logs how long `island` waited at the start barrier (seconds), or, when `waits` is not empty (the barrier
    gave up after `timeout` seconds, `comm.join_timeout_seconds`), for whom it waited in vain."""
    if waits:
        logging.warning("island %s: not every island was ready within %.0f s (still waiting for %s); starting "
                        "anyway; see the log of those islands, or raise comm.join_timeout_seconds", island, timeout,
                        _why(waits))
    else:
        logging.info("island %s waited %.2f s at the start barrier", island, seconds)


@dataclasses.dataclass
class SyncStats:
    """One exchange (a contribution and its update) as the island saw it.

    Attributes:
      bytes_sent, bytes_received: frame bytes of the contribution and of the update (headers, chunk
        framing and payload, as gRPC carries them; the in-process transport counts the same frames).
      seconds_sending: from the first contribution frame until the last one left, s.
      seconds_overlapped: while update chunks came back and contribution chunks were still going out
        (pipelining), s.
      seconds_transferring: time any of this island's bytes were moving (the union of the sending and
        receiving spans, receiving from the first update chunk to the last one's arrival), s. Over the in-process transport these are the emulated link's times (0 without one).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sending: float = 0.0
    seconds_overlapped: float = 0.0
    seconds_transferring: float = 0.0


class ExchangeError(RuntimeError):
    """The exchange with the coordinator failed: unreachable (for longer than `comm.reconnect_seconds`),
    too slow, or corrupt data."""


class CoordinatorRestarted(RuntimeError):
    """The coordinator restarted under a running island (a new incarnation answered its reconnect): the
    island's exchanges in flight are void; it joins again at `round`, the coordinator's, rolling back to its
    own checkpoint of that round where it holds one.

    Attributes:
      round: the rounds the restarted coordinator has completed (its checkpoint's).
    """

    def __init__(self, round: int, message: str):
        super().__init__(message)
        self.round = round


class Transport(Protocol):
    """What an island needs from the path to the coordinator.

    Attributes:
      link: the `LinkEmulator` under the transport (None: no emulated link).
      pipelined: whether the update flows back while the contribution still arrives (the gRPC client
        with `comm.pipeline`); False where the update is fetched after the contribution is in.
    """

    link: LinkEmulator | None
    pipelined: bool

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """The handshake, with the rounds the island completed: {"round": where it is admitted, "checksum": of
        the coordinator's view, "rejoin": whether it takes the view (`fetch_view`) or its own checkpoint of that
        round rather than train on} (`FragmentedCoordinator.join`). Raises HandshakeError on a mismatch."""
        ...

    def start_together(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> None:
        """Says the island is ready to train; returns once every island of the run has said so."""
        ...

    def contribute(self, header: ContributionHeader, payload) -> str:
        """One encoded pseudo-gradient (bytes or a `codec.ChunkEncoder`) with its header: "accepted" or
        "discarded" (it came after its round closed)."""
        ...

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """The update of `round` of `fragment`, once merged (raises StaleRoundError for an old round)."""
        ...

    def fetch_view(self, island: str, min_round: int = 0, needed=None) -> tuple[list[int], bytes]:
        """(each fragment's round, the island view as a float32 "none" payload): the lossless state to rejoin
        from, once every fragment completed `min_round` rounds. `needed`: None, or a function of the view's chunk
        plan giving the chunks this process of an island of several needs (the others may be left zero)."""
        ...

    def planned_inner_steps(self, island: str) -> int | None:
        """Inner steps per round planned from measured step times (after round 0's update), or None."""
        ...

    def stats(self, round: int, fragment: int = 0):
        """The `SyncStats` of the exchange of `round` of `fragment`: frame bytes each way, seconds moving."""
        ...

    def close(self) -> None:
        """Releases connections and threads."""
        ...


class Endpoint(Protocol):
    """What the coordinator's round loop (`coordinator.main.run_coordinator`) needs of the exchange it
    serves: the gRPC service, or an `inprocess.InProcessExchange`.

    Attributes:
      lock: the Condition guarding the coordinator; whoever changes it holds the lock and calls `notify`.
      payload_bytes: bytes of one round's update of every fragment.
      wire_bytes: {island: {"received", "sent"}}: frame bytes per island.
      where: where islands reach it, for the log ("HOST:PORT", or "in process").
    """

    lock: threading.Condition
    payload_bytes: int
    wire_bytes: dict[str, dict[str, int]]
    where: str

    def notify(self) -> None:
        """Wakes every waiter after the coordinator changed (holding `lock`)."""
        ...

    def check(self) -> None:
        """Raises `inprocess.RunAborted` once the run was aborted (never over gRPC)."""
        ...

    def wait_until_fetched(self, round: int, islands, timeout: float) -> bool:
        """Whether `islands` received the update of `round` of every fragment within `timeout` seconds."""
        ...

    def fetched_by(self, fragment: int, round: int) -> set[str]:
        """The islands that received the update of `round` of `fragment`."""
        ...

    def stop(self, grace: float) -> None:
        """Stops serving (waiting up to `grace` seconds for calls in flight)."""
        ...
