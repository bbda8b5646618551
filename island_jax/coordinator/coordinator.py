"""The coordinator of a run: one `Coordinator` per fragment, the handshake, the whole view, checkpoints.

Streaming DiLoCo (arXiv 2501.18512) syncs the parameters in fragments, each on
its own schedule; here each fragment has a `Coordinator` (coordinator/merge.py)
with its own master slice, outer optimizer state, island view, chunk plan and
rounds. With `outer.fragments = 1` there is one fragment holding every leaf:
plain DiLoCo (arXiv 2311.08105).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import ml_collections

from island_jax.config import fingerprint_fields
from island_jax.coordinator import handshake
from island_jax.coordinator.contribution import ContributionHeader
from island_jax.coordinator.errors import HandshakeError
from island_jax.coordinator.merge import Coordinator
from island_jax.model.init import checksum
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib


class FragmentedCoordinator:
    """The coordinator of a run: one `Coordinator` per fragment (Streaming DiLoCo, arXiv 2501.18512).

    The parameters are split by `fragments.partition` into `outer.fragments`
    groups of whole leaves; fragment p has a `Coordinator` of its own over the
    list of its leaves, so fragment p's round r merges as soon as every island
    has contributed it, whatever the other fragments are doing. The outer step
    is elementwise, so F fragments give the bits one coordinator over the
    whole model would, when every fragment is synced at the same step.

    Args:
      config: the run's validated config (outer, codec, comm.chunk_bytes,
        comm.pipeline, model, seed).
      params: the seeded initial parameters (a pytree of float32 or bfloat16
        NumPy arrays, as from `model.init.init_params`); the master copy is
        float32, the view keeps the parameters' dtypes.
      islands: names of the islands expected to contribute every round.
      clock: seconds, monotonic (injectable for the quorum's grace window).

    Raises:
      ValueError: more fragments than leaves, or a leaf neither float32 nor bfloat16.

    Attributes:
      fragments: the per-fragment `Coordinator`s.
      partition: leaf indices (in `jax.tree.leaves(params)` order) of each fragment.
    """

    def __init__(
        self, config: ml_collections.ConfigDict, params: Any, islands: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config, self.islands = config, list(islands)
        self.fingerprint_fields = fingerprint_fields(config)
        leaves = jax.tree.leaves(params)
        self.partition = fragments_lib.partition(fragments_lib.leaf_bytes(params), config.outer.fragments)
        self.fragments = [Coordinator(config, [leaves[i] for i in idx], islands, clock) for idx in self.partition]
        for part in self.fragments:
            part.warm_up()
        self._treedef = jax.tree.structure(params)
        self._checksum: tuple[tuple, str] | None = None

    def __len__(self) -> int:
        return len(self.fragments)

    @property
    def round(self) -> int:
        """Rounds every fragment has completed (the smallest fragment round)."""
        return min(f.round for f in self.fragments)

    @property
    def view(self) -> Any:
        """The island view of every fragment, laid out as the parameters' pytree (NumPy, their dtypes)."""
        leaves = [None] * sum(len(idx) for idx in self.partition)
        for f, idx in zip(self.fragments, self.partition):
            for i, leaf in zip(idx, f.view):
                leaves[i] = leaf
        return jax.tree.unflatten(self._treedef, leaves)

    @property
    def checksum(self) -> str:
        """`model.init.checksum` of the whole island view (kept until a fragment merges again)."""
        key = tuple((f.round, f.generation) for f in self.fragments)
        if self._checksum is None or self._checksum[0] != key:
            self._checksum = (key, checksum(self.view))
        return self._checksum[1]

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """Admits an island whose model, codec, seed, round and parameters match (to every fragment).

        Args:
          island: the island's name in `config.islands`.
          config_fingerprint: the island's `config.fingerprint_fields(config)`.
          params_checksum: `model.init.checksum` of the island's global parameters.
          round: the round the island will train next (0 on a fresh start; the
            checkpointed round when it resumes).

        Returns:
          {"round": the round to train next, "checksum": the whole view's checksum}.

        Raises:
          HandshakeError: unknown island, fingerprint fields that differ (named
            in the message), another round (every fragment must be at it), or
            another checksum.
        """
        rounds = {f.round for f in self.fragments}
        if len(rounds) > 1:
            raise HandshakeError(
                f"island {island!r} joins while the fragments are at rounds {sorted(rounds)}; an island can join "
                "only between rounds: restart every role from the same workdir"
            )
        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint, round, self.round)
        handshake.check_params_checksum(island, params_checksum, self.checksum)
        for f in self.fragments:
            f.joined.add(island)
        return dict(round=self.round, checksum=self.checksum)

    def contribute(self, header: ContributionHeader, payload: bytes) -> str:
        """Accepts one island's whole encoded pseudo-gradient of `fragment`; merges when the round can close.

        A round closes when every island has contributed (or been refused), or
        when `outer.min_islands` have and `outer.grace_seconds` have passed since
        (`merge.Quorum`, checked here and by `poll`). A contribution to a round
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
        """`Coordinator.fetch_update` of fragment `fragment` (raises UpdateNotReady, StaleRoundError)."""
        return self.fragments[fragment].fetch_update(round, island)

    def poll(self) -> bool:
        """Polls every fragment (see `Coordinator.poll`); whether any merged."""
        return any([f.poll() for f in self.fragments])

    def planned_inner_steps(self, island: str) -> int | None:
        """The measured plan, made when the last fragment of round 0 (contributed at its end) merged."""
        return self.fragments[-1].planned_inner_steps(island)

    def fetch_view(self) -> tuple[int, bytes]:
        """The island view, losslessly, for an island that fell behind by more than a round.

        Returns:
          (the round every fragment has completed, the whole view as a float32
          "none" payload; every parameter dtype up to float32 survives the round
          trip bit for bit).
        """
        with jax.default_device(jax.devices("cpu")[0]):
            return self.round, codec.encode(self.view, "none", self.fragments[0].block_size)

    def state(self) -> dict:
        """What a checkpoint holds: `fragments`, one `Coordinator.state()` per fragment."""
        return dict(fragments=[f.state() for f in self.fragments])

    def load_state(self, state: dict) -> None:
        """Continues from a checkpointed `state()`; islands must then join at the same round."""
        for f, s in zip(self.fragments, state["fragments"]):
            f.load_state(s)
        self._checksum = None
