"""The coordinator of one fragment (`FragmentCoordinator`): its rounds, chunk by chunk.

It knows no transport: the in-process transport and the gRPC service call these plain methods, through the
run's `Coordinator`, which holds one per fragment (Streaming DiLoCo, arXiv 2501.18512; one fragment
is plain DiLoCo, arXiv 2311.08105). Per round: collect one contribution per island as its chunks arrive
(`contribution.py`), refuse non-finite values, close the round by the `Quorum` (`quorum.py`), merge chunk by
chunk (`partial_merge.py`: weighted mean, outer step, `master - view` encoded once), and serve the same
update bytes to every island.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np

from island_jax.config import fingerprint_fields
from island_jax.coordinator import expert_merge, handshake
from island_jax.coordinator.contribution import Contribution
from island_jax.coordinator.partial_merge import PartialMerge, RoundRecord
from island_jax.coordinator.quorum import Quorum, RoundState
from island_jax.coordinator.replay import KeptUpdates
from island_jax.coordinator.shards import Shard
from island_jax.coordinator.state import FragmentState
from island_jax.model.init import combine_parts
from island_jax.model.transformer import routing_shape
from island_jax.outer.inner_steps import plan_from_step_times
from island_jax.protocol import ContributionError, ContributionHeader, StaleRoundError, UpdateNotReady, chunk_digest


class FragmentCoordinator:
    """The coordinator of one fragment (the whole model with `outer.fragments = 1`): its rounds, chunk by chunk.

    Args: `config`, `islands` and `clock` as for `Coordinator`; `params`
    the fragment's initial parameters (float32 or bfloat16 NumPy arrays); `expert_layers` per leaf of `params`
    the MoE layer whose routed experts it holds, or None (`expert_merge.expert_leaves`; None: no leaf does);
    `router_layers` likewise of the routers (`expert_merge.router_leaves`).

    A contribution arrives as chunks: `begin_contribution`, `add_chunk` per
    chunk in any order, `end_contribution` (`contribute` does all three for a
    whole payload). With `comm.pipeline`, chunk k is merged as soon as every
    expected island's chunk k is in and `update_chunks` serves it while later
    chunks still arrive; otherwise the round is merged once every contribution
    is complete; both give the same bytes. If an island drops out after chunks
    that included it were merged (a refused chunk, a closed quorum), the merge
    restarts from the first chunk without it (`generation` counts restarts).
    """

    def __init__(
        self, config: ml_collections.ConfigDict, params: Any, islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic, shard: Shard | None = None, index: int = 0,
        expert_layers: Sequence[int | None] | None = None, router_layers: Sequence[int | None] | None = None,
    ):
        self.config = config
        self.shard, self.index = shard, index  # of a coordinator of several shards: this one, and the fragment
        self.islands = list(islands)
        self.fingerprint_fields = fingerprint_fields(config)
        # a shard merges a round only once the leader's set is known (`poll`), so not chunk by chunk as they come
        self.pipeline = bool(config.comm.pipeline) and shard is None
        self.weighting = config.outer.weighting
        self.expert_weighting = config.outer.get("expert_weighting", "same")
        self._state = FragmentState(  # the experts' weight slots only where they are used
            config, params, owner=shard, router_layers=router_layers,
            expert_layers=expert_layers if self.expert_weighting == "tokens_routed" else None)
        self.codec, self.update_codec = self._state.codec, self._state.update_codec
        # one plan both ways, each in its own codec's bytes (`codec.chunk_plan`'s `other`)
        self.plan, self.payload_bytes = self._state.plan, self._state.payload_bytes
        self.owned = self._state.owned  # the chunks whose rows this holds (all of them, but of a shard)
        self.num_chunks = len(self.owned)
        self.update_plan, self.update_bytes = self._state.update_plan, self._state.update_bytes
        self.quorum = Quorum(config.outer.min_islands or len(self.islands), config.outer.grace_seconds, clock)
        self.joined: set[str] = set()
        self.round = 0
        self.generation = 0  # restarts of a round's merge, counted over the run
        self.step_seconds: dict[str, float] = {}  # median step time each island reported in round 0
        self.plan_steps: dict[str, int] = {}  # inner steps per island from round 1 on (outer.auto_from = measured)
        self.history: list[RoundRecord] = []
        self._updates: dict[int, dict[int, bytes]] = {}  # the latest merged round's update, chunk by chunk
        self._checksums: dict[int, str] = {}  # of a shard: the whole view's checksum after a round, combined
        self._clock = clock
        self._round = RoundState(started_at=clock())  # replaced whole after each merge and on a restore
        self.held_from: int | None = None  # updates of this round and later are not served yet (`hold_updates`)
        self.kept: KeptUpdates | None = None  # where merged updates and digests are kept for replays (`keep_updates`)
        self.replaying: set[str] = set()  # islands served kept updates of past rounds (shared by the fragments)
        self.ends_replay = True  # a contribution to this fragment's current round ends an island's replay (the last)

    def warm_up(self) -> None:
        """Compiles the chunk program for a merge of every island now, so the first merge never waits for XLA."""
        self._state.warm_up(len(self.islands))

    # -- state -------------------------------------------------------------------------------------------

    @property
    def view(self) -> Any:
        """The island view: a pytree of NumPy arrays in the parameters' dtypes (see `FragmentState.view`)."""
        return self._state.view

    @property
    def shapes(self) -> Any:
        """The fragment's parameters as `jax.ShapeDtypeStruct`s (`FragmentState.shapes`)."""
        return self._state.shapes

    def view_leaves(self) -> list:
        """The island view's leaves, read in place from the rows (`FragmentState.view_leaves`)."""
        return self._state.view_leaves()

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the island view (16 hex digits), computed when first asked for after each round
        (of a shard: combined from every shard's part, `checksum_at`)."""
        return self._state.checksum if self.shard is None else self.checksum_at(self.round)

    def checksum_at(self, round: int) -> str:
        """Of a coordinator shard: the checksum of the whole fragment's view after `round` rounds, from every
        shard's `checksum_parts` (waits for them: `Shard.gather`)."""
        if round not in self._checksums:
            self._checksums = {r: c for r, c in self._checksums.items() if r >= round - 1}
            self._checksums[round] = combine_parts(self._state.shapes, self.shard.gather("parts", self.index, round))
        return self._checksums[round]

    def publish_view(self) -> None:
        """Of a coordinator shard: publishes its part of the view it holds now (at start and after a restore)."""
        self.shard.merged(self.index, self.round, self._state.checksum_parts(), None)

    @property
    def pending(self) -> dict[str, Contribution]:
        """The current round's open and complete contributions, by island."""
        return self._round.pending

    def state(self) -> dict:
        """What a checkpoint holds: `master` (float32), `opt_state` (per chunk), `view` and `round` (0-d int64)."""
        return dict(**self._state.state(), round=np.asarray(self.round, np.int64))

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands at other rounds rejoin (`Coordinator.join`)."""
        self._state.load_state(state)
        self.round = int(state["round"])
        self._updates = {}
        self._round = RoundState(started_at=self._clock())
        if self.kept is not None:  # merged again from here on
            self.kept.discard_from(self.index, self.round)

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Admits an island to this fragment's rounds at this fragment's round, from the same parameters;
        {"round", "checksum"} of this fragment's view. (A run's islands join through
        `Coordinator.join`, which also admits them at other rounds.)

        Raises:
          HandshakeError: as `handshake.check_island`, another round, or another checksum.
        """
        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint)
        handshake.check_round(island, round, self.round)
        handshake.check_params_checksum(island, params_checksum, self.checksum)
        self.joined.add(island)
        return dict(round=self.round, checksum=self.checksum)

    def needs(self, island: str) -> bool:
        """Whether the current round waits for `island`: its quorum is not reached and the island has not
        contributed (so an island that joins now is admitted to this round)."""
        current = self._round
        done = current.has_complete(island, self.num_chunks)
        return not done and not self.quorum.reached(current, self.islands, self.num_chunks)

    def took_view(self, island: str) -> None:
        """Notes that `island` took the island view while the current round runs: the quorum then gives it
        as long as the others had (`Quorum`)."""
        self.joined.add(island)
        self._round.joined_at[island] = self._clock()

    def stalled(self) -> tuple[float, list[str]]:
        """(seconds the round has waited since its first complete contribution with its quorum not reached,
        the islands it waits for); (0, []) when it is not stalled."""
        current = self._round
        if current.first_complete_at is None or self.quorum.reached(current, self.islands, self.num_chunks):
            return 0.0, []
        waiting = current.waiting_for(self.islands, self.num_chunks)
        # an island that rejoined (took the view) since is given the whole timeout from then
        since = max([current.first_complete_at, *(current.joined_at.get(n, 0.0) for n in waiting)])
        return self._clock() - since, waiting

    def hold_updates(self, round: int | None) -> None:
        """Holds back the updates of `round` and later (None: none) until called again: the coordinator serves
        no update two rounds past a checkpoint still being written."""
        self.held_from = round

    def _held(self, round: int) -> bool:
        return self.held_from is not None and round >= self.held_from

    # -- contributions -----------------------------------------------------------------------------------

    def contribute(self, header: ContributionHeader, payload: bytes) -> str:
        """One island's whole encoded pseudo-gradient (`payload_bytes` bytes): `begin_contribution`, every
        chunk's `add_chunk`, `end_contribution`. Arguments and errors as for `Coordinator.contribute`.

        Returns:
          "accepted" (also for a contribution already in: a retry is counted once), or "discarded" for a round
          that has already closed.

        Raises:
          ContributionError: not joined, a future round, tokens <= 0, wrong size, NaN/Inf.
        """
        round, island = header.round, header.island
        if len(payload) != self.payload_bytes and round >= self.round:
            raise ContributionError(
                f"island {island!r}, round {round}: payload is {len(payload)} bytes but a {self.codec} payload for "
                f"these parameters is {self.payload_bytes} bytes; the island uses a different model shape or codec "
                "(codec.kind, block_size, topk_group, topk_k)"
            )
        status = self.begin_contribution(header)
        if status != "accepted":
            return "accepted" if status == "duplicate" else status
        view = memoryview(payload)
        for chunk in (self.plan[k] for k in self.owned):
            self.add_chunk(round, island, chunk.index, view[chunk.offset : chunk.offset + chunk.nbytes])
        return self.end_contribution(round, island)

    def _has(self, round: int, island: str) -> bool:
        """Whether the island's whole contribution to `round` is in: complete and waiting, or merged."""
        if round == self.round:
            return self._round.has_complete(island, self.num_chunks)
        merged = [r for r in self.history if r.round == round]
        return bool(merged) and island in merged[-1].contributors

    def _closed_for(self, round: int, island: str) -> bool:
        """Whether `round` closed for `island`: merged already, or the quorum went on without it."""
        return round < self.round or (round == self.round and island in self._round.dropped)

    def begin_contribution(self, header: ContributionHeader) -> str:
        """Opens an island's contribution to `header.round`: "accepted", "discarded" (round closed), or
        "duplicate" (the island's whole contribution is in already: a retry, whose chunks are ignored).

        Raises:
          ContributionError: not joined, a future round, a duplicate, tokens <= 0, or a params_checksum
            that is not the view's.
        """
        round, island, tokens, params_checksum = header.round, header.island, header.tokens, header.params_checksum
        if island not in self.joined:
            raise ContributionError(f"island {island!r} contributed before joining; call join first")
        if self._has(round, island):
            logging.info("island %s's contribution to round %d came again (a retry); counted once", island, round)
            return "duplicate"
        if self._closed_for(round, island):
            logging.warning(
                "island %s's contribution to round %d arrived after the round closed (at %d); discarded",
                island, round, self.round,
            )
            return "discarded"
        if round != self.round:
            raise ContributionError(
                f"island {island!r} sent round {round} but the coordinator is at round {self.round}"
            )
        self._round.check_new(round, island, tokens)
        if params_checksum is not None and params_checksum != self.checksum:
            raise ContributionError(
                f"island {island!r} trained round {round} from parameters with checksum {params_checksum}, not the "
                f"global {self.checksum}; its contribution was refused (restart the island from the workdir)"
            )
        routed = self.routed_counts_of(island, round, tokens, header.routed_counts, header.unrouted_tokens)
        probe = self.routing_probe_of(island, round, header.routing_probe)
        post_sync = header.post_sync_loss_change
        self._round.pending[island] = Contribution(
            island, int(tokens), tau=header.overlap_steps, routed=routed, unrouted=int(header.unrouted_tokens or 0),
            probe=probe,
            post_sync=None if post_sync is None or not np.isfinite(post_sync) else float(post_sync))
        if self.ends_replay:  # its last fragment's current round: whatever it replayed is behind it
            self.replaying.discard(island)
        if header.step_seconds and round == 0:
            self.step_seconds[island] = float(header.step_seconds)
        return "accepted"

    def routed_counts_of(self, island: str, round: int, tokens: int, counts, unrouted: int = 0) -> np.ndarray | None:
        """A contribution's routed counts (`ContributionHeader.routed_counts`, [MoE layers, experts] or the wire's
        row-major list), checked against the model and the contribution's tokens less its `unrouted` ones
        (`expert_merge.check_routed_counts`): int64 [L, E], or None for none sent (an empty list).

        Raises:
          ContributionError: counts of the wrong shape, not integers, negative, or a layer whose counts do not sum
            to (tokens - unrouted) x `moe.num_experts_per_token`; the message names the island and round (over the wire:
            INVALID_ARGUMENT, `ExchangeSession.check_header`).
        """
        if counts is None or np.size(counts) == 0:
            return None
        layers, experts, top_k = routing_shape(self.config)
        try:
            if layers == 0:
                raise ValueError("the model has no MoE layer; send no routed counts")
            array = np.asarray(counts)
            if array.ndim == 1 and array.size == layers * experts:  # the wire's row-major list
                array = array.reshape(layers, experts)
            return expert_merge.check_routed_counts(array, layers, experts, int(tokens), top_k, int(unrouted or 0))
        except ValueError as e:
            raise ContributionError(f"island {island!r}, round {round}, fragment {self.index}: {e}; refused") from None

    def routing_probe_of(self, island: str, round: int, data) -> np.ndarray | None:
        """A contribution's top-k choices on the routing probe (`ContributionHeader.routing_probe`: an array, or
        the wire's bytes), checked against the model: int64 [MoE layers, tokens, k] for up to
        `metrics.routing_probe_tokens` tokens (fewer where the held-out set is smaller), or None for none sent.

        Raises:
          ContributionError: a size that is not [MoE layers, tokens, k] of one byte each (two past 256 experts)
            for 1..`metrics.routing_probe_tokens` tokens, or an expert index past the model's; the message names
            the island and round.
        """
        if data is None or len(data) == 0:
            return None
        layers, experts, k = routing_shape(self.config)
        dtype = np.dtype(np.uint8 if experts <= 256 else "<u2")
        tokens = self.config.metrics.get("routing_probe_tokens", 0)
        array = np.frombuffer(data, dtype) if isinstance(data, bytes) else np.asarray(data)
        per_token = layers * k
        if (not per_token or array.size % per_token or not 0 < array.size // per_token <= tokens
                or (isinstance(data, bytes) and len(data) % dtype.itemsize)):
            raise ContributionError(
                f"island {island!r}, round {round}, fragment {self.index}: the routing probe holds {array.size} "
                f"expert indices; send {layers} MoE layers x at most {tokens} tokens (metrics.routing_probe_tokens) "
                f"x k {k}, {dtype.itemsize} byte(s) each; refused")
        array = array.reshape(layers, -1, k).astype(np.int64)
        if array.size and (array.min() < 0 or array.max() >= experts):
            raise ContributionError(
                f"island {island!r}, round {round}, fragment {self.index}: the routing probe names expert "
                f"{int(array.max())}; the model has {experts}; refused")
        return array

    def add_chunk(self, round: int, island: str, index: int, data) -> None:
        """Takes chunk `index` of an open contribution (bytes or memoryview of `plan[index].nbytes`).

        Chunks of a round that has closed, or of an island the quorum went on without, are ignored.
        With `comm.pipeline`, merges every chunk that is now ready.

        Raises:
          ContributionError: no open contribution, an unknown or repeated chunk,
            a chunk of the wrong size, or NaN/Inf in its values (the island's
            whole contribution is refused and the round goes on without it).
        """
        if self._closed_for(round, island):
            return
        contribution = self._round.pending.get(island)
        if round != self.round or contribution is None:
            raise ContributionError(f"island {island!r} sent a chunk of round {round} without an open contribution")
        contribution.check_chunk(round, index, len(data), self.plan)
        if index not in self.owned:
            raise ContributionError(
                f"island {island!r}, round {round}: chunk {index} belongs to another coordinator shard (this one owns "
                f"chunks {self.owned.start}..{self.owned.stop - 1}); the island's coordinator.shards differs")
        values, scales = self._state.decode(index, data)
        if not self._state.finite(values, scales):
            self._refuse(island, f"round {round}'s pseudo-gradient holds NaN or Inf")
            raise ContributionError(
                f"island {island!r}, round {round}: the pseudo-gradient holds NaN or Inf; the island diverged "
                "(lower inner.learning_rate or check its data) and its contribution was refused"
            )
        contribution.chunks[index] = (values, scales)
        if self.kept is not None:
            contribution.digests[index] = chunk_digest(data)
        if self.pipeline:
            self._merge_ready()

    def end_contribution(self, round: int, island: str) -> str:
        """Closes an island's contribution once all its chunks are in; "accepted" or "discarded".

        Raises:
          ContributionError: chunks are missing, or the contribution was refused.
        """
        if round < self.round:  # merged already (with its last chunk), or closed without it
            merged = [r for r in self.history if r.round == round]
            return "accepted" if merged and island in merged[-1].contributors else "discarded"
        if island in self._round.dropped:
            return "discarded"
        contribution = self._round.pending.get(island)
        if contribution is None:
            raise ContributionError(f"island {island!r}'s contribution to round {round} was refused")
        if not contribution.has_chunks(self.num_chunks):
            missing = sorted(set(self.owned) - set(contribution.chunks))
            raise ContributionError(f"island {island!r}, round {round}: chunks {missing[:8]} never arrived")
        contribution.ended = True
        if self.shard is not None:
            self.shard.completed(self.index, round, island)
        self.poll()
        return "accepted"

    def is_open(self, round: int, island: str) -> bool:
        """Whether `island` has an open contribution to `round` (the current one), which the other shares of an
        island of several processes join."""
        return round == self.round and island in self._round.pending and not self._closed_for(round, island)

    def forget_chunks(self, island: str, indices, reason: str) -> None:
        """Forgets chunks `indices` of an island's open contribution (one process's share, whose transfer failed:
        it sends them again), restarting the merge if it had taken any; a complete contribution is kept."""
        contribution = self._round.pending.get(island)
        if contribution is None or self._round.has_complete(island, self.num_chunks):
            return
        dropped = [k for k in indices if k in contribution.chunks]
        for k in dropped:
            del contribution.chunks[k]
        if dropped:
            logging.warning("island %s: %d chunks of its contribution to round %d were dropped: %s", island,
                            len(dropped), self.round, reason)
            self._restarted(island, self._round.forget_merge_with(island))

    def _refuse(self, island: str, reason: str) -> None:
        """Drops an island's contribution to the current round (logged); the round goes on without it."""
        logging.warning("island %s: %s; refused", island, reason)
        if self.shard is not None:
            self.shard.refused(self.index, self.round, island)
        self._restarted(island, self._round.without(island, refused=True))
        if not self.poll() and self.pipeline:
            self._merge_ready()  # merges again, without it, the chunks the others sent

    def abandon(self, island: str, reason: str, keep_complete: bool = False) -> None:
        """Forgets an island's open contribution to the current round (a transfer that failed); it may send
        again. With `keep_complete`, a contribution whose every chunk is in is kept (a retry is then a duplicate)."""
        if (keep_complete or self.shard is not None) and self._round.has_complete(island, self.num_chunks):
            return  # (a shard said it holds it whole: the leader may count it already)
        if island in self._round.pending:
            logging.warning("island %s: its contribution to round %d was dropped: %s", island, self.round, reason)
            del self._round.pending[island]
            self._restarted(island, self._round.forget_merge_with(island))

    def _restarted(self, island: str, restarted: bool) -> None:
        """Counts a restart of the merge (a new generation, from chunk 0) after it lost `island`."""
        if restarted:
            logging.info("round %d: restarting the merge without island %s", self.round, island)
            self.generation += 1

    # -- quorum and merge --------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Closes the round if it can (every expected island is in, or the `Quorum`'s grace window has
        passed); call it periodically while islands are missing.

        Returns:
          Whether a round was merged.
        """
        if self.shard is not None and not self.shard.leader:
            return self._follow()
        current = self._round
        if self.shard is not None:
            self._agree(current)
            if self._round is not current:  # a refusal another shard made closed it
                return True
        if current.first_complete_at is None and current.complete(self.islands, self.num_chunks):
            current.first_complete_at = self._clock()
        without = self.quorum.closing(current, self.islands, self.num_chunks)
        if without is None:
            return False
        for name in without:
            self._restarted(name, self._round.without(name))
        if self.shard is not None:  # the leader's set, before any shard merges a chunk of the round
            self.shard.decide(self.index, self.round, self._round.expected(self.islands))
        return self._merge_ready()

    def _follow(self) -> bool:
        """A coordinator shard other than the leader: once the leader's set of the round is known, drops every
        island outside it and merges (when every contribution of the set is complete here). Whether it merged."""
        decided = self.shard.decided(self.index, self.round)
        if decided is None:
            return False
        for name in self._round.expected(self.islands):
            if name not in decided:
                self._restarted(name, self._round.without(name))
        return self._merge_ready()

    def _agree(self, current: RoundState) -> None:
        """The leader of coordinator shards: counts a contribution complete only once it is complete on every
        shard (`Contribution.everywhere`), and refuses one that another shard refused."""
        complete, refused = self.shard.others_complete(self.index, self.round)
        for name in [n for n in current.expected(self.islands) if n in refused]:  # pending here or not
            self._refuse(name, "another coordinator shard refused its contribution")
            if self._round is not current:
                return
        for name, contribution in current.pending.items():
            contribution.everywhere = name in complete

    def _merge_ready(self) -> bool:
        """Merges every chunk that all expected islands have sent; finishes the round when all are merged."""
        expected = self._round.expected(self.islands)
        if not expected or any(n not in self._round.pending for n in expected):
            return False
        contributions = [self._round.pending[n] for n in expected]
        if not self.pipeline and not all(c.complete(self.num_chunks) for c in contributions):
            return False
        if self._round.merge is None:
            self._round.merge = PartialMerge.start(contributions, self._state, self.weighting, self.expert_weighting)
        if not self._round.merge.merge_ready(contributions, self._state):
            return False
        if not all(c.complete(self.num_chunks) for c in contributions):  # chunks merged; their streams not ended
            return False
        self._finish_round(contributions, self._round.merge)
        return True

    def _finish_round(self, contributions: list[Contribution], merge: PartialMerge) -> None:
        state, rows = self._state, merge.view
        if self.shard is not None:
            round = self.round + 1
            checksum_of = lambda: self.checksum_at(round)  # noqa: E731 - every shard's parts, combined
        state.commit(merge.master, merge.opt, rows)
        for record in self.history:  # a checksum nobody asked for by now is not kept (nor its rows)
            if callable(record.view_checksum):
                record.view_checksum = ""
        record = merge.record(self.round, contributions, view_checksum=lambda: state.checksum_of(rows))
        if self.shard is not None:
            record.view_checksum = checksum_of
        self.history.append(record)
        missing = sorted(set(self.islands) - set(record.contributors))
        logging.info(
            "round %d merged from %s (weights %s)%s", self.round, record.contributors, record.weights,
            f"; without {missing}" if len(record.contributors) < len(self.islands) else "",
        )
        if self.round == 0 and self.config.outer.sync == "auto" and self.config.outer.auto_from == "measured":
            self.plan_steps = plan_from_step_times(self.config, self.step_seconds)
            logging.info(
                "inner steps from round 1 on, from measured step times %s: %s", self.step_seconds, self.plan_steps
            )
        self._updates = {self.round: {k: merge.chunks[k] for k in self.owned}}
        if self.kept is not None:
            self.kept.keep(self.round, self.index, self._updates[self.round],
                           {c.island: dict(tokens=c.tokens, tau=c.tau, chunks=c.digests) for c in contributions})
        if self.shard is not None:  # what the other shards combine: this range's view digests and statistics
            self.shard.merged(self.index, self.round + 1, state.checksum_parts(), merge.partial_stats())
        self.round += 1
        self._round = RoundState(started_at=self._clock())

    # -- serving -----------------------------------------------------------------------------------------

    def _kept(self, round: int, island: str | None) -> dict[int, bytes] | None:
        """The kept update of a past `round` for a replaying `island` (None: it is not replaying, or the round
        is not kept)."""
        if self.kept is None or island is None or island not in self.replaying or round >= self.round:
            return None
        return self.kept.chunks(round, self.index)

    def update_chunks(self, round: int, island: str | None = None) -> tuple[int, dict[int, bytes], bool]:
        """What of `round`'s update exists so far: (generation, {chunk index: bytes}, whether it is final).
        A generation other than a reader's first means the merge restarted: chunks it has are void. A past
        round's update is served from the kept ones to an `island` replaying (`Coordinator.join`).

        Raises:
          StaleRoundError: the round is older than the latest merged one (and not kept for `island`).
        """
        if self._held(round):
            return self.generation, {}, False
        if round in self._updates:
            return self.generation, dict(self._updates[round]), True
        kept = self._kept(round, island)
        if kept is not None:
            return self.generation, kept, True
        if round < self.round:
            raise StaleRoundError(
                f"round {round} is older than the latest merged round {self.round - 1}; rejoin from the island view"
            )
        if round > self.round or self._round.merge is None:
            return self.generation, {}, False
        return self.generation, dict(self._round.merge.chunks), False

    def fetch_update(self, round: int, island: str) -> bytes:
        """The update bytes for `round` (`payload_bytes` of them, identical for every island).

        Raises:
          UpdateNotReady: the round has not been merged yet.
          StaleRoundError: the round is older than the latest merged one (use `fetch_view`).
        """
        if self._held(round):
            raise UpdateNotReady(f"round {round}'s update waits for the coordinator's checkpoint to be complete")
        chunks = self._updates[round] if round in self._updates else self._kept(round, island)
        if chunks is not None:
            if self.shard is None:
                return b"".join(chunks[k] for k in range(len(self.plan)))
            out = bytearray(self.update_bytes)  # a shard's chunks; zeros where the other shards' go
            for k, data in chunks.items():
                out[self.update_plan[k].offset : self.update_plan[k].offset + len(data)] = data
            return bytes(out)
        if round >= self.round:
            waiting = self._round.waiting_for(self.islands, self.num_chunks)
            raise UpdateNotReady(f"round {round} is not merged yet; waiting for {waiting}")
        raise StaleRoundError(
            f"island {island!r} asked for round {round}, older than the latest merged round {self.round - 1}; "
            "it rejoins from the island view (fetch_view)"
        )

    def planned_inner_steps(self, island: str) -> int | None:
        """The island's inner steps per round from now on, once a measured plan exists (else None)."""
        return self.plan_steps.get(island)
