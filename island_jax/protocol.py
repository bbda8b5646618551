"""The seam between an island and the coordinator: what both sides speak, whatever the transport.

`ContributionHeader` travels with every encoded pseudo-gradient (DiLoCo, arXiv 2311.08105, Algorithm 1); the
errors are raised on one side and rebuilt on the other (the gRPC service maps each to a status code);
`Transport` is what an island's outer loop calls and `Endpoint` what the coordinator's round loop serves.
`island/`, `comm/` and `coordinator/` import this module, which imports nothing of island_jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from island_jax.comm.link import LinkEmulator

# The key of an island's fingerprint that describes its corpus (`data.Corpus.fingerprint`), which the coordinator
# does not read itself: every island's must equal those of the others that joined (`coordinator.handshake`).
CORPUS = "corpus"


def chunk_digest(*parts) -> str:
    """SHA-256 (64 hex digits) of one chunk's bytes, given whole or as the buffers it is joined from (bytes,
    memoryviews or contiguous NumPy arrays): what the coordinator records of each chunk it merges and a replaying
    island recomputes (`coordinator.replay`, `island.replay`)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ContributionHeader:
    """One island's contribution to one round of one fragment, less its payload.

    Attributes:
      round: the fragment's round the pseudo-gradient belongs to (0-based).
      island: the contributing island's name (a key of `config.islands`).
      tokens: tokens the island processed since its last contribution (> 0): its merge weight.
      params_checksum: `model.init.checksum` (16 hex digits) of the island's anchor of the fragment, which
        must equal the coordinator's view: proof that every island trained from the same bits (None: not
        checked).
      step_seconds: the island's median inner-step time (seconds), which plans later rounds under
        `outer.auto_from = "measured"` (None: not measured).
      fragment: the fragment the payload encodes (Streaming DiLoCo, arXiv 2501.18512; 0 with one fragment).
      overlap_steps: tau, the inner steps the island trains before applying this fragment's update, when it was
        chosen from measured times (`outer.overlap_steps = "auto"`), so that a replay applies it alike (None:
        the config's).
      routed_counts: of an MoE model, the assignments the island's routers sent to each routed expert over the
        steps the contribution covers (since the fragment's last contribution), before capacity drops: int
        [MoE layers, experts], each layer summing to (tokens - unrouted_tokens) x `moe.num_experts_per_token`
        (`coordinator.expert_merge.check_routed_counts`); None: not sent.
      routing_probe: the experts the island's routers chose for the fixed probe batch's first tokens at the end
        of the round (the round's last fragment): uint8 (uint16 past 256 experts) [MoE layers, tokens, k]
        (`coordinator/routing.py`); None: not sent.
      post_sync_loss_change: loss of the island's first inner step after the previous round's update less the
        loss of the step before it (the round's last fragment); None: not measured.
      unrouted_tokens: of `tokens`, those no router saw (padding in the island's batches), which
        `routed_counts` do not cover.
    """

    round: int
    island: str
    tokens: int
    params_checksum: str | None = None
    step_seconds: float | None = None
    fragment: int = 0
    overlap_steps: int | None = None
    routed_counts: Any = None
    routing_probe: Any = None
    post_sync_loss_change: float | None = None
    unrouted_tokens: int = 0


class HandshakeError(ValueError):
    """An island's name, config fingerprint, round or initial parameter checksum differs from the coordinator's."""


class ContributionError(ValueError):
    """A contribution cannot be merged (wrong round, unknown island, bad payload, NaN/Inf)."""


class StaleRoundError(ContributionError):
    """An island asked for the update of a round older than the latest merged one; it should fetch the view."""


class UpdateNotReady(LookupError):
    """The update for a round is not merged yet (some islands have not contributed)."""


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
        receiving spans, receiving from the first update chunk to the last one's arrival), s. Over the
        in-process transport these are the emulated link's times (0 without one).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sending: float = 0.0
    seconds_overlapped: float = 0.0
    seconds_transferring: float = 0.0


class Transport(Protocol):
    """What an island needs from the path to the coordinator: `comm.inprocess.InProcessTransport` (threads of
    one process) or `comm.grpc_client.GrpcTransport`, with a `comm.link.LinkEmulator` under either.

    `fragment` names the parameter group a payload encodes (Streaming DiLoCo, `outer.fragments`; 0 for plain
    DiLoCo), and rounds are counted per fragment. `config_fingerprint` is `config.fingerprint_fields(config)`;
    `params_checksum` is `model.init.checksum` of the island's global parameters.

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
        round rather than train on, "kept": with "rejoin", what it may replay (`Coordinator.join`)}. Raises
        HandshakeError on a mismatch."""
        ...

    def replaying(self, island: str, round: int) -> None:
        """Tells the coordinator the island is replaying `round` (0-based): a sign of life while it catches up."""
        ...

    def start_together(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> None:
        """Says the island is ready to train; returns once every island of the run has said so."""
        ...

    def contribute(self, header: ContributionHeader, payload) -> str:
        """One encoded pseudo-gradient (bytes or a `codec.ChunkEncoder`) with its header: "accepted" or
        "discarded" (it came after its round closed)."""
        ...

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """The update of `round` of `fragment`, once merged; of a past round, the kept one to an island that
        replays (raises StaleRoundError for an old round otherwise)."""
        ...

    def fetch_view(self, island: str, min_round: int = 0, needed=None) -> tuple[list[int], bytes]:
        """(each fragment's round, the island view as a float32 "none" payload): the lossless state to rejoin
        from, once every fragment completed `min_round` rounds. `needed`: None, or a function of the view's chunk
        plan giving the chunks this process of an island of several needs (the others may be left zero)."""
        ...

    def planned_inner_steps(self, island: str) -> int | None:
        """Inner steps per round planned from measured step times (after round 0's update), or None."""
        ...

    def stats(self, round: int, fragment: int = 0) -> SyncStats:
        """The `SyncStats` of the exchange of `round` of `fragment`: frame bytes each way, seconds moving."""
        ...

    def close(self) -> None:
        """Releases connections and threads."""
        ...


class Endpoint(Protocol):
    """What the coordinator's round loop (`roles.coordinator.run_coordinator`) needs of the exchange it
    serves: the gRPC service's `session.ExchangeSession`, or an `inprocess.InProcessExchange` (one itself).

    Attributes:
      lock: the Condition guarding the coordinator; whoever changes it holds the lock and calls `notify`.
      payload_bytes: bytes of one round's update of every fragment.
      wire_bytes: {island: {"received", "sent"}}: frame bytes per island.
      payload_received: {island: chunk bytes of its contributions taken}.
      where: where islands reach it, for the log ("HOST:PORT", or "in process").
    """

    lock: threading.Condition
    payload_bytes: int
    wire_bytes: dict[str, dict[str, int]]
    payload_received: dict[str, int]
    where: str

    def notify(self) -> None:
        """Wakes every waiter after the coordinator changed (holding `lock`)."""
        ...

    def check(self) -> None:
        """Raises `session.RunAborted` once the run was aborted (never over gRPC)."""
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
