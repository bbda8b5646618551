"""The coordinator of a run: one `FragmentCoordinator` per fragment, the handshake, the whole view, checkpoints.

Streaming DiLoCo (arXiv 2501.18512) syncs the parameters in fragments, each on
its own schedule; here each fragment has a `FragmentCoordinator`
(coordinator/fragment.py) with its own master slice, outer optimizer state,
island view, chunk plan and rounds. With `outer.fragments = 1` there is one
fragment holding every leaf: plain DiLoCo (arXiv 2311.08105).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import ml_collections

from island_jax.config import fingerprint_fields
from island_jax.coordinator import expert_merge, handshake
from island_jax.coordinator.fragment import FragmentCoordinator
from island_jax.coordinator.partial_merge import RoundRecord, merge_stats
from island_jax.coordinator.replay import KeptUpdates
from island_jax.coordinator.routing import with_router_distance
from island_jax.coordinator.shards import Shard, combine_stats
from island_jax.model import stacking
from island_jax.model.init import checksum, combine_parts
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib
from island_jax.protocol import ContributionHeader


def _in_tree(key: str, leaves: list[int]) -> str:
    """A `checksum_parts` key "LEAF,PIECE" of a fragment's leaf, as the key of that leaf in the whole tree
    (`leaves`: the fragment's leaf indices in the whole tree)."""
    leaf, piece = key.split(",")
    return f"{leaves[int(leaf)]},{piece}"


class Coordinator:
    """The coordinator of a run: one `FragmentCoordinator` per fragment (Streaming DiLoCo, arXiv 2501.18512).

    The parameters, in their per-layer form (`model.stacking.unstack`: a stacked leaf's layer slices), are split
    by `fragments.partition_params` into `outer.fragments` groups of whole leaves (with `model.scan_layers`,
    ranges of layers); fragment p has a `FragmentCoordinator` of its own
    over the list of its leaves, so fragment p's round r merges as soon as every
    island has contributed it, whatever the other fragments are doing. The outer step
    is elementwise, so F fragments give the bits one coordinator over the
    whole model would, when every fragment is synced at the same step.

    Args:
      config: the run's validated config (outer, codec, comm.chunk_bytes,
        comm.pipeline, model, seed).
      params: the seeded initial parameters (a pytree of float32 or bfloat16
        NumPy arrays, as from `model.init.init_params`, in either form); the master copy is
        float32, the view keeps the parameters' dtypes and is laid out in the per-layer form.
      islands: names of the islands expected to contribute every round.
      clock: seconds, monotonic (injectable for the quorum's grace window).
      shard: of a coordinator of `coordinator.shards` processes, this shard (`shards.Shard`): it holds its range
        of every fragment's chunks, and agrees with the others on each round's contributor set; None: one process.

    Raises:
      ValueError: more fragments than leaves, or a leaf neither float32 nor bfloat16.

    Attributes:
      fragments: the per-fragment `FragmentCoordinator`s.
      partition: leaf indices (in `jax.tree.leaves` order of the per-layer form) of each fragment.
      incarnation: a new hex string every time a coordinator is made (so islands tell a restart from a
        dropped connection).
    """

    def __init__(
        self, config: ml_collections.ConfigDict, params: Any, islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic, shard: Shard | None = None,
    ):
        self.config, self.islands, self.shard = config, list(islands), shard
        self.fingerprint_fields = fingerprint_fields(config)
        # the outer loop's leaves are the per-layer form's: a stacked leaf's layer slices (NumPy views)
        by_layer = stacking.is_stacked(params)
        params = stacking.unstack(params)
        leaves = jax.tree.leaves(params)
        self.partition = fragments_lib.partition_params(params, config.outer.fragments, by_layer)
        experts = expert_merge.expert_leaves(params)  # per leaf: the MoE layer of its routed experts, or None
        routers = expert_merge.router_leaves(params)  # ... of its router, or None
        self.fragments = [
            FragmentCoordinator(config, [leaves[i] for i in idx], islands, clock, shard=shard, index=p,
                                expert_layers=[experts[i] for i in idx], router_layers=[routers[i] for i in idx])
            for p, idx in enumerate(self.partition)
        ]
        for p, part in enumerate(self.fragments):
            part.warm_up()
            if shard is not None:
                part.publish_view()
                if not part.owned:
                    logging.warning(
                        "coordinator shard %d owns no chunk of fragment %d (its plan has %d chunks for %d shards); "
                        "lower comm.chunk_bytes so that every shard holds a range", shard.index, p, len(part.plan),
                        shard.count)
        self._treedef = jax.tree.structure(params)
        self._checksum: tuple[tuple, str] | None = None
        self.incarnation = uuid.uuid4().hex  # tells islands whether this coordinator restarted
        self.viewed: set[str] = set()  # islands that took the island view
        self.rejoined: set[str] = set()  # islands admitted to rejoin (they start on their own, past the barrier)
        self._clock = clock
        self._quorum_ready_at: float | None = None  # when the start barrier first held a quorum (barrier_waits_for)
        self.corpus: dict[str, dict] = {}  # island -> the corpus fingerprint it joined with (handshake.check_corpus)
        self.kept: KeptUpdates | None = None  # the updates kept for replays (`keep_updates`)
        self.replaying: set[str] = set()  # islands served kept updates of past rounds (one set for every fragment)
        self.replayed_at: dict[str, float] = {}  # island -> when it last said it replays a round (clock s)
        for p, f in enumerate(self.fragments):
            f.replaying, f.ends_replay = self.replaying, p == len(self.fragments) - 1

    def keep_updates(self, kept: "KeptUpdates") -> None:
        """Keeps every merged update and the digests of its contributions in `kept` from here on, and serves
        kept updates of past rounds to islands that replay them (`replay.KeptUpdates`). Kept updates of rounds
        the coordinator merges again (it resumed from an older checkpoint) are discarded."""
        self.kept = kept
        for f in self.fragments:
            f.kept = kept
            kept.discard_from(f.index, f.round)

    def __len__(self) -> int:
        return len(self.fragments)

    @property
    def round(self) -> int:
        """Rounds every fragment has completed (the smallest fragment round)."""
        return min(f.round for f in self.fragments)

    def _whole(self, per_fragment) -> Any:
        """The parameters' pytree from each fragment's leaves (`per_fragment(fragment)`, in its leaf order)."""
        leaves = [None] * sum(len(idx) for idx in self.partition)
        for f, idx in zip(self.fragments, self.partition):
            for i, leaf in zip(idx, per_fragment(f)):
                leaves[i] = leaf
        return jax.tree.unflatten(self._treedef, leaves)

    @property
    def view(self) -> Any:
        """The island view of every fragment, laid out afresh as the parameters' pytree (NumPy, their dtypes):
        4 bytes per float32 parameter for as long as the caller keeps it."""
        return self._whole(lambda f: jax.tree.leaves(f.view))

    @property
    def shapes(self) -> Any:
        """The parameters' pytree as `jax.ShapeDtypeStruct`s: what layouts and plans need, laid out from nothing."""
        return self._whole(lambda f: jax.tree.leaves(f.shapes))

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the whole island view, read in place from every fragment's rows (kept until a
        fragment merges again)."""
        key = tuple((f.round, f.generation) for f in self.fragments)
        if self._checksum is None or self._checksum[0] != key:
            if self.shard is None:
                self._checksum = (key, checksum(self._whole(lambda f: f.view_leaves())))
            else:  # every shard's parts of every fragment, keyed by the leaf's place in the whole tree
                parts = [
                    {what: {_in_tree(key, idx): v for key, v in part[what].items()} for what in ("digests", "cut")}
                    for f, idx in zip(self.fragments, self.partition)
                    for part in self.shard.gather("parts", f.index, f.round)
                ]
                self._checksum = (key, combine_parts(self.shapes, parts))
        return self._checksum[1]

    def complete_record(self, record: RoundRecord, fragment: int) -> RoundRecord:
        """Of the leader of coordinator shards: `record`'s statistics (norms, cosines, update bytes, codec error)
        from every shard's partial sums of that round (waits for them); the record itself otherwise."""
        if self.shard is None or not self.shard.leader:
            return record
        stats = combine_stats(self.shard.gather("stats", fragment, record.round + 1))
        router_sq, router_norm_sq = stats.pop("router_sq"), stats.pop("router_norm_sq")
        for key, value in merge_stats(record.contributors, **stats).items():
            setattr(record, key, value)
        if record.routing is not None:
            record.routing = with_router_distance(record.routing, router_sq, router_norm_sq)
        return record

    def check_island(self, island: str, config_fingerprint: dict) -> None:
        """The handshake's check of a reconnecting island: its name and `config.fingerprint_fields` against ours,
        changing nothing (`join` checks these and more).

        Raises:
          HandshakeError: an unknown island, or fingerprint fields that differ (each named with both values).
        """
        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint)

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Admits an island whose model, codec and seed match, at the round it resumes or at the run's.

        An island at the coordinator's round (every fragment at it) must hold
        the view's parameters: it trains on from its own state. Any other
        island rejoins a running run (a restarted island behind the run, or
        one ahead of a restarted coordinator): it is admitted at the round of
        a fragment that still waits for it, else at the next round boundary
        (once every fragment completed that round), and takes the island view
        then (`view_ready`, `fetch_view`); an island ahead that holds its own
        checkpoint of that round may roll back to it instead.

        Args:
          island: the island's name in `config.islands`.
          config_fingerprint: the island's `config.fingerprint_fields(config)`, and its corpus's fingerprint
            under `handshake.CORPUS` (which must equal every other joined island's, `handshake.check_corpus`).
          params_checksum: `model.init.checksum` of the island's global parameters.
          round: the rounds the island has completed (the round it trains next, 0-based).

        Returns:
          {"round": the round it is admitted at, "checksum": the whole view's checksum now,
          "rejoin": whether it must take the view (or its checkpoint of that round), and with "rejoin", where any
          are kept, "kept": the records of the rounds kept for it to replay (`replay.KeptUpdates.records`)}.

        Raises:
          HandshakeError: unknown island, fingerprint fields that differ (named in the message), another
            corpus than another island's, or, at the coordinator's round, another checksum.
        """
        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint)
        handshake.check_corpus(island, config_fingerprint.get(handshake.CORPUS), self.corpus)
        if self.shard is not None and not self.shard.leader:  # the leader admits; here the island is only known
            for f in self.fragments:
                f.joined.add(island)
            # an island at another round than the run's rejoins (the leader decides how): it may replay this range
            kept = self._kept_for(island) if round != self.round else []
            return dict(round=self.round, checksum="", rejoin=False, **({"kept": kept} if kept else {}))
        rounds = [f.round for f in self.fragments]
        at_our_round = len(set(rounds)) == 1 and round == rounds[0]
        if at_our_round and (params_checksum == self.checksum or round == 0):
            handshake.check_params_checksum(island, params_checksum, self.checksum)  # at 0: another init
            admitted, rejoin = round, False
        else:  # (at our round with other parameters: a fragment's update of a round this coordinator redid)
            admitted, rejoin = self.admission_round(island), True
            missed = f"; it missed rounds {round + 1}..{admitted}" if admitted > round else ""
            logging.info(
                "island %s rejoins: it completed %d rounds, the fragments %s; admitted at round %d%s",
                island, round, rounds, admitted + 1, missed,
            )
        for f in self.fragments:
            f.joined.add(island)
        if rejoin:
            self.rejoined.add(island)
        else:
            self.rejoined.discard(island)
        reply = dict(round=admitted, checksum=self.checksum, rejoin=rejoin)
        kept = self._kept_for(island) if rejoin else []
        if kept:
            reply["kept"] = kept
        return reply

    def _kept_for(self, island: str) -> list[dict]:
        """The kept records an island replays with (`KeptUpdates.records`, of every kept round: after a
        coordinator restart it starts from an older checkpoint than the round it joins with); it is served their
        updates from now on. [] when nothing is kept."""
        if self.kept is None:
            return []
        self.replaying.add(island)
        return self.kept.records(island)

    def note_replay(self, island: str, round: int) -> None:
        """A replaying island recomputes `round` (0-based): it is alive, and a round waiting for it is not
        stalled (`stalled`) while it catches up."""
        self.replayed_at[island] = self._clock()
        logging.info("island %s replays round %d (the run is at round %d)", island, round + 1, self.round + 1)

    def barrier_waits_for(self, ready: set[str]) -> dict[str, str]:
        """The islands the start barrier (every island says it is ready, then all start their first round
        together) still waits for, each with why: it has not joined yet, or it joined and is not ready yet. An
        island admitted to rejoin (`join`'s "rejoin": behind a resumed run, or ahead of a restarted coordinator)
        starts on its own and is not waited for, nor is one that took the view. Resumed (past round 0) with
        `outer.min_islands` below the island count, the barrier stops waiting `outer.grace_seconds` (by the
        injectable clock) after a quorum of islands is ready."""
        joined = set().union(*(f.joined for f in self.fragments))
        waits = {
            n: "joined, not ready yet (evaluating or compiling)" if n in joined else "has not joined yet"
            for n in self.islands if n not in ready and n not in self.rejoined and n not in self.viewed
        }
        # Resumed with a quorum below every island (outer.min_islands), one that may be gone for good is waited for
        # only outer.grace_seconds once the quorum is there, as a round would; a new run waits for every island
        # (one slow to start is not left behind at its first round).
        quorum = self.config.outer.min_islands or len(self.islands)
        if not waits or self.round == 0 or len(self.islands) - len(waits) < quorum:
            self._quorum_ready_at = None
            return waits
        now = self._clock()
        if self._quorum_ready_at is None:
            self._quorum_ready_at = now
        return {} if now - self._quorum_ready_at >= self.config.outer.grace_seconds else waits

    def admission_round(self, island: str) -> int:
        """The round a rejoining island trains first: the lowest fragment round if a fragment at it still
        waits for the island (`FragmentCoordinator.needs`: its quorum is not reached), else the next round boundary."""
        rounds = [f.round for f in self.fragments]
        low, high = min(rounds), max(rounds)
        if any(f.round == low and f.needs(island) for f in self.fragments):
            return low
        return high + 1 if low == high else high

    def view_ready(self, min_round: int) -> bool:
        """Whether every fragment has completed `min_round` rounds (a rejoining island's view can be sent), and
        the view holds no update that is held back (`hold_updates`)."""
        held = self.fragments[0].held_from
        return self.round >= min_round and (held is None or max(f.round for f in self.fragments) <= held)

    def hold_updates(self, round: int | None) -> None:
        """Holds back every fragment's updates of `round` and later (None: releases them)."""
        for f in self.fragments:
            f.hold_updates(round)

    def stalled(self) -> tuple[float, list[str], int]:
        """The longest a fragment's round has waited without a quorum since its first complete contribution:
        (seconds, the islands it waits for, the fragment); (0, [], -1) when none waits."""
        worst = (0.0, [], -1)
        now = self._clock()
        for p, f in enumerate(self.fragments):
            seconds, waiting = f.stalled()
            # a round waits no longer than since the last sign of life of an island replaying towards it
            said = [now - self.replayed_at[n] for n in waiting if n in self.replayed_at]
            if said:
                seconds = min(seconds, max(said))
            if waiting and seconds > worst[0]:
                worst = (seconds, waiting, p)
        return worst

    def contribute(self, header: ContributionHeader, payload: bytes) -> str:
        """Accepts one island's whole encoded pseudo-gradient of `fragment`; merges when the round can close.

        A round closes when every island has contributed (or been refused), or
        when `outer.min_islands` have and `outer.grace_seconds` have passed since
        (`quorum.Quorum`, checked here and by `poll`). A contribution to a round
        that has already closed is discarded and logged: the island then fetches
        that round's update, which brings it to the same global parameters as
        everyone else.

        Args:
          header: the round, island (joined), tokens (> 0, the merge weight), checksum of the island's
            anchor of the fragment (must equal its view's when given), step seconds and fragment.
          payload: `codec.encode(anchor - params)` of the fragment's leaves, its `payload_bytes` bytes.

        Returns:
          "accepted", or "discarded" for a round that has already closed.

        Raises:
          ContributionError: island not joined, a future round, duplicate,
            tokens <= 0, payload of the wrong size, or NaN/Inf in the decoded
            values (logged with the island's name; the round closes without
            it). Nothing of a refused contribution reaches the merge.
        """
        return self.fragments[header.fragment].contribute(header, payload)

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """`FragmentCoordinator.fetch_update` of fragment `fragment` (raises UpdateNotReady, StaleRoundError); a
        past round's kept update to an island that replays."""
        return self.fragments[fragment].fetch_update(round, island)

    def poll(self) -> bool:
        """Polls every fragment (see `FragmentCoordinator.poll`); whether any merged."""
        return any([f.poll() for f in self.fragments])

    def planned_inner_steps(self, island: str) -> int | None:
        """The measured plan, made when the last fragment of round 0 (contributed at its end) merged."""
        return self.fragments[-1].planned_inner_steps(island)

    def fetch_view(self, island: str | None = None) -> tuple[list[int], bytes]:
        """The island view, losslessly, for an island that rejoins or fell behind (`island`, which the
        quorum then gives a fair first round: `FragmentCoordinator.took_view`).

        Returns:
          (each fragment's round, the whole view as a float32 "none" payload; every parameter dtype up to
          float32 survives the round trip bit for bit).
        """
        if island is not None:
            self.viewed.add(island)
            self.replaying.discard(island)  # its replay, if any, ended: it takes the view
            for f in self.fragments:
                f.took_view(island)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return [f.round for f in self.fragments], codec.encode(self.view, "none")

    def state(self) -> dict:
        """What a checkpoint holds: `fragments`, one `FragmentCoordinator.state()` per fragment."""
        return dict(fragments=[f.state() for f in self.fragments])

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands at other rounds rejoin (`Coordinator.join`)."""
        for f, s in zip(self.fragments, state["fragments"]):
            f.load_state(s)
            if self.shard is not None:
                f.publish_view()
        self._checksum = None
