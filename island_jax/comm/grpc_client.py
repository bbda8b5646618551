"""The island's side of the gRPC exchange: the `Transport` calls over parallel channels.

`GrpcTransport` implements join / contribute / fetch_update like the in-process transport, so `Island` code
does not change. It opens `comm.connections` channels to the coordinator, each its own TCP connection (gRPC
would otherwise multiplex every stream over one, and one TCP connection over a long path carries at most
window / RTT), and sends chunk k of a payload on connection k % connections (`streams`). With
`comm.pipeline`, the update streams open before the contribution is sent, so update chunks flow back while
later contribution chunks are still on the way. Status codes become the coordinator's exceptions, and a lost
connection is retried (`reconnect`). `stats(round, fragment)` describes one exchange (see `SyncStats`),
`last_stats` the last one finished. Exchanges of different fragments may run at once, each on threads of its
own (Streaming DiLoCo overlap, island_jax/island/outer_loop.py).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent import futures

import grpc

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import security, wire
from island_jax.comm.link import LinkEmulator
from island_jax.comm.options import KEEPALIVE_SECONDS, SERVICE_NAME, client_options
from island_jax.comm.reconnect import Reconnecting, status_error
from island_jax.comm.session import log_barrier_wait
from island_jax.comm.streams import Fetch, Upload, done, plan_of
from island_jax.config import RECONNECT_BACKOFF_CAP_SECONDS
from island_jax.outer import codec
from island_jax.protocol import ContributionHeader, ExchangeError, SyncStats


def _raw(data: bytes) -> bytes:
    return data


class GrpcTransport(Reconnecting):
    """The island's connections to the coordinator at `address` ("HOST:PORT").

    Args:
      address: the coordinator's HOST:PORT.
      chunk_bytes: `comm.chunk_bytes` (the coordinator sends the chunk plan at join).
      join_timeout: seconds to wait for the coordinator at join (it may still be starting).
      round_timeout: seconds to wait for a round's update.
      connections: `comm.connections`, gRPC channels (TCP connections) in parallel.
      pipeline: `comm.pipeline`; open the update streams before contributing.
      link: an emulated WAN link for this island (None: the real network only).
      clock: seconds, monotonic; the link emulator's clock.
      reconnect_seconds: how long a call that lost the coordinator keeps retrying (`comm.reconnect_seconds`).
      finished: called before each retry; True stops retrying at once (the run finished without this island).
      tls: `comm.tls`: with a ca_file, the channels are TLS, verifying the coordinator's certificate against
        it (for `server_name` when set), with the island's client certificate when given (mutual TLS).
      token: the island's bearer token (`security.read_token`), sent with the island's name on every call.
      part, parts: this process's index and the island's process count. Of an island of several processes,
        each process sends and receives only its share of every payload's chunks over its own connections;
        process 0 alone joins the coordinator for the island (the others ask who it is).
      shares: of an island of several processes, per fragment the indices of the chunks this process owns
        (`island.shards.Ownership`); None: the plan dealt out by bytes (`codec.deal`).
      keepalive_seconds: seconds between keepalive pings on each idle channel (`comm.keepalive_seconds`).
      backoff_cap_seconds: the longest pause between reconnect attempts (`comm.reconnect_backoff_cap_seconds`).
      shard: (k, K): the coordinator at `address` is shard k of K (`coordinator.shards`); this process sends and
        fetches only the chunks of its range (`codec.chunk_ranges`), named by a share bitmap. None: one process.

    Raises:
      SecurityError: unreadable TLS files.
      ValueError: `keepalive_seconds` is not a positive number.
    """

    def __init__(
        self,
        address: str,
        chunk_bytes: int,
        join_timeout: float = 300.0,
        round_timeout: float = 3600.0,
        connections: int = 1,
        pipeline: bool = True,
        link: LinkEmulator | None = None,
        clock=time.monotonic,
        reconnect_seconds: float = 300.0,
        finished=None,
        tls=None,
        token: str | None = None,
        part: int = 0,
        parts: int = 1,
        shares: list[list[int]] | None = None,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        backoff_cap_seconds: float = RECONNECT_BACKOFF_CAP_SECONDS,
        shard: tuple[int, int] | None = None,
    ):
        self.shard = shard
        self.address, self.chunk_bytes = address, chunk_bytes
        self.part, self.parts = part, parts
        self._share_indices = shares
        self.reconnect_seconds, self.finished = reconnect_seconds, finished
        self.backoff_cap_seconds = backoff_cap_seconds
        self.incarnation = ""  # the coordinator's, from the last join
        self._joining = ""  # the island's name, from its first join
        self._who: tuple[str, str] | None = None  # (island, fingerprint JSON) of the last join
        self.join_timeout, self.round_timeout = join_timeout, round_timeout
        self.connections, self.pipelined, self.link = connections, pipeline, link
        self.clock = link.clock if link is not None else clock
        options = [*client_options(chunk_bytes, keepalive_seconds), ("grpc.use_local_subchannel_pool", 1)]
        if token and not (tls is not None and tls.ca_file) and not security.is_loopback(address):
            raise security.SecurityError(
                f"island would send its token to {address} in the clear: set comm.tls.ca_file to the CA that signed "
                "the coordinator's certificate (docs/security.md)"
            )
        if tls is not None and tls.ca_file:
            credentials = security.channel_credentials(tls.ca_file, tls.client_cert_file, tls.client_key_file)
            options += security.target_name_options(tls.server_name)
            self.channels = [grpc.secure_channel(address, credentials, options=options) for _ in range(connections)]
        else:
            self.channels = [grpc.insecure_channel(address, options=options) for _ in range(connections)]
        if token:  # every call carries the island's token and name (`security.AuthInterceptor` checks them)
            stamp = security.CallMetadata(lambda: security.call_metadata(self._island(), token))
            self.channels = [grpc.intercept_channel(ch, stamp) for ch in self.channels]
        self._join = [ch.unary_unary(f"/{SERVICE_NAME}/Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString) for ch in self.channels]
        self._contribute = [
            ch.stream_unary(f"/{SERVICE_NAME}/Contribute", _raw, pb.ContributeReply.FromString) for ch in self.channels
        ]
        self._fetch_update = [
            ch.unary_stream(f"/{SERVICE_NAME}/FetchUpdate", pb.FetchRequest.SerializeToString, _raw) for ch in self.channels
        ]
        self._fetch_view = self.channels[0].unary_stream(f"/{SERVICE_NAME}/FetchView", pb.FetchRequest.SerializeToString, _raw)
        # Threads start as needed; enough for a few fragments' exchanges at once.
        self.pool = futures.ThreadPoolExecutor(max_workers=8 * connections + 2, thread_name_prefix="exchange")
        self.payload_bytes: int | None = None
        self.view_bytes: int | None = None
        self.layouts: list[str] = []  # per fragment
        self.plans: list[list[codec.Chunk]] = []  # per fragment
        self.update_plans: list[list[codec.Chunk]] = []  # per fragment: the same chunks in the update's bytes
        self.shares: list[list[codec.Chunk]] = []  # per fragment: this process's chunks (all of them with one)
        self.share_bitmaps: list[bytes] = []  # per fragment: `shares` as `wire.share_bitmap` (several processes)
        self.view_plan: list[codec.Chunk] = []
        self.last_stats = SyncStats()
        self._stats: dict[tuple[int, int], SyncStats] = {}  # (fragment, round) -> its exchange
        self._planned: dict[str, int] = {}
        self._fetches: dict[tuple[int, int, str], Fetch] = {}
        self._send_spans: dict[tuple[int, int], tuple[float, float]] = {}

    def stats(self, round: int, fragment: int = 0) -> SyncStats:
        """The exchange of `round` of `fragment` (after its `fetch_update` returned; empty before)."""
        return self._stats.get((fragment, round), SyncStats())

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Handshake on every connection; waits up to `join_timeout` seconds for the coordinator to come up.

        Raises:
          HandshakeError: the coordinator refused (its message names what differs).
          ExchangeError: the coordinator did not answer.
        """
        request = pb.JoinRequest(
            island=island, fingerprint_json=json.dumps(config_fingerprint), params_checksum=params_checksum, round=round
        )
        self._joining = island
        # The join itself on the first connection; the others only open (a Join with `reconnect` is answered
        # without admitting anything). Of an island of several processes, only process 0 joins.
        probe = pb.JoinRequest(island=island, fingerprint_json=request.fingerprint_json, reconnect=True)
        if self.part > 0:
            request = probe
        deadline, lost = self.clock() + self.join_timeout, 0
        while True:  # in slices, so that a run that finished meanwhile is noticed
            try:
                reply = self._join[0](request, timeout=min(10.0, max(deadline - self.clock(), 0.1)), wait_for_ready=True)
                for join in self._join[1:]:
                    join(probe, timeout=self.join_timeout, wait_for_ready=True)
                break
            except grpc.RpcError as e:
                waiting = e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                if not waiting or self.clock() >= deadline:
                    raise status_error(e, "join", self.address) from None
                if self.finished is not None and self.finished():
                    raise ExchangeError("join: the coordinator finished the run") from None
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # lost in flight (the coordinator died): again
                    lost = self._lost(island, "join", e, lost)
                else:
                    self._why_not(island, probe)
        self.incarnation, self._who = reply.incarnation, (island, request.fingerprint_json)
        for fetch in self._fetches.values():  # opened for the coordinator before (a restart): void
            fetch.cancel()
        self._fetches.clear()
        self.payload_bytes, self.view_bytes = reply.payload_bytes, reply.view_bytes
        self.layouts = [f.layout for f in reply.fragments]
        self.plans = [plan_of(list(f.chunk_offsets), f.payload_bytes) for f in reply.fragments]
        self.update_plans = [
            plan_of(list(f.update_chunk_offsets), f.update_payload_bytes) if f.update_chunk_offsets else plan
            for f, plan in zip(reply.fragments, self.plans)
        ]
        self.shares, self.share_bitmaps = self._shares_of(self.plans)
        self.view_plan = plan_of(list(reply.view_chunk_offsets), reply.view_bytes)
        out = dict(round=reply.round, checksum=reply.params_checksum, rejoin=reply.rejoin)
        if reply.kept_json:  # what a rejoining island may replay
            out["kept"] = json.loads(reply.kept_json)
        return out

    def replaying(self, island: str, round: int) -> None:
        """Tells the coordinator the island is replaying `round` (0-based): it is alive, and the round waiting
        for it is not stalled. A sign of life, not a call the replay waits on: a coordinator that does not answer
        is logged and left (the replay's fetches retry on their own)."""
        request = pb.JoinRequest(island=island, fingerprint_json=self._who[1] if self._who else "{}", round=round,
                                 replaying=True)
        try:
            self._join[0](request, timeout=10.0)
        except grpc.RpcError as e:
            logging.warning("island %s: the coordinator at %s did not take its replay progress (%s)", island,
                            self.address, e.code().name)

    def _shares_of(self, plans: list[list[codec.Chunk]]) -> tuple[list[list[codec.Chunk]], list[bytes]]:
        """This process's chunks of each fragment's plan, and their bitmaps (empty with one process).

        Raises:
          ExchangeError: the island's shares do not fit the coordinator's plans (another model, codec or
            comm.chunk_bytes).
        """
        shards = wire.owned_ranges(plans, self.shard)
        if self.parts <= 1 and shards is None:
            return plans, [b""] * len(plans)
        if self.parts <= 1:
            shares = [[plan[i] for i in owned] for plan, owned in zip(plans, shards)]
            return shares, [wire.share_bitmap(s, plan) for s, plan in zip(shares, plans)]
        if self._share_indices is None and shards is None:
            shares = [codec.deal(plan, self.parts)[self.part] for plan in plans]
            return shares, [b""] * len(plans)
        if self._share_indices is None:
            shares = [[c for c in codec.deal(plan, self.parts)[self.part] if c.index in owned]
                      for plan, owned in zip(plans, shards)]
            return shares, [wire.share_bitmap(s, plan) for s, plan in zip(shares, plans)]
        if len(self._share_indices) != len(plans) or any(
            i < 0 or i >= len(plan) for plan, share in zip(plans, self._share_indices) for i in share
        ):
            raise ExchangeError(
                f"process {self.part}'s chunks ({[len(s) for s in self._share_indices]} per fragment) do not fit the "
                f"coordinator's plan ({[len(p) for p in plans]} chunks per fragment); the island's model, codec or "
                "comm.chunk_bytes differs from the coordinator's"
            )
        shares = [[plan[i] for i in share] for plan, share in zip(plans, self._share_indices)]
        if shards is not None:
            shares = [[c for c in share if c.index in owned] for share, owned in zip(shares, shards)]
        return shares, [wire.share_bitmap(share, plan) for share, plan in zip(shares, plans)]

    def _why_not(self, island: str, probe: pb.JoinRequest) -> None:
        """Logs why the coordinator does not answer yet (not started, or a TLS handshake that fails: a CA, a
        server name or a client certificate that does not match), from one call that does not wait."""
        try:
            self._join[0](probe, timeout=5.0)
        except grpc.RpcError as e:
            logging.warning("island %s: the coordinator at %s does not answer yet (%s: %s); still trying",
                            island, self.address, e.code().name, e.details())


    def start_together(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> None:
        """Says the island is ready to train and waits (up to `join_timeout` seconds) until every island
        of the run has said so, so that all start their first round at the same moment.

        Raises:
          HandshakeError: the coordinator refused the join (see `join`).
          ExchangeError: the coordinator did not answer.
        """
        request = pb.JoinRequest(
            island=island, fingerprint_json=json.dumps(config_fingerprint), params_checksum=params_checksum,
            round=round, ready=True,
        )
        began, lost = time.monotonic(), 0
        while True:
            try:
                self._join[0](request, timeout=max(self.join_timeout - (time.monotonic() - began), 0.1),
                              wait_for_ready=True)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < self.join_timeout:
                    lost = self._lost(island, "ready", e, lost)  # lost in flight (the coordinator died): again
                    continue
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise status_error(e, "join", self.address) from None
                logging.warning("island %s: not every island was ready within %.0f s; starting anyway (the "
                                "coordinator's log names the islands it waited for)", island, self.join_timeout)
                return
        log_barrier_wait(island, None, time.monotonic() - began, self.join_timeout)

    def _lost(self, island: str, what: str, e: grpc.RpcError, attempt: int) -> int:
        """Waits out the reconnect backoff (0.5 s doubling up to `backoff_cap_seconds`) after call `what` was lost
        in flight, logged; returns the next attempt's number."""
        delay = min(0.5 * 2**attempt, self.backoff_cap_seconds)
        logging.warning("island %s: its %s to the coordinator at %s was lost (%s); again in %.1f s (up to "
                        "comm.join_timeout_seconds=%g)", island, what, self.address, e.details(), delay,
                        self.join_timeout)
        time.sleep(delay)
        return attempt + 1

    def contribute(self, header: ContributionHeader, payload) -> str:
        """Streams one encoded pseudo-gradient over every connection; returns "accepted" or "discarded".

        `payload` is bytes, or a `codec.ChunkEncoder` over the fragment's chunk plan,
        whose chunks are then encoded by the threads that send them. `header.fragment`
        names the fragment whose leaves it encodes (0 with one fragment).

        Raises:
          ContributionError: the coordinator refused it (round, NaN, checksum...).
          ExchangeError: transfer failed, or a stream's byte count or CRC-32C
            differs from what was sent.
        """
        round, island, fragment = header.round, header.island, header.fragment
        if not 0 <= fragment < len(self.plans):
            raise ExchangeError(f"contribute: fragment {fragment} of {len(self.plans)}; join first, with the run's config")
        start, cache, sent = self.clock(), {}, 0
        n = self._streams(fragment)

        def attempt(incarnation: str):
            nonlocal sent
            if self.pipelined:
                old = self._fetches.pop((fragment, round, island), None)
                if old is not None:  # opened for an attempt that failed
                    old.cancel()
                self._fetches[(fragment, round, island)] = self._open_fetch(round, island, fragment, incarnation)
            total = sum(c.nbytes for c in self.plans[fragment])
            fields = wire.payload_header(header, self.layouts[fragment], n, total, wire.new_attempt(), incarnation,
                                         self.part, self.parts, self.share_bitmaps[fragment])
            upload = Upload(self, self.shares[fragment], n, wire.header_frame(fields), payload, self.clock(), cache)
            sent += upload.bytes_sent
            calls = [self._contribute[i].future(upload.frames(i), timeout=self.round_timeout) for i in range(n)]
            try:
                replies = [c.result() for c in calls]
            except BaseException:
                for c in calls:  # the other streams of a failed attempt end before the next one starts
                    c.cancel()
                futures.wait([done(c) for c in calls], timeout=30)
                raise
            upload.check(replies)
            return upload, replies

        upload, replies = self._retrying(f"contribute round {round + 1}", attempt)
        upload.bytes_sent = sent
        self._sent(fragment, round, start, upload)
        discarded = any(r.discarded for r in replies)
        if discarded:
            logging.warning(
                "island %s's contribution to round %d came after the round closed and was discarded; "
                "fetching that round's update", island, round,
            )
        return "discarded" if discarded else "accepted"

    def _sent(self, fragment: int, round: int, start: float, upload: Upload) -> None:
        """Books a finished contribution's send span and frame bytes; keeps the last few rounds' stats."""
        self._send_spans[(fragment, round)] = (start, max(upload.last_frame_out))
        self._stats[(fragment, round)] = SyncStats(bytes_sent=upload.bytes_sent)
        for key in [k for k in self._stats if k[0] == fragment and k[1] < round - 1]:
            self._stats.pop(key, None)
            self._send_spans.pop(key, None)

    def _streams(self, fragment: int = 0) -> int:
        """Connections this process's share of a payload of `fragment` uses: one per chunk, up to `connections`."""
        return wire.stream_count(self.connections, self.shares[fragment])

    def _open_fetch(self, round: int, island: str, fragment: int = 0, incarnation: str | None = None) -> Fetch:
        methods = self._fetch_update[: self._streams(fragment)]
        update_plan = self.update_plans[fragment]
        return Fetch(self, round, island, "fetch_update", update_plan, methods, fragment,
                      incarnation=self.incarnation if incarnation is None else incarnation,
                      share=[update_plan[c.index] for c in self.shares[fragment]], part=self.part, parts=self.parts,
                      bitmap=self.share_bitmaps[fragment])

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """The round's update bytes; waits up to `round_timeout` seconds for the merge. Of an island of several
        processes, the payload holds this process's share of the chunks (the others are zero bytes).

        Raises:
          ExchangeError: late, unreachable, or a corrupt stream (CRC-32C).
          StaleRoundError: the round is older than the coordinator's latest (use `fetch_view`).
        """
        opened = self._fetches.pop((fragment, round, island), None)

        def attempt(incarnation: str):
            nonlocal opened
            fetch, opened = opened or self._open_fetch(round, island, fragment, incarnation), None
            try:
                return fetch, *fetch.result()
            except BaseException:
                fetch.cancel()
                raise

        fetch, header, payload = self._retrying(f"fetch the update of round {round + 1}", attempt)
        if header.inner_steps:
            self._planned[island] = header.inner_steps
        end = self.clock()
        send_start, send_end = self._send_spans.get((fragment, round), (end, end))
        receive_start = fetch.first_receipt if fetch.first_receipt is not None else end
        receiving = max(0.0, end - receive_start)
        sending = max(0.0, send_end - send_start)
        overlapped = max(0.0, min(send_end, end) - max(send_start, receive_start))
        stats = self._stats.setdefault((fragment, round), SyncStats())
        stats.bytes_received = fetch.assembler.wire_bytes
        stats.seconds_sending, stats.seconds_overlapped = sending, overlapped
        stats.seconds_transferring = sending + receiving - overlapped
        self.last_stats = stats
        return payload

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round as last planned by the coordinator (None: no plan)."""
        return self._planned.get(island)

    def fetch_view(self, island: str, min_round: int = 0, needed=None) -> tuple[list[int], bytes]:
        """(each fragment's round, the island view as a float32 payload) for an island that rejoins or fell
        behind, once every fragment completed `min_round` rounds (waiting up to `round_timeout` seconds).
        `needed`: of an island of several processes, the chunks of the view's plan this process holds elements
        of (a function of the plan); the others are left zero and never travel.

        Raises:
          ExchangeError: unreachable, late, or a corrupt stream (CRC-32C), after the retries.
          CoordinatorRestarted: the coordinator restarted meanwhile.
        """

        def attempt(incarnation: str):
            del incarnation  # a view is the same whoever serves it
            share = needed(self.view_plan) if needed is not None and self.parts > 1 else None
            bitmap = wire.share_bitmap(share, self.view_plan) if share is not None else b""
            fetch = Fetch(self, 0, island, "fetch_view", self.view_plan, [self._fetch_view], min_round=min_round,
                           share=share, part=self.part, parts=self.parts if share is not None else 1, bitmap=bitmap)
            return fetch.result()

        header, payload = self._retrying("fetch the island view", attempt)
        return list(header.fragment_rounds) or [header.round], payload

    def close(self) -> None:
        for fetch in self._fetches.values():
            fetch.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for ch in self.channels:
            ch.close()
