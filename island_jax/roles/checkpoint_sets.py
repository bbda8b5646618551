"""The checkpoints of a coordinator of several shards, committed together.

Each shard saves its own range's state with orbax in its own folder (`workdir.coordinator_dir(workdir, k)`; orbax's
multi-process mode would write replicated NumPy trees from process 0 alone). A round's checkpoint set is used
only once every shard's part is durable: each shard says so when its save completes (`Shard.saved`), and shard 0
then writes the set's commit marker, an empty file `coordinator/commits/ROUND`, and says so (`Shard.committed`).
Until then the update two rounds past it is held, as a single coordinator holds it until its own save is complete.
A restarted shard job resumes every shard at the newest round committed and held by all of them (`restorable`);
the parts of rounds past it are discarded.
"""

from __future__ import annotations

import os
import time

from absl import logging

from island_jax.coordinator.shards import Shard
from island_jax.workdir import RoleFolder, coordinator_dir

SHARD_POLL_SECONDS = 0.02  # how often a shard looks at the others' progress while it waits


def commits_dir(workdir: str) -> str:
    """Where shard 0 writes the commit markers of checkpoint sets."""
    return os.path.join(coordinator_dir(workdir), "commits")


def committed_rounds(workdir: str) -> set[int]:
    """The rounds whose checkpoint set is committed (every shard's part was durable)."""
    path = commits_dir(workdir)
    return {int(n) for n in os.listdir(path) if n.isdigit()} if os.path.isdir(path) else set()


def restorable(shard: Shard, role: RoleFolder, workdir: str, timeout: float = 600.0) -> int | None:
    """The round every shard resumes at: the newest whose set is committed and whose part every shard holds
    (agreed through the bus), or None (a new run); this shard's parts of later rounds are discarded."""
    committed = committed_rounds(workdir)
    mine = [r for r in role.checkpoints.rounds() if r in committed]
    agreed = shard.agree_on_restore(mine, timeout)
    dropped = role.checkpoints.discard_after(-1 if agreed is None else agreed)
    if dropped:
        logging.warning("shard %d: its checkpoints of rounds %s belong to no committed set; discarded", shard.index,
                        dropped)
    return agreed


def hold(coordinator, saving: set[int]) -> None:
    """Holds back the updates past the oldest checkpoint being written (0-based: the update of index R + 1), or
    none; call it holding the endpoint's lock."""
    coordinator.hold_updates(min(saving) + 1 if saving else None)


class CheckpointSets:
    """The checkpoint sets of a shard in progress: `saving` holds the rounds being written (shared with the round
    loop), released once their set is committed."""

    def __init__(self, shard: Shard, workdir: str, coordinator, saving: set[int]):
        self.shard, self.workdir, self.coordinator, self.saving = shard, workdir, coordinator, saving

    def skipped(self, round: int) -> None:
        """This shard took no checkpoint of `round`: nor does any other (the set would never be whole)."""
        self.shard.skipped(round)

    def saved(self, round: int) -> None:
        """This shard's part of `round` is durable (called from the save's thread)."""
        self.shard.saved(round)

    def poll(self) -> bool:
        """Commits the sets every shard saved (on shard 0) and releases the rounds committed; whether any was
        (call it holding the endpoint's lock)."""
        released = False
        for r in sorted(self.saving):
            if self.shard.any_skipped(r):  # a shard took none: no set of this round, and nothing held for it
                self.saving.discard(r)
                released = True
                continue
            if self.shard.leader and not self.shard.is_committed(r) and self.shard.all_saved(r):
                os.makedirs(commits_dir(self.workdir), exist_ok=True)
                open(os.path.join(commits_dir(self.workdir), str(r)), "w").close()
                self.shard.committed(r)
                logging.info("the checkpoint set of round %d is committed (all %d shards)", r, self.shard.count)
            if self.shard.is_committed(r):
                self.saving.discard(r)
                released = True
        if released:
            hold(self.coordinator, self.saving)
        return released

    def finish(self, round: int, timeout: float, endpoint) -> None:
        """Waits (up to `timeout` s) until the set of the last round is committed.

        Raises:
          TimeoutError: it was not.
        """
        deadline = time.monotonic() + timeout
        with endpoint.lock:
            while self.poll() is not None and not (self.shard.is_committed(round) or self.shard.any_skipped(round)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the checkpoint set of round {round} was not committed within {timeout:g} s: a "
                                   "coordinator shard did not save its part (see its log)")
                endpoint.lock.wait(SHARD_POLL_SECONDS)
