"""An island's checkpointed state (`state`, `load_state`): parameters, anchor, AdamW state, inner steps taken
and rounds completed, and, with error feedback, each process's residual of the chunks it owns.

The parameters, anchor and AdamW state are the island's sharded `jax.Array`s; a restored state is placed by
this run's layout, whatever the layout that saved it. The residual is float32 [processes, elements], one row
per process, which writes its own row; it belongs to the chunks each process owns, so it resumes only under
the same processes and layout (`layout_name`), which the checkpoint records beside it.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.checkpoint import CheckpointError
from island_jax.config import error_feedback

_LAYOUT_BYTES = 64  # `Island.layout_name` in a checkpoint, zero-padded


class CheckpointState:
    """The checkpoint methods of `island.Island`, mixed into it: `state` and `load_state`, which read and replace
    its parameters, anchor, AdamW state, step, global parameters and error-feedback residual
    (`fragments.FragmentExchange`).
    """

    def _residual_sharding(self) -> NamedSharding:
        """The error-feedback residual's sharding in a checkpoint: one row per process, split over its devices."""
        devices = np.asarray(self.mesh.devices).reshape(-1)
        rows = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(self.parts, -1)
        return NamedSharding(jax.sharding.Mesh(rows, ("process", "local")), P("process", "local"))

    def _owned_pieces(self):
        """(residual key, its place in this process's residual row, elements) of each piece this process owns, in
        fragment, chunk and piece order: the layout of `_residual_rows`."""
        at = 0
        for f, ownership in enumerate(self.ownerships):
            for chunk in ownership.share:
                for piece in chunk.pieces:
                    yield (f, piece.leaf, piece.start), at, piece.stop - piece.start
                    at += piece.stop - piece.start

    def _residual_rows(self, template: bool) -> jax.Array:
        """The error-feedback residual as float32 [processes, elements]: row p holds, in fragment, chunk and piece
        order, the residual of the pieces process p owns (zero-padded to the longest row, rounded up to a
        multiple of its devices, which hold a part of it each). Each process writes its own row; nothing is
        gathered."""
        sizes = [sum(o.residual_elements[p] for o in self.ownerships) for p in range(self.parts)]
        local = self.mesh.devices.size // self.parts
        row = np.zeros((1, -(-max(max(sizes), 1) // local) * local), np.float32)
        if not template:
            for key, at, n in self._owned_pieces():
                kept = self.residual.get(key)
                if kept is not None:
                    row[0, at : at + n] = kept
        return jax.make_array_from_callback((self.parts, row.shape[1]), self._residual_sharding(),
                                            lambda index: row[:, index[1]])

    def _load_residual(self, rows) -> None:
        """Takes this process's row of a checkpoint's `_residual_rows`."""
        self.residual = {}
        if isinstance(rows, jax.Array):  # this process's row, from the parts its devices hold
            row = np.zeros(rows.shape[1], np.float32)
            for shard in rows.addressable_shards:
                if shard.index[0].indices(self.parts)[0] == self.part:
                    row[shard.index[1]] = np.asarray(shard.data).reshape(-1)
        else:  # restored on the host (an island of one process)
            row = np.asarray(rows)[self.part]
        for key, at, n in self._owned_pieces():
            if row[at : at + n].any():
                self.residual[key] = np.array(row[at : at + n], np.float32)

    def state(self, round: int, template: bool = False) -> dict:
        """What a checkpoint holds after `round` completed rounds: `params`, `anchor`,
        `opt_state` (AdamW), `step` (inner steps taken, also the data position; int64 []) and `round` (int64
        []); with error feedback (`config.error_feedback`) also `residual` (`_residual_rows`: each process's own pieces, one row
        per process, so a resume needs the same processes and layout); with several fragments under
        `outer.expert_weighting = "tokens_routed"` `routed_pending` (int64 [F, MoE layers, experts]: each
        fragment's routed counts since its last contribution, `Island.take_routed_counts`, which its first
        contribution after a resume sends whole) and `routed_steps` (int64 [F]: the steps they cover). A `template` is only a state to restore into (its residual
        is zeros)."""
        out = dict(
            params=self.params,
            anchor=self.anchor,
            opt_state=self.opt_state,
            step=np.asarray(self.step, np.int64),
            round=np.asarray(round, np.int64),
        )
        if error_feedback(self.config.codec):
            out["residual"] = self._residual_rows(template)
            out["residual_layout"] = self._residual_layout()
        if self.routed_pending is not None and len(self.partition) > 1 and \
                self.config.outer.get("expert_weighting", "same") == "tokens_routed":
            out["routed_pending"] = self.routed_pending.copy()  # fragments contributed within the round
            out["routed_steps"] = self.routed_steps.copy()
        return out

    def _residual_layout(self) -> np.ndarray:
        """uint8 [_LAYOUT_BYTES]: a digest of which process owns which pieces (16 bytes), then `layout_name`
        (zero-padded): what a checkpoint's residual rows need of the run that restores them."""
        owned = [[[c.index for c in share] for share in o.shares] for o in self.ownerships]
        digest = hashlib.sha256(repr(owned).encode()).digest()[:16]
        name = self.layout_name().encode()[: _LAYOUT_BYTES - 16]
        return np.frombuffer(digest + name.ljust(_LAYOUT_BYTES - 16, b"\0"), np.uint8)

    def layout_name(self) -> str:
        """The island's layout, which decides which process owns which chunk: e.g. "2 processes, data=1 fsdp=2
        expert=2"."""
        mesh = self.config.islands[self.name].mesh
        return f"{self.parts} process{'es' if self.parts > 1 else ''}, data={mesh.data} fsdp={mesh.fsdp} expert={mesh.expert}"

    def load_state(self, state: dict) -> int:
        """Continues from a checkpointed `state()`; returns its round (completed rounds). The parameters, anchor and
        AdamW state are placed by this run's layout, whatever the layout that saved them.

        Raises:
          CheckpointError: the state holds an error-feedback residual saved under another layout (`layout_name`).
        """
        opt_sharding = jax.tree.map(lambda x: x.sharding, self.opt_state)
        self.global_params = self.host_shards(state["anchor"])
        self._global_checksum = None
        with jax.set_mesh(self.mesh):
            self.params = self.shardings.place(state["params"])
            self.anchor = self.shardings.place(state["anchor"])
            self.opt_state = jax.device_put(state["opt_state"], opt_sharding)
        if "residual" in state:
            saved = bytes(np.asarray(state["residual_layout"], np.uint8))
            if saved[:16] != bytes(self._residual_layout()[:16]):
                raise CheckpointError(
                    f"island {self.name}'s checkpoint holds the error-feedback residual of the chunks each process "
                    f"owned under another layout ({saved[16:].rstrip(bytes(1)).decode()}) than this run's "
                    f"({self.layout_name()}); resume with that layout, or start a new --workdir")
            self._load_residual(state["residual"])
        if "routed_pending" in state:
            self.routed_pending = np.array(state["routed_pending"], np.int64)
            self.routed_steps = np.array(state["routed_steps"], np.int64)
        self.step = int(state["step"])
        return int(state["round"])
