"""Orbax checkpoints of a role's state (coordinator or island), one folder per role, checked when restored.

A state is a pytree of NumPy arrays (parameters, optimizer states, scalars as 0-d arrays), saved under
`directory/<round>` (`<round>`: completed rounds) with orbax's `CheckpointManager`, and restored into a pytree of
the same structure, so optax's state classes come back as themselves, bit for bit.

Saves run on one background writer thread per process; orbax writes into `<round>.orbax-checkpoint-tmp` and
renames it when complete, so a failed save leaves the older checkpoints whole and raises `CheckpointError` at the
next `save` or at `close`. Each checkpoint's step metadata holds every leaf's checksum
(`model.init.leaf_checksums`), dtype and shape; `restore` checks what it read against them, names a damaged
checkpoint (`CheckpointCorrupt`: folder, leaf, both checksums), moves it aside to `<round>.damaged` and restores
the newest intact one instead. A process of a multi-process island saves and restores its own shards (orbax's
multi-host support, one shared folder), on the training thread: those saves are collectives of the island.
See docs/workdir.md ("Checkpoints and resume").
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent import futures
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from island_jax import allocator
from island_jax.mesh import host_copy
from island_jax.model.init import leaf_checksums

# One writer per process: roles that share a process (the in-process run) save one after another, since
# orbax's background saves of several CheckpointManagers at once in one process collide.
_WRITER = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

# How orbax names the folder a checkpoint is written into before it is complete: `<round>` + this.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
# Where a damaged checkpoint `<round>` is moved (beside the others, outside orbax's view): `<round>` + this.
DAMAGED_SUFFIX = ".damaged"
# The key of the step metadata that holds each leaf's [checksum, dtype, shape], by `jax.tree_util.keystr` path.
LEAVES = "island_jax_leaves"


# Orbax copies every NumPy array it is given before writing it (`deepcopy_host_arrays`), in case the caller changes
# it meanwhile. Every array a save gets here is a private host copy (`_host`), or is read before `save` returns (the
# synchronous saves of a multi-process island), so orbax's copy would only double the state's host bytes at each
# save (docs/benchmarks.md, "Host memory per parameter"). This is orbax's own switch, for NumPy arrays in this
# process.
_verbosity = logging.get_verbosity()
logging.set_verbosity(logging.ERROR)  # orbax warns that it replaces its own handler, which is what is asked
try:
    ocp.type_handlers.register_type_handler(
        np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True
    )
finally:
    logging.set_verbosity(_verbosity)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or cannot be restored into this run (none, other structure or shapes)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not hold what was saved: a leaf reads other bits than its saved checksum, or orbax
    cannot read the checkpoint for another reason than a structure that differs from this run's."""


def describe_leaves(tree: Any) -> dict[str, list]:
    """{`jax.tree_util.keystr` path: [checksum (`model.init.leaf_checksums`), dtype name, shape]} of every leaf of
    `tree`: what a checkpoint's step metadata records of the state it holds. A collective for leaves spread over
    processes (every process calls it at the same point)."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    leaves = jax.tree.leaves(tree)
    return {path: [c, np.dtype(x.dtype).name if hasattr(x, "dtype") else np.asarray(x).dtype.name,
                   [int(d) for d in np.shape(x)]]
            for path, c, x in zip(paths, leaf_checksums(tree), leaves, strict=True)}


def _host(tree: Any, frozen_numpy: bool = False) -> Any:
    """A host copy of every leaf (NumPy): a background save never sees a later change. With `frozen_numpy`, NumPy
    arrays are taken as they are (their owner never writes them again), and only the rest is copied."""
    return jax.tree.map(lambda x: x if frozen_numpy and isinstance(x, np.ndarray) else host_copy(x), tree)


def _spans_processes(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _abstract(tree: Any) -> Any:
    """What orbax restores into: arrays of several processes as their shape, dtype and sharding; the rest
    as NumPy zeros of their shape and dtype (only their structure is read; large ones are fresh zero pages,
    but those under the mmap threshold, `allocator.SPEED`, come from the heap)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if _spans_processes(x) else
        np.zeros(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype), tree,
    )


def verify_leaves(tree: Any, saved: dict, what: str) -> None:
    """Checks every leaf of `tree` against `saved`, a checkpoint's `describe_leaves` record (which may describe
    more leaves than `tree` holds: a part of the state read alone). A collective for leaves spread over processes.

    Raises:
      CheckpointCorrupt: "`what` is damaged: PATH reads checksum X, but was saved with Y", for the first leaf
        that differs or that `saved` lacks.
    """
    def plain(path: str) -> str:  # a restore without a template reads integer dict keys back as strings
        return re.sub(r"\['(\d+)'\]", r"[\1]", path)

    saved = {plain(k): v for k, v in saved.items()}
    for path, now in describe_leaves(tree).items():
        was = saved.get(plain(path), [None])[0]
        if now[0] != was:
            raise CheckpointCorrupt(f"{what} is damaged: {path} reads checksum {now[0]}, but was saved with {was}")


class Checkpointer:
    """Saves and restores one role's state every `every_rounds` rounds.

    `save`, `restore` and `close` may be called from several threads; the
    files are written on the process's one writer thread.

    Args:
      directory: folder of this role's checkpoints (created).
      every_rounds: save when the completed rounds are a multiple of this
        (see `workdir.checkpoint_schedule`), and whenever `save(force=True)`.
      max_to_keep: newest checkpoints kept; older ones are deleted once a
        newer one is complete.
    """

    def __init__(self, directory: str, every_rounds: int, max_to_keep: int):
        self.directory = os.path.abspath(directory)
        self.every_rounds = every_rounds
        self.max_to_keep = max_to_keep
        self._manager = self._open_manager()
        self._complete: list[int] = sorted(self._manager.all_steps())  # replaced whole, never changed in place
        self._lock = threading.Lock()  # one caller at a time in save, restore and close
        self._last: futures.Future | None = None  # the most recent background save
        self._unreported: futures.Future | None = None  # a save whose error, if any, the caller has not seen
        self._closed = False
        self.multi_process = jax.process_count() > 1  # a process of a multi-process island

    def _open_manager(self) -> ocp.CheckpointManager:
        # Uncompressed: orbax's zstd holds the compressed chunks in memory until they are written (about 0.6 of
        # the state's bytes on top of it at each save), for files about 8% smaller (docs/benchmarks.md, "Host
        # memory per parameter"); written plain, the arrays go to the files as they are. Restore reads either.
        return ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True),
            item_handlers=ocp.PyTreeCheckpointHandler(use_compression=False),
        )

    def rounds(self, wait: bool = False) -> list[int]:
        """Completed rounds of the complete checkpoints in the folder, ascending (a save in progress is not one,
        unless `wait`: then it is waited for first).

        As read when this `Checkpointer` was opened and after each of its saves.
        """
        if wait:
            with self._lock:
                if self._last is not None:
                    futures.wait([self._last])
        return list(self._complete)

    def latest_round(self) -> int | None:
        """Completed rounds of the newest complete checkpoint, or None when there is none."""
        return self._complete[-1] if self._complete else None

    def last_save(self) -> futures.Future | None:
        """The future of the most recent background save, or None before the first.

        It is done once that checkpoint is complete (result None) or its save
        failed (exception: the `CheckpointError` that `save` or `close` raise);
        `add_done_callback` callbacks run on the writer thread, or at once when
        it is already done. A callback must not call `save`, `restore` or
        `close`: they wait for the writer thread, which runs the callback.
        """
        return self._last

    def save(self, round: int, state: Any, force: bool = False, frozen_numpy: bool = False) -> bool:
        """Saves `state` (arrays on any device; copied to the host here) as of `round` completed rounds. With
        `frozen_numpy` the caller promises that no NumPy array in `state` is written again (fresh arrays, or ones
        it only ever replaces), so the background save takes them without a copy.

        The files are written in the background while training goes on; the
        next `save` and `close` wait for them, and a checkpoint only counts
        (`rounds`, `latest_round`) once it is complete.

        Returns:
          Whether a checkpoint was started (every `every_rounds`, or forced;
          not when the newest complete checkpoint is already of `round`).

        Raises:
          CheckpointError: the previous background save failed (raised once,
            here or at `close`); this state is then not saved.
        """
        if not force and round % self.every_rounds:
            return False
        with self._lock:
            self._raise_unreported()  # waits for the previous save
            if self.latest_round() == round:
                return False
            if self.multi_process:  # every process writes its shards, here (orbax's saves are collectives)
                self._save_in_background(round, [state])
                return True
            host = _host(state, frozen_numpy)
            # passed in a list that the writer empties, so that the snapshot is freed once written
            self._last = self._unreported = _WRITER.submit(self._save_in_background, round, [host])
        return True  # the caller only pays for the host copy

    def _write(self, round: int, host_state: Any) -> None:
        """Writes the checkpoint of `round` and returns once it is complete; raises if it cannot.

        Runs on the writer thread, never two at once (on the calling thread of every process of a multi-process
        island, where the checksums are a collective). The one place the files are written, with each leaf's
        checksum (`describe_leaves`) in the step's metadata: a test replaces it to make a save fail.
        """
        metadata = {LEAVES: describe_leaves(host_state)}
        if not self._manager.save(round, args=ocp.args.PyTreeSave(host_state), force=True, custom_metadata=metadata):
            raise CheckpointError(f"orbax did not save round {round} in {self.directory}")
        self._manager.wait_until_finished()

    def _save_in_background(self, round: int, holder: list) -> None:
        """Writes the state in the one-element list `holder`, which it empties: a snapshot nobody else holds is
        then freed once written, and its memory given back to the kernel (`allocator.trim`)."""
        state = holder.pop()
        try:
            try:
                self._write(round, state)
            finally:
                del state  # written or not, the snapshot is freed (an error's traceback would keep it)
            allocator.trim()
        except Exception as e:
            self._reopen(round)
            newest = self.latest_round()
            resume = (
                f"the newest complete checkpoint is round {newest}, which a restart resumes from"
                if newest is not None
                else "there is no complete checkpoint, so a restart starts from the beginning"
            )
            error = CheckpointError(
                f"saving the checkpoint of round {round} in {self.directory} failed ({type(e).__name__}: {e}); "
                f"{resume}"
            )
            logging.error("%s", error)
            raise error from e
        self._complete = sorted(self._manager.all_steps())

    def _reopen(self, failed_round: int) -> None:
        """After a failed save: removes what it left (its temporary folder) and opens a fresh manager, which
        reads the complete checkpoints from the folder.

        Orbax's manager raises a failed save's error again in every thread that
        waits on it, so the old one cannot close cleanly; it is dropped.
        """
        old = self._manager
        try:
            old.close()
        except Exception:  # the failed save's error once more
            pass
        try:
            leftovers = [n for n in os.listdir(self.directory) if n.startswith(f"{failed_round}{_TMP_SUFFIX}")]
        except OSError:
            leftovers = []
        for name in leftovers:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        try:
            self._manager = self._open_manager()
        except Exception:  # the folder cannot be read now: the old manager still restores what it knew
            logging.exception("cannot reopen the checkpoints in %s", self.directory)
            self._complete = [r for r in self._complete if r != failed_round]
            return
        self._complete = sorted(self._manager.all_steps())

    def check(self) -> None:
        """Raises the error of a background save that has failed and was not raised yet (without waiting for a
        save in progress): how a role notices a failed save before its next one.

        Raises:
          CheckpointError: the save failed (raised once, here, at the next `save` or at `close`).
        """
        with self._lock:
            if self._unreported is not None and self._unreported.done():
                self._raise_unreported()

    def discard_after(self, round: int) -> list[int]:
        """Deletes the complete checkpoints of rounds after `round` (waiting for a save in progress first): a
        role that rolled back to `round`, or took the coordinator's state there, saves those rounds again.

        Returns:
          The rounds deleted.
        """
        with self._lock:
            if self._last is not None:
                futures.wait([self._last])
            newer = [r for r in self._complete if r > round]
            for r in newer:
                self._manager.delete(r)
            self._complete = [r for r in self._complete if r <= round]
            return newer

    def _raise_unreported(self) -> None:
        """Waits for the save in progress and raises its error, once."""
        pending, self._unreported = self._unreported, None
        if pending is not None:
            pending.result()

    def restore(self, like: Any, round: int | None = None) -> Any:
        """The state saved at `round` (default: the newest intact checkpoint), shaped like `like`, as NumPy arrays
        (arrays of several processes as `jax.Array`s), each leaf checked against its saved checksum.

        Without `round`, a damaged checkpoint (`CheckpointCorrupt`) is logged as an error, moved aside to
        `<round>.damaged`, and the next older one is tried, down to the oldest kept. Waits first for a save in
        progress, so the checkpoint being written can be restored once it is complete; that save's error, if
        any, is left for the next `save` or `close` to raise.

        Raises:
          CheckpointCorrupt: the checkpoint of `round` is damaged (it is moved aside), or, without `round`,
            every kept checkpoint is (each one named).
          CheckpointError: no complete checkpoint (of `round`), or one whose structure, dtypes or shapes differ
            from `like` (a checkpoint of another model or optimizer).
        """
        with self._lock:
            if self._last is not None:
                futures.wait([self._last])
            if round is not None:
                try:
                    return self._restore(like, round)
                except CheckpointCorrupt as e:
                    moved = self._set_aside([round])
                    logging.error("%s; it is moved aside to %s", e, moved[0])
                    raise
            if not self._complete:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            damaged: list[tuple[int, str]] = []
            for r in reversed(list(self._complete)):
                try:
                    restored = self._restore(like, r)
                except CheckpointCorrupt as e:
                    damaged.append((r, str(e)))
                    logging.error("%s; the previous checkpoint is tried", e)
                    continue
                if damaged:  # set aside only once an older one restored: a failure of every one moves nothing
                    moved = self._set_aside([d for d, _ in damaged])
                    logging.warning("restored the checkpoint of round %d in %s, the newest intact one; the damaged "
                                    "ones are kept as %s", r, self.directory, ", ".join(moved))
                return restored
            raise CheckpointCorrupt(
                f"no intact checkpoint in {self.directory}: {'; '.join(m for _, m in damaged)}. Nothing was moved; "
                "if the cause passes (memory, a storage error), start again; otherwise start the run again in a new "
                "--workdir, or restore these files from a copy"
            )

    def _set_aside(self, rounds: list[int]) -> list[str]:
        """Moves the damaged checkpoints of `rounds` to `<round>.damaged` (`<round>.damaged.N` when that name is
        taken: none is deleted) and opens a fresh manager, which no longer counts them; returns the new names.
        Of a multi-process island, process 0 moves them and the others wait for it (a collective).

        Raises:
          OSError: a folder cannot be renamed.
        """
        names = []
        for round in rounds:
            src = os.path.join(self.directory, str(round))
            dst, n = src + DAMAGED_SUFFIX, 1
            while os.path.exists(dst):
                dst, n = f"{src}{DAMAGED_SUFFIX}.{n}", n + 1
            if os.path.isdir(src) and (not self.multi_process or jax.process_index() == 0):
                os.replace(src, dst)
            names.append(os.path.basename(dst))
        if self.multi_process:  # every process reopens once process 0 moved them
            from island_jax import distributed

            distributed.allgather_json(names)
        self._manager.close()
        self._manager = self._open_manager()
        self._complete = sorted(self._manager.all_steps())
        return names

    def _saved_leaves(self, round: int) -> dict | None:
        """The checkpoint's `describe_leaves` record, or None for one written without it.

        Raises:
          CheckpointCorrupt: its step metadata cannot be read.
        """
        try:
            custom = self._manager.metadata(round).custom_metadata or {}
        except Exception as e:
            raise CheckpointCorrupt(
                f"the checkpoint of round {round} in {os.path.join(self.directory, str(round))} is damaged: its "
                f"metadata cannot be read ({type(e).__name__}: {e})"
            ) from e
        return custom.get(LEAVES)

    def _restore(self, like: Any, round: int) -> Any:
        if round not in self._complete:
            raise CheckpointError(
                f"no complete checkpoint of round {round} in {self.directory}; the complete ones are of rounds "
                f"{self._complete}"
            )
        where = os.path.join(self.directory, str(round))
        saved = self._saved_leaves(round)
        like = _abstract(like)
        flat_like = jax.tree_util.tree_flatten_with_path(like)[0]
        if saved is not None:  # the structure is known before reading: a difference is another run's checkpoint
            ours = {jax.tree_util.keystr(p): [np.dtype(a.dtype).name, list(a.shape)] for p, a in flat_like}
            theirs = {k: v[1:] for k, v in saved.items()}
            if ours != theirs:
                leaf = sorted(set(ours) ^ set(theirs)) or [k for k in ours if ours[k] != theirs[k]]
                raise CheckpointError(
                    f"the checkpoint of round {round} in {self.directory} does not fit this run's model and "
                    f"optimizer (first difference: {leaf[0]}: saved {theirs.get(leaf[0])}, this run "
                    f"{ours.get(leaf[0])}); resume with the config that wrote it, or pass a new --workdir"
                )
        error = None
        try:
            restored = self._manager.restore(
                round, args=ocp.args.PyTreeRestore(like, restore_args=ocp.checkpoint_utils.construct_restore_args(like))
            )
        except Exception as e:  # orbax raises several types for a mismatched tree, and for damaged files
            error = e
        if self.multi_process and saved is not None:  # every process decides alike (what follows is a collective)
            from island_jax import distributed

            told = [t for t in distributed.allgather_json(None if error is None else f"{type(error).__name__}: {error}")
                    if t is not None]
            if told and error is None:
                raise CheckpointCorrupt(f"the checkpoint of round {round} in {where} is damaged: orbax cannot read "
                                        f"another process's part of it ({told[0]})")
        if error is not None:
            e = error
            if saved is not None:
                raise CheckpointCorrupt(
                    f"the checkpoint of round {round} in {where} is damaged: orbax cannot read it "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise CheckpointError(
                f"the checkpoint of round {round} in {self.directory} does not fit this run's model and optimizer "
                f"({type(e).__name__}: {e}); resume with the config that wrote it, or pass a new --workdir"
            ) from e
        restored_leaves = jax.tree.leaves(restored)
        for (path, a), b in zip(flat_like, restored_leaves, strict=True):
            if a.shape != np.shape(b) or a.dtype != b.dtype:
                raise CheckpointError(
                    f"the checkpoint of round {round} in {self.directory} holds {jax.tree_util.keystr(path)} as "
                    f"{b.dtype}{list(b.shape)} but this run has {a.dtype}{list(a.shape)}; resume with the config that "
                    "wrote it, or pass a new --workdir"
                )
        restored = jax.tree.map(lambda x: x if _spans_processes(x) else np.asarray(x), restored)
        if saved is None:
            logging.warning("the checkpoint of round %d in %s holds no checksums (written by an earlier version): "
                            "restored without checking its bits", round, self.directory)
            return restored
        verify_leaves(restored, saved, f"the checkpoint of round {round} in {where}")
        return restored

    def close(self) -> None:
        """Waits for the save in progress, then closes the manager; a second call does nothing.

        Raises:
          CheckpointError: that save (or an earlier one not yet reported by
            `save`) failed; the manager is closed all the same.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._raise_unreported()
            finally:
                self._manager.wait_until_finished()
                self._manager.close()
