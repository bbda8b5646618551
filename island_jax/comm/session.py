"""The exchange session: what both transports keep of a run's exchanges with the coordinator, in one place.

`ExchangeSession` holds, under the coordinator's lock (a threading.Condition), the start barrier's ready
set, each contribution's attempts (a retry after a dropped connection replaces the attempt before it;
contributions are keyed by (round, fragment, island), so a retry is counted once) and its shares (one per
process of an island of several), the islands that fetched each update, and the frame bytes each island
moved (`wire.contribution_frame_bytes`, `wire.update_frame_bytes`: headers, chunk framing and payload).
The in-process transport (`inprocess`) calls it directly; the gRPC service (`service`) calls it from its
handlers, and only moves bytes, status codes and credentials itself.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Callable

from absl import logging

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.outer import codec
from island_jax.protocol import ContributionError, ContributionHeader

if TYPE_CHECKING:
    from island_jax.coordinator import Coordinator, FragmentCoordinator

BARRIER_LOG_SECONDS = 5.0  # how often a start barrier that still waits says for whom


class RunAborted(RuntimeError):
    """Another role of the same process failed (or the run was stopped); this one stops waiting."""


def barrier_line(island: str, waits: dict[str, str], seconds: float) -> str:
    """The line a start barrier logs while `island` waits: for which islands (`waits`: name -> why, from
    `Coordinator.barrier_waits_for`) and for how long, seconds."""
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
class Attempt:
    """One attempt at a contribution (or at one share of it): the coordinator's answer to its header, its
    streams and how many ended."""

    status: str  # "accepted", "discarded" or "duplicate" (a retry of a contribution already in)
    streams: int
    attempt: int  # PayloadHeader.attempt: the streams of one attempt share it
    ended: int = 0
    chunks: set = dataclasses.field(default_factory=set)  # of a share (parts > 1): the chunks it handed on


def share(plan: list[codec.Chunk], request) -> list[codec.Chunk]:
    """The chunks of `plan` a contribution's header or an update request names: share `part` of `parts`
    (`wire.share_of`), or all."""
    return wire.share_of(plan, request.part, request.parts, request.share)


def _key(header: pb.PayloadHeader) -> tuple[int, int, str, int]:
    return header.fragment, header.round, header.island, header.part


class ExchangeSession:
    """One coordinator's exchanges with the islands, whatever carries them.

    A contribution arrives as attempts (`begin`, `add_chunks`, `end`, `abandon`): the first stream's header
    opens it at the fragment's coordinator and the last stream's end closes it. A header with another
    `attempt` is a retry after a dropped connection: the attempt before it is forgotten (its chunks never
    reach the merge) unless it was complete, in which case the retry is a duplicate and counted once. An
    island of several processes sends `parts` shares (the chunks each process owns, named in the header's
    `share`), each with attempts of its own: the first share opens the contribution, a share that fails or is
    sent again loses only its own chunks, and the contribution closes when every share's streams have ended.
    A share whose streams all end without every chunk of it is refused with ContributionError.

    Methods named "holding `lock`" leave `notify` to their caller; the others take the lock themselves.

    Attributes:
      lock: a threading.Condition guarding the coordinator, notified after every change (`notify`).
      coordinator: the served `Coordinator` (None until `serve`).
      payload_bytes: bytes of one round of every fragment's contribution (one island's).
      update_bytes: bytes of one round of every fragment's update.
      layouts: `codec.layout` of each fragment's payload.
      wire_bytes: {island: {"received", "sent"}}: frame bytes of contributions taken and of updates sent.
      payload_received: {island: chunk bytes of its contributions taken} (of a coordinator shard: its range's).
      fetched: {(fragment, round): islands that received its whole update}.
      ready: islands that said they are ready to train (the start barrier).
      aborted: why the session was aborted (None while it runs).
    """

    def __init__(self):
        self.lock = threading.Condition()
        self.coordinator: Coordinator | None = None
        self.payload_bytes = 0
        self.update_bytes = 0
        self.layouts: list[str] = []
        self.wire_bytes: dict[str, dict[str, int]] = {}
        self.payload_received: dict[str, int] = {}
        self.fetched: dict[tuple[int, int], set[str]] = {}
        self.ready: set[str] = set()
        self.aborted: str | None = None
        self._listeners: list[Callable[[], None]] = []
        self._open: dict[tuple[int, int, str, int], Attempt] = {}
        self._shares_ended: dict[tuple[int, int, str], set[int]] = {}  # parts > 1: the shares that ended well
        self._streams_done: dict[tuple[int, int, str], dict[int, tuple[int, set[int]]]] = {}  # per share
        self._update_crc: dict[int, tuple[int, int]] = {}  # fragment -> (round, CRC-32C of its update's chunk CRCs)

    def serve(self, coordinator: Coordinator) -> "ExchangeSession":
        """Starts the session for `coordinator` (wakes whoever waits for it); returns self."""
        with self.lock:
            self.coordinator = coordinator
            self.payload_bytes = sum(f.payload_bytes for f in coordinator.fragments)
            self.update_bytes = sum(f.update_bytes for f in coordinator.fragments)
            self.layouts = [codec.layout(f.shapes, f.codec) for f in coordinator.fragments]
            self.wire_bytes = {name: dict(received=0, sent=0) for name in coordinator.islands}
            self.payload_received = dict.fromkeys(coordinator.islands, 0)
            self.notify()
        return self

    def listen(self, wake: Callable[[], None]) -> None:
        """Calls `wake()` (holding `lock`) at every `notify`, beside the lock's own waiters (an event loop's)."""
        self._listeners.append(wake)

    def notify(self) -> None:
        """Wakes every waiter after the coordinator changed; call it holding `lock`."""
        self.lock.notify_all()
        for wake in self._listeners:
            wake()

    def abort(self, reason: str) -> None:
        """Makes every waiting and later call raise `RunAborted(reason)` (a role of the run failed)."""
        with self.lock:
            self.aborted = self.aborted or reason
            self.notify()

    def check(self) -> None:
        """Raises `RunAborted` once the session was aborted."""
        if self.aborted is not None:
            raise RunAborted(self.aborted)

    # -- the start barrier -------------------------------------------------------------------------------

    def say_ready(self, island: str) -> None:
        """Adds `island` to the islands ready to train, and wakes the others."""
        with self.lock:
            self.ready.add(island)
            self.notify()

    def barrier_waits_for(self) -> dict[str, str]:
        """Whom the start barrier still waits for, and why (`Coordinator.barrier_waits_for`)."""
        with self.lock:
            return self.coordinator.barrier_waits_for(set(self.ready))

    def wait_at_barrier(self, island: str, timeout: float) -> dict[str, str]:
        """Says `island` is ready and waits, holding `lock`, until the barrier waits for nobody, the session is
        aborted, or `timeout` seconds passed, logging for whom it waits every `BARRIER_LOG_SECONDS`; returns
        whom it still waits for ({} once everybody is ready).

        Raises:
          RunAborted: the session was aborted.
        """
        c, began = self.coordinator, time.monotonic()
        self.say_ready(island)
        while (waits := c.barrier_waits_for(set(self.ready))) and self.aborted is None:
            left = timeout - (time.monotonic() - began)
            if left <= 0:
                break
            if not self.lock.wait_for(lambda: not c.barrier_waits_for(set(self.ready)) or self.aborted is not None,
                                      min(left, BARRIER_LOG_SECONDS)):
                logging.warning("%s", barrier_line(island, c.barrier_waits_for(set(self.ready)),
                                                   time.monotonic() - began))
        self.check()
        return waits

    # -- contributions -----------------------------------------------------------------------------------

    def fragment(self, header) -> FragmentCoordinator:
        return self.coordinator.fragments[header.fragment]

    def check_header(self, header: pb.PayloadHeader) -> None:
        """Raises WireError (INVALID_ARGUMENT) for a header whose payload size, layout, share or routed counts
        (`FragmentCoordinator.routed_counts_of`) are not its fragment's; nothing of it is merged."""
        c = self.fragment(header)
        if header.total_bytes != c.payload_bytes:
            raise wire.WireError(
                f"payload of {header.total_bytes} bytes from island {header.island!r}, round "
                f"{header.round}, fragment {header.fragment}, but it should be {c.payload_bytes} bytes; "
                "the island's model or codec differs from the coordinator's"
            )
        layout = self.layouts[header.fragment]
        if header.layout != layout:
            raise wire.WireError(
                f"island {header.island!r} encoded round {header.round} for payload layout {header.layout}, "
                f"but the coordinator expects {layout} (leaf shapes, codec, block size differ); refused"
            )
        share(c.plan, header)  # a share's bitmap must fit the plan
        try:  # checked before anything of the contribution is taken (a header without them needs neither call)
            if header.routed_counts:
                c.routed_counts_of(header.island, header.round, header.tokens, header.routed_counts,
                                   header.unrouted_tokens)
            if header.routing_probe:
                c.routing_probe_of(header.island, header.round, header.routing_probe)
        except ValueError as e:
            raise wire.WireError(str(e)) from None

    def _forget_share(self, header: pb.PayloadHeader, entry: Attempt, reason: str, keep_complete: bool) -> None:
        c = self.fragment(header)
        if header.round != c.round or entry.status != "accepted":
            return
        if header.parts > 1 and keep_complete:
            self._shares_ended.get(_key(header)[:3], set()).discard(header.part)
            c.forget_chunks(header.island, entry.chunks, reason)
        else:
            c.abandon(header.island, reason, keep_complete=keep_complete)

    def begin(self, header: pb.PayloadHeader) -> Attempt:
        """Opens the attempt `header` (its first stream's) announces, holding `lock`: checks it (`check_header`),
        replaces an earlier attempt (a retry) and opens the contribution at the fragment's coordinator.

        Raises:
          WireError: see `check_header`. ContributionError: the coordinator refused it.
        """
        self.check_header(header)
        key = _key(header)
        entry = self._open.get(key)
        c = self.fragment(header)
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
                    header.overlap_steps - 1 if header.overlap_steps else None,
                    list(header.routed_counts) or None,  # checked again there, as a direct call's
                    header.routing_probe or None,
                    header.post_sync_loss_change if header.HasField("post_sync_loss_change") else None,
                    header.unrouted_tokens,
                ))
            entry = self._open[key] = Attempt(status, max(header.streams, 1), header.attempt)
            for old in [k for k in self._open if k[0] == header.fragment and k[1] < c.round - 1]:
                del self._open[old]
            for old in [k for k in self._shares_ended if k[0] == header.fragment and k[1] < c.round - 1]:
                del self._shares_ended[old]
        return entry

    def add_chunks(self, header: pb.PayloadHeader, chunks: list) -> None:
        """Hands `chunks` ((index, data) of the attempt `header` opened) to the coordinator, holding `lock`;
        nothing of an attempt a retry replaced. Raises the coordinator's ContributionError."""
        entry = self._open.get(_key(header))
        if entry is None or entry.attempt != header.attempt:  # a retry replaced this attempt
            return
        c = self.fragment(header)
        for index, data in chunks:
            c.add_chunk(header.round, header.island, index, data)
            if header.parts > 1:
                entry.chunks.add(index)

    def end(self, header: pb.PayloadHeader, entry: Attempt, frame_bytes: int, streams: int = 1,
            payload_bytes: int = 0) -> str:
        """Ends `streams` of the attempt's streams, which carried `frame_bytes` (`payload_bytes` of chunks), holding
        `lock`; the last one closes the contribution (once every share's did). Returns "accepted", "discarded" or
        "duplicate", and books the bytes as received from the island.

        Raises:
          ContributionError: chunks are missing, the contribution was refused, or a retry replaced the attempt.
        """
        status = self._end(header, entry, streams)
        if header.island in self.wire_bytes:
            self.wire_bytes[header.island]["received"] += frame_bytes
            self.payload_received[header.island] += payload_bytes
        return status

    def _end(self, header: pb.PayloadHeader, entry: Attempt, streams: int) -> str:
        entry.ended += streams
        if entry.status != "accepted" or entry.ended < entry.streams:
            return entry.status
        if self._open.get(_key(header)) is not entry:
            raise ContributionError(f"island {header.island!r}'s contribution to round {header.round} was sent "
                                    "again while this attempt was still open; the retry counts")
        c = self.fragment(header)
        if header.parts > 1:
            missing = sorted({k.index for k in share(c.plan, header)} - entry.chunks)
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
        return c.end_contribution(header.round, header.island)

    def abandon(self, header: pb.PayloadHeader, reason: str, keep_complete: bool = True) -> None:
        """Forgets the attempt `header` opened (a stream failed), holding `lock`, unless a retry replaced it
        already. With `keep_complete` (a dropped connection), a contribution whose every chunk arrived intact is
        kept (of an island of several processes, the other shares' chunks are kept too); an attempt refused for
        what it sent keeps nothing."""
        key = _key(header)
        entry = self._open.get(key)
        if entry is None or entry.attempt != header.attempt:
            return
        del self._open[key]
        self._forget_share(header, entry, reason, keep_complete)

    def contribute(self, header: pb.PayloadHeader, payload: bytes, frame_bytes: int) -> str:
        """One whole attempt, holding `lock`: `begin`, every chunk of its share in plan order, the end of all
        its streams (`frame_bytes` in all); an attempt that fails is abandoned as `end`'s caller would.
        Returns what `end` returns; raises what `begin` and `end` raise."""
        entry = self.begin(header)
        try:
            if entry.status == "accepted":
                view = memoryview(payload)
                self.add_chunks(header, [(k.index, view[k.offset : k.offset + k.nbytes])
                                         for k in share(self.fragment(header).plan, header)])
            return self.end(header, entry, frame_bytes, streams=entry.streams,
                            payload_bytes=sum(k.nbytes for k in share(self.fragment(header).plan, header)))
        except ContributionError as e:
            self.abandon(header, str(e), keep_complete=False)
            raise

    # -- updates -----------------------------------------------------------------------------------------

    def update_trailer(self, fragment: int, round: int, island: str, part: int = 0, parts: int = 0,
                       bitmap: bytes = b"") -> pb.PayloadHeader:
        """The trailer of `round`'s update of `fragment` (merged) for `island`, holding `lock`: its size, the
        CRC-32C of its chunk CRCs, the island's planned inner steps; of share `part` of `parts`, the share's."""
        c = self.coordinator.fragments[fragment]
        _, chunks, _ = c.update_chunks(round, island)
        if parts > 1 or bitmap:  # a share (of a process, or of a coordinator shard's range): its own bytes and CRC
            indices = [k.index for k in wire.share_of(c.plan, part, parts, bitmap)]
            total = sum(len(chunks[k]) for k in indices)
            crc = wire.fold_crc32(wire.crc32(chunks[k]) for k in indices)
        else:
            known = self._update_crc.get(fragment)
            if known is None or known[0] != round:
                known = (round, wire.fold_crc32(wire.crc32(chunks[k]) for k in range(len(chunks))))
                self._update_crc[fragment] = known
            total, crc = sum(len(x) for x in chunks.values()), known[1]
        return pb.PayloadHeader(
            round=round, island=island, layout=self.layouts[fragment],
            inner_steps=self.coordinator.planned_inner_steps(island) or 0,
            total_bytes=total, crc32=crc, fragment=fragment, part=part, parts=parts,
        )

    def fetched_stream(self, fragment: int, round: int, island: str, frame_bytes: int, part: int = 0,
                       parts: int = 0, connection: int = 0, connections: int = 1) -> None:
        """Books one update stream's `frame_bytes` as sent to `island`; the island has the update once every
        stream of every share ended."""
        with self.lock:
            if island in self.wire_bytes:
                self.wire_bytes[island]["sent"] += frame_bytes
            # per share (one of an island of one process): its streams' count, and those that ended
            done = self._streams_done.setdefault((fragment, round, island), {})
            done.setdefault(part, (connections, set()))[1].add(connection)
            if len(done) == max(parts, 1) and all(len(ended) == n for n, ended in done.values()):
                self.fetched.setdefault((fragment, round), set()).add(island)
            self.notify()

    def fetched_by(self, fragment: int, round: int) -> set[str]:
        """The islands that received the whole update of `round` of `fragment`."""
        with self.lock:
            return set(self.fetched.get((fragment, round), ()))

    def wait_until_fetched(self, round: int, islands=None, timeout: float | None = None) -> bool:
        """Blocks until `islands` (default: all) have received the whole update of `round` of every fragment;
        False on timeout (seconds).

        Raises:
          RunAborted: the session was aborted meanwhile.
        """
        c = self.coordinator
        islands = set(c.islands if islands is None else islands)
        keys = [(f, round) for f in range(len(c.fragments))]
        with self.lock:
            done = self.lock.wait_for(
                lambda: self.aborted is not None or all(self.fetched.get(k, set()) >= islands for k in keys), timeout
            )
            self.check()
            return done
