"""What the coordinator keeps so that a restarted island can replay the rounds it missed (`KeptUpdates`).

After each merge of round r of fragment p the coordinator writes, in its workdir (`coordinator/kept/`):

  ROUND-FRAGMENT.update  the update it served that round: its chunks in the update codec, in chunk order (of a
                         coordinator shard, the chunks of its range only)
  ROUND-FRAGMENT.json    the round's record: every contributor's tokens, tau (`outer.overlap_steps = "auto"`
                         only; else null) and the SHA-256 of each chunk of its contribution, as merged (`protocol.chunk_digest`)

The record is written last (each file to a temporary name, then renamed), so a record names an update that is
whole. The files survive a coordinator restart; a restored coordinator discards those of the rounds it merges
again (`discard_from`). Rounds older than the oldest checkpoint any island may still hold are pruned
(`replay_window`). An island restarted from its checkpoint of round r0 recomputes rounds r0 + 1.. and checks
each recomputed chunk against the digest here (`island.replay`); it applies the update kept here.
"""

from __future__ import annotations

import json
import os

import ml_collections

from island_jax.workdir import checkpoint_schedule, island_saves

KEPT = "kept"  # the coordinator folder's subfolder of kept updates


def replay_window(config: ml_collections.ConfigDict, rounds_done: int) -> int:
    """The oldest round an island may still restart from when the coordinator has completed `rounds_done`
    rounds: the oldest of the `max_to_keep` checkpoints an island keeps (`workdir.checkpoint_schedule`: also
    those a fallback past a damaged checkpoint takes), or 0 (the seeded start). Updates of rounds from it on
    (0-based) are kept."""
    return _oldest_save(rounds_done, *_saves(config))


def _saves(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
    """(the coordinator's checkpoint interval, an island's, the checkpoints an island keeps)."""
    coordinator_every, _ = checkpoint_schedule(config, coordinator=True)
    every, keep = checkpoint_schedule(config)
    return coordinator_every, every, keep


def _oldest_save(rounds_done: int, coordinator_every: int, every: int, keep: int) -> int:
    """`replay_window` from the checkpoint schedule (`_saves`)."""
    found = 0
    for r in range(rounds_done, 0, -1):
        if island_saves(r, coordinator_every, every):
            found += 1
            if found == keep:
                return r
    return 0


class KeptUpdates:
    """A coordinator's (or a coordinator shard's) kept updates and contribution digests, on disk in `folder`.

    Args:
      folder: where they are kept (`ROLE/kept`), created if missing.
      config: the run's config (the checkpoint schedule sets the window kept, `replay_window`).
    """

    def __init__(self, folder: str, config: ml_collections.ConfigDict):
        self.folder = folder
        self._saves = _saves(config)  # worked out once: it walks the schedule's pattern
        os.makedirs(folder, exist_ok=True)

    def _path(self, round: int, fragment: int, ext: str) -> str:
        return os.path.join(self.folder, f"{round:08d}-{fragment}.{ext}")

    def rounds(self) -> list[tuple[int, int]]:
        """(round, fragment) of every whole record kept, in order."""
        out = []
        for name in os.listdir(self.folder):
            stem, _, ext = name.partition(".")
            if ext == "json" and "-" in stem:
                r, f = stem.split("-", 1)
                if r.isdigit() and f.isdigit():
                    out.append((int(r), int(f)))
        return sorted(out)

    def keep(self, round: int, fragment: int, chunks: dict[int, bytes], contributors: dict[str, dict]) -> None:
        """Keeps the update of `round` (0-based) of `fragment` (`chunks`: index -> bytes, of this coordinator's
        range) and its contributors ({island: {"tokens", "tau", "chunks": {index: `digest`}}}); prunes what
        no island can need any more.

        Raises:
          OSError: the folder cannot be written (the coordinator's disk is full or gone).
        """
        order = sorted(chunks)
        update = self._path(round, fragment, "update")
        with open(update + ".tmp", "wb") as f:
            for k in order:
                f.write(chunks[k])
        os.replace(update + ".tmp", update)
        record = dict(round=round, fragment=fragment, chunks=order, sizes=[len(chunks[k]) for k in order],
                      contributors={n: dict(tokens=int(c["tokens"]), tau=c.get("tau"),
                                            chunks={str(k): d for k, d in sorted(c["chunks"].items())})
                                    for n, c in contributors.items()})
        path = self._path(round, fragment, "json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f, sort_keys=True)
        os.replace(path + ".tmp", path)
        self.prune(_oldest_save(round + 1, *self._saves))

    def chunks(self, round: int, fragment: int) -> dict[int, bytes] | None:
        """The kept update of `round` of `fragment`, chunk by chunk (None: not kept)."""
        try:
            with open(self._path(round, fragment, "json"), encoding="utf-8") as f:
                record = json.load(f)
            with open(self._path(round, fragment, "update"), "rb") as f:
                data = f.read()
        except (OSError, ValueError):
            return None
        out, at = {}, 0
        for k, n in zip(record["chunks"], record["sizes"]):
            out[k] = data[at : at + n]
            at += n
        return out if at == len(data) else None

    def records(self, island: str, after: int = 0) -> list[dict]:
        """What `island` replays with: per kept (round, fragment) from round `after` on, in order,
        {"round", "fragment", "merged_with": whether its contribution was merged, "tokens", "tau", "chunks"
        (index -> digest of its chunks, as merged)}."""
        out = []
        for r, f in self.rounds():
            if r < after:
                continue
            try:
                with open(self._path(r, f, "json"), encoding="utf-8") as fh:
                    record = json.load(fh)
            except (OSError, ValueError):
                continue
            mine = record["contributors"].get(island)
            out.append(dict(round=r, fragment=f, merged_with=mine is not None,
                            tokens=mine["tokens"] if mine else 0, tau=mine["tau"] if mine else None,
                            chunks=mine["chunks"] if mine else {}))
        return out

    def _remove(self, which) -> None:
        """Removes the kept (round, fragment)s for which `which(round, fragment)` holds (the record first)."""
        for r, f in self.rounds():
            if which(r, f):
                for ext in ("json", "update"):
                    try:
                        os.remove(self._path(r, f, ext))
                    except FileNotFoundError:
                        pass

    def prune(self, before: int) -> None:
        """Removes the updates of rounds before `before`."""
        self._remove(lambda r, f: r < before)

    def discard_from(self, fragment: int, round: int) -> None:
        """Removes `fragment`'s updates of `round` and later: a restored coordinator merges them again."""
        self._remove(lambda r, f: f == fragment and r >= round)
