"""Orbax checkpoints of a role's state (coordinator or island), one folder per role.

A state is a pytree of NumPy arrays (parameters, optimizer states, scalars as
0-d arrays), saved under `directory/<round>` with orbax's `CheckpointManager`,
where `<round>` counts completed rounds. Restoring needs a pytree of the same
structure (for example the freshly initialised state), so optax's state
classes come back as themselves, bit for bit.
"""

from __future__ import annotations

import os
from concurrent import futures
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# One writer per process: roles that share a process (the in-process run) save one after another, since
# orbax's background saves of several CheckpointManagers at once in one process collide.
_WRITER = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored into this run (other structure or shapes)."""


def _host(tree: Any) -> Any:
    """A host copy of every leaf (NumPy): a background save never sees a later change."""
    return jax.tree.map(lambda x: np.array(jax.device_get(x), copy=True), tree)


class Checkpointer:
    """Saves and restores one role's state every `every_rounds` rounds.

    Args:
      directory: folder of this role's checkpoints (created).
      every_rounds: save when the completed rounds are a multiple of this
        (`config.checkpoint.every_rounds`), and whenever `save(force=True)`.
      max_to_keep: newest checkpoints kept; older ones are deleted.
    """

    def __init__(self, directory: str, every_rounds: int, max_to_keep: int):
        self.directory = os.path.abspath(directory)
        self.every_rounds = every_rounds
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )
        self._pending: futures.Future | None = None

    def latest_round(self) -> int | None:
        """Completed rounds of the newest checkpoint, or None when there is none."""
        return self._manager.latest_step()

    def save(self, round: int, state: Any, force: bool = False) -> bool:
        """Saves `state` (arrays on any device; copied to the host here) as of `round` completed rounds.

        The files are written in the background while training goes on; the
        next `save` and `close` wait for them, and a checkpoint only counts
        (`latest_round`) once it is complete.

        Returns:
          Whether a checkpoint was written (every `every_rounds`, or forced).

        Raises:
          Whatever the previous save raised, if it failed.
        """
        if not force and round % self.every_rounds:
            return False
        if self._pending is not None:
            self._pending.result()  # the previous save, finished (or its error)
        if self._manager.latest_step() == round:
            return False
        host = _host(state)

        def write():
            self._manager.save(round, args=ocp.args.StandardSave(host))
            self._manager.wait_until_finished()

        self._pending = _WRITER.submit(write)  # the caller only pays for the host copy
        return True

    def restore(self, like: Any, round: int | None = None) -> Any:
        """The state saved at `round` (default: the newest), shaped like `like`, as NumPy arrays.

        Raises:
          CheckpointError: no checkpoint, or one whose structure or shapes differ
            from `like` (a checkpoint of another model or optimizer).
        """
        round = self._manager.latest_step() if round is None else round
        if round is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        like = _host(like)
        try:
            restored = self._manager.restore(round, args=ocp.args.StandardRestore(like))
        except Exception as e:  # orbax raises several types for a mismatched tree
            raise CheckpointError(
                f"the checkpoint of round {round} in {self.directory} does not fit this run's model and optimizer "
                f"({type(e).__name__}: {e}); resume with the config that wrote it, or pass a new --workdir"
            ) from e
        restored_leaves = jax.tree.leaves(restored)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(like)[0], restored_leaves, strict=True):
            b = np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise CheckpointError(
                    f"the checkpoint of round {round} in {self.directory} holds {jax.tree_util.keystr(path)} as "
                    f"{b.dtype}{list(b.shape)} but this run has {a.dtype}{list(a.shape)}; resume with the config that "
                    "wrote it, or pass a new --workdir"
                )
        return jax.tree.map(np.asarray, restored)

    def close(self) -> None:
        """Waits for the save in progress (raising its error, if any), then closes the manager."""
        try:
            if self._pending is not None:
                self._pending.result()
        finally:
            self._manager.wait_until_finished()
            self._manager.close()
