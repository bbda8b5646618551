"""Progress of a run: the ETA, and one line per round gathered from every island's metrics.

Both ways of running print the same lines: the in-process run (`island_jax.run`)
and the multi-process launcher (`launch/local.py`) poll a `Progress` over the
workdir's `islands/NAME/metrics.jsonl` files.
"""

from __future__ import annotations

import json
import os
import time

from island_jax.workdir import island_dir


def format_eta(seconds: float) -> str:
    """Seconds as "MmSSs", for progress lines."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


class Eta:
    """Time left to the last round, from the rounds after the first one seen (which carries compilation).

    Args:
      rounds: rounds in the run.
      clock: seconds (`time.perf_counter`).
    """

    def __init__(self, rounds: int, clock=time.perf_counter):
        self.rounds, self.clock = rounds, clock
        self._from: tuple[int, float] | None = None  # (round, when it ended)

    def after(self, round: int) -> str:
        """The ETA once `round` (1-based, completed) ended: "after round N" until two rounds are seen ("0m00s"
        once the last round ended)."""
        now = self.clock()
        if round >= self.rounds:
            return format_eta(0.0)
        if self._from is None or round <= self._from[0]:
            self._from = (round, now)
            return f"after round {round + 1}"
        done, since = round - self._from[0], now - self._from[1]
        return format_eta(since / done * (self.rounds - round))


class Progress:
    """One line per round, once every island has logged it (read from the islands' metrics.jsonl).

    Args:
      workdir: the run's workdir.
      names: the islands (`config.islands` keys).
      rounds: rounds in the run.
    """

    def __init__(self, workdir: str, names: list[str], rounds: int):
        self.paths = {n: os.path.join(island_dir(workdir, n), "metrics.jsonl") for n in names}
        self.offsets = dict.fromkeys(names, 0)
        self.rounds_seen: dict[int, dict[str, dict]] = {}
        self.names, self.rounds = names, rounds
        self.next_round: int | None = None
        self.eta = Eta(rounds)
        self.eval_loss = None

    def _read(self) -> None:
        for name, path in self.paths.items():
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                f.seek(self.offsets[name])
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break
                    self.offsets[name] = f.tell()
                    try:
                        rec = json.loads(line)
                    except ValueError:  # a line torn by a crash mid-write: read_jsonl skips it too
                        continue
                    if rec.get("kind") == "round":
                        self.rounds_seen.setdefault(rec["round"], {})[name] = rec

    def poll(self) -> list[str]:
        """The lines of the rounds every island has completed (or gone past: a restarted island that rejoined
        later, shown as "-") since the last call."""
        self._read()
        lines = []
        latest = {n: max((r for r, recs in self.rounds_seen.items() if n in recs), default=0) for n in self.names}
        while True:
            if self.next_round is None:
                if not self.rounds_seen:
                    return lines
                self.next_round = min(self.rounds_seen)
            recs = self.rounds_seen.get(self.next_round, {})
            if not recs or any(n not in recs and latest[n] <= self.next_round for n in self.names):
                return lines
            lines.append(self._line(self.next_round, recs))
            self.next_round += 1

    def _line(self, r: int, recs: dict[str, dict]) -> str:
        eta = self.eta.after(r)
        for rec in recs.values():
            self.eval_loss = rec.get("eval_loss", self.eval_loss)

        def each(fmt, key, default=None) -> str:
            return " ".join(
                f"{n}={fmt.format(recs[n].get(key, default))}" if n in recs else f"{n}=-" for n in self.names
            )

        return (
            f"round {r}/{self.rounds} | loss " + each("{:.4f}", "train_loss")
            + (f" | eval {self.eval_loss:.4f}" if self.eval_loss is not None else "")
            + " | sent/received " + " ".join(
                f"{n}={recs[n]['bytes_sent'] / 1e6:.2f}/{recs[n]['bytes_received'] / 1e6:.2f}" if n in recs else f"{n}=-"
                for n in self.names
            ) + " MB"
            + " | blocked " + each("{:.2f}s", "seconds_blocked")
            + " | link " + each("{:.2f}Gbit/s", "achieved_gbps", 0.0)
            + " | utilization " + each("{:.2f}", "compute_utilization", 0.0)
            + " | MFU " + " ".join(f"{n}={100 * recs[n].get('mfu', 0.0):.2f}%" if n in recs else f"{n}=-"
                                   for n in self.names)
            + f" | ETA {eta}"
        )
