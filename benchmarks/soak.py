"""A multi-process run under the supervisor with a seeded schedule of faults: does it survive, bit for bit?

  python benchmarks/soak.py [--rounds=30] [--seed=0] [--faults=8] [--coordinator_shards=2] [--smoke]

The two_islands config at the size of the test model (one layer, d_model 32,
4 experts, H = 4), `--rounds` rounds, runs under `launch/local.py --restart`:
the coordinator and each island in its own process, the islands dialling the
coordinator through a `comm.proxy.FaultProxy`. With `outer.min_islands = 1`
and a grace window of 2 s, an island that dies leaves the other to go on
alone until it is back. The islands retry a lost coordinator at most 1 s
apart (`comm.reconnect_backoff_cap_seconds`; the runs' default is 8 s). Checkpoints every 2 rounds, so a coordinator restart
may redo up to 2 + 2 rounds (docs/faults.md).

The schedule (seeded) holds `--faults` faults at rounds drawn from the run's
middle, cycling through four kinds:
  kill_island       SIGKILL of a random island (the supervisor starts it again)
  kill_coordinator  SIGKILL of the coordinator (the supervisor starts it again)
  reset             every connection through the proxy reset mid-stream
  corrupt           one bit flipped in the islands' upstream bytes
A fault fires once the coordinator has merged its round; the next waits for
the run to move past it.

With `--coordinator_shards=2` the coordinator is cut into two shards by
chunk range (`coordinator.shards = 2`, and `comm.chunk_bytes = 8192`, so
that the payload's 8 chunks give both shards a range: 5 and 3): the
launcher starts `coordinator/0` and `coordinator/1`, one restart group,
shard k on port `--port` + k, each behind a `FaultProxy` of its own. `kill_coordinator` becomes
  kill_shard        SIGKILL of one shard, drawn at random, at a random point
                    of the next round: a uniform fraction of a round's
                    seconds (the median of the last 5) after the merge,
                    in whatever phase the round is then (the supervisor stops
                    the other shard and starts both again; they resume
                    from the newest checkpoint set they all hold)
and a reset or a corrupted bit hits the connections to one shard, drawn at
random.

With `--island_processes=2` island a runs as two processes (fsdp over both),
and `kill_island` kills one of them (the launcher restarts the island's
processes together) or island b.

With `--every_island_needed` (`outer.min_islands = 0`, so no round merges
without an island), the same config then runs once more without faults, and
`bitwise` says whether the faulted run ended on its bits: every round's view
checksum (the coordinator's last merge of it) and the final eval loss equal.
A killed island replays the rounds it missed (`outer.rejoin = "replay"`).

Printed: `faults` (fired, by kind), `rounds_completed`, `rounds_lost`
(coordinator rounds merged again after its restarts, counted from its
metrics: records of a round beyond its first), `bound` (k + 2 per
coordinator restart, with k = 2), `diverged` (rounds in which the global
parameters an island held after the round, by their checksum, are none of the
coordinator's views of that round: the island's latest round record, or its
`rejoin` record where it took the view or rolled back there; a round merged
again after a coordinator restart has two views, and an island that held the
first and then took a later round's view held no other; it must be 0) and
`wall_seconds`. Last line:
`soak: faults=F rounds_lost=L diverged=D` (and ` bitwise=true|false` with `--every_island_needed`).

`--smoke` runs 10 rounds with 4 faults, one of each kind (`--rounds=10
--faults=4`): the same code path and printout; it takes as long as the
roles' restarts (tens of seconds; a minute or two with shards), and its
figures are not measurements.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import _children
import _smoke
from absl import app, flags

from island_jax.comm.proxy import FaultProxy
from island_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ROUNDS = flags.DEFINE_integer("rounds", 30, "Rounds of the run.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the fault schedule.")
_FAULTS = flags.DEFINE_integer("faults", 8, "Faults in the schedule (at least 6; with --smoke, at least 4).")
_WORKDIR = flags.DEFINE_string("workdir", "", "The run's folder (default: a new temporary one).")
_SHARDS = flags.DEFINE_integer("coordinator_shards", 1, "coordinator.shards: with more than 1, the coordinator's "
                               "faults kill one shard process (kill_shard).", lower_bound=1)
_PROCESSES = flags.DEFINE_integer("island_processes", 1, "Processes of island a (1 or 2: fsdp over both); with 2, "
                                  "kill_island kills one process of a, or b.", lower_bound=1, upper_bound=2)
_NEEDED = flags.DEFINE_bool("every_island_needed", False, "outer.min_islands=0, and a run of the same config "
                            "without faults to compare with: prints bitwise=true|false.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

KINDS = ("kill_island", "kill_coordinator", "reset", "corrupt")
SHARD_KINDS = ("kill_island", "kill_shard", "reset", "corrupt")  # with --coordinator_shards above 1
# the test model's 34,560-byte int8 payload in 8 chunks, so that both shards own some (5 and 3; at the default
# 1 MiB it is one chunk, and shard 1 would own none)
SHARD_OVERRIDES = ["--config.comm.chunk_bytes=8192"]
EVERY = 2  # checkpoint.every_rounds (and the coordinator's)
OVERRIDES = [
    "--config.model.num_layers=1", "--config.model.d_model=32", "--config.model.num_heads=2",
    "--config.model.seq_len=32", "--config.moe.num_experts=4", "--config.moe.expert_hidden_dim=32",
    "--config.islands.a.inner_steps=4", "--config.islands.b.inner_steps=4",
    "--config.eval.batch_size=4", "--config.eval.num_windows=8", "--config.eval.every_rounds=10",
    "--config.outer.min_islands=1", "--config.outer.grace_seconds=2",
    f"--config.checkpoint.every_rounds={EVERY}",
    "--config.comm.link.bandwidth_gbps=1", "--config.comm.link.latency_ms=100",
    "--config.comm.reconnect_seconds=120",
    "--config.comm.reconnect_backoff_cap_seconds=1",  # retries of a lost coordinator at most 1 s apart
]


class Launch:
    """`launch/local.py` in a child process: its output to a log file, the roles' current pids from it."""

    def __init__(self, workdir: str, rounds: int, port: int, dial: str | None, shards: int = 1, extra=()):
        self.log_path = os.path.join(workdir, "launch.log")
        cmd = [
            sys.executable, os.path.join(ROOT, "launch", "local.py"),
            f"--config={os.path.join(ROOT, 'experiments', 'configs', 'two_islands.py')}", f"--workdir={workdir}",
            f"--config.outer.rounds={rounds}", *OVERRIDES, *(SHARD_OVERRIDES if shards > 1 else []), *extra,
            f"--config.coordinator.shards={shards}", "--restart=20", f"--port={port}",
            *([f"--dial={dial}"] if dial else []),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pids: dict[str, int] = {}
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                # a role started, restarted after it exited, or restarted with its group (a shard of the coordinator)
                m = re.match(r"\[launch\] (?:started (.+?) \(pid (\d+)\)|(.+?) (?:exited .*|was stopped with it); "
                             r"restarting it .*pid (\d+)\))", line)
                if m:
                    role, pid = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                    self.pids[role] = int(pid)

    def kill(self, role: str) -> None:
        os.kill(self.pids[role], signal.SIGKILL)

    def wait(self) -> int:
        code = self.proc.wait()
        self._thread.join(timeout=10)
        return code


def _merged(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "coordinator", "metrics.jsonl")
    return [r for r in read_jsonl(path) if r.get("kind") == "round"] if os.path.exists(path) else []


def _held(workdir: str, name: str) -> dict[int, str]:
    """{round: checksum of the global parameters island `name` held after it}, from its metrics in order: a
    `rejoin` record (the island took the coordinator's view, or rolled back to its own checkpoint, at its round)
    replaces what the island logged of that round and later."""
    held = {}
    for rec in read_jsonl(os.path.join(workdir, "islands", name, "metrics.jsonl")):
        if rec.get("kind") == "rejoin":
            held = {r: c for r, c in held.items() if r < rec["round"]}
        if rec.get("kind") in ("round", "rejoin"):
            held[rec["round"]] = rec["checksum"]
    return held


def _views(workdir: str) -> dict[int, str]:
    """{round: the view checksum of the coordinator's last merge of it} (fragment 0's record)."""
    return {r["round"]: r["checksum"] for r in _merged(workdir) if r.get("fragment", 0) == 0}


def _summary(workdir: str) -> dict:
    """The run's combined summary (`workdir.combine_summaries`); {} when there is none."""
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def schedule(rounds: int, faults: int, seed: int, kinds_of: tuple[str, ...] = KINDS) -> list[tuple[int, str]]:
    """(round to fire after, kind) per fault: rounds drawn without repeats from the run's middle, kinds
    (`kinds_of`) cycled in an order the seed shuffles."""
    rng = random.Random(seed)
    kinds = [kinds_of[i % len(kinds_of)] for i in range(faults)]
    rng.shuffle(kinds)
    at = sorted(rng.sample(range(3, rounds - 3), faults))
    return list(zip(at, kinds))


def free_ports(n: int) -> int:
    """A port P of localhost with P .. P + n - 1 free now (the coordinator's shards listen on them)."""
    for _ in range(100):
        port = _children.free_port()
        if port + n <= 65536 and all(_free(port + k) for k in range(1, n)):
            return port
    raise RuntimeError(f"found no {n} consecutive free ports on localhost in 100 tries")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
        return True


def main(argv):
    del argv
    least = len(KINDS) if _smoke.sizes(rounds=10, faults=4) else 6  # smoke: every kind once
    shards = _SHARDS.value
    kinds = KINDS if shards == 1 else SHARD_KINDS
    if _FAULTS.value < least or _ROUNDS.value < _FAULTS.value + 6:
        sys.exit(f"--faults must be at least {least} and --rounds at least faults + 6")
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(_SEED.value + 1)
    port = free_ports(shards)
    plan = schedule(_ROUNDS.value, _FAULTS.value, _SEED.value, kinds)
    sharded = f" with {shards} coordinator shards" if shards > 1 else ""
    print(f"soak: {_ROUNDS.value} rounds in {workdir}{sharded}; faults at {plan}", flush=True)
    start = time.perf_counter()
    fired = collections.Counter()
    extra = ["--config.outer.min_islands=0"] if _NEEDED.value else []
    victims = ["island a", "island b"]
    if _PROCESSES.value == 2:  # island a of two processes, fsdp over both: a kill may take one of them
        extra += ["--config.islands.a.num_processes=2", "--config.islands.a.devices_per_process=2",
                  "--config.islands.a.mesh.data=1", "--config.islands.a.mesh.fsdp=2"]
        victims = ["island a/0", "island a/1", "island b"]
    with contextlib.ExitStack() as stack:  # one proxy per shard: shard k on port + k
        proxies = [stack.enter_context(FaultProxy(f"localhost:{port + k}")) for k in range(shards)]
        launch = Launch(workdir, _ROUNDS.value, port, ",".join(p.address for p in proxies), shards, extra)
        for at, kind in plan:
            while (max((r["round"] for r in _merged(workdir)), default=0) < at) and launch.proc.poll() is None:
                time.sleep(0.2)
            if launch.proc.poll() is not None:
                break
            proxy, what = rng.choice(proxies), kind
            if kind == "kill_island":
                what = f"kill_island ({rng.choice(victims)})"
                launch.kill(what[len("kill_island ("):-1])
            elif kind == "kill_coordinator":
                launch.kill("coordinator")
            elif kind == "kill_shard":
                shard, fraction = rng.randrange(shards), rng.random()
                delay = fraction * statistics.median(r["seconds"] for r in _merged(workdir)[-5:])  # a round's time
                time.sleep(delay)
                launch.kill(f"coordinator/{shard}")
                what = f"kill_shard (coordinator/{shard}, {delay:.2f} s after the merge, {fraction:.2f} of a round)"
            elif kind == "reset":
                proxy.reset_after(rng.randint(2_000, 40_000))
            else:
                proxy.corrupt_after(rng.randint(2_000, 40_000), bit=rng.randint(0, 7))
            fired[kind] += 1
            print(f"soak: round {at}: {what}", flush=True)
        code = launch.wait()
    wall = time.perf_counter() - start
    if code != 0:
        sys.exit(f"soak: the launcher exited with status {code}; see {launch.log_path}")

    merged = _merged(workdir)
    views = collections.defaultdict(set)  # round -> the coordinator's views of it (one more per time it merged it)
    for r in merged:
        if r.get("fragment", 0) == 0:
            views[r["round"]].add(r["checksum"])
    counts = collections.Counter(r["round"] for r in merged if r.get("fragment", 0) == 0)
    rounds_lost = sum(n - 1 for n in counts.values())
    diverged = 0
    for name in ("a", "b"):
        diverged += sum(checksum not in views[r] for r, checksum in _held(workdir, name).items())
    restarts = fired["kill_coordinator"] + fired["kill_shard"]  # a shard's kill restarts every shard
    print(f"faults: {sum(fired.values())} ({', '.join(f'{k} {fired[k]}' for k in kinds)})")
    print(f"rounds_completed: {max(views, default=0)} of {_ROUNDS.value}")
    print(f"rounds_lost: {rounds_lost} (bound: {restarts} coordinator restarts x (k + 2 = {EVERY + 2}) = "
          f"{restarts * (EVERY + 2)})")
    print(f"diverged: {diverged}")
    print(f"wall_seconds: {wall:.1f}")
    last = f"soak: faults={sum(fired.values())} rounds_lost={rounds_lost} diverged={diverged}"
    if _NEEDED.value:  # the same config without faults: the bits the faulted run must end on
        straight = os.path.join(workdir, "uninterrupted")
        os.makedirs(straight, exist_ok=True)
        again = Launch(straight, _ROUNDS.value, free_ports(shards), None, shards, extra)
        if again.wait() != 0:
            sys.exit(f"soak: the uninterrupted run failed; see {again.log_path}")
        faulted, uninterrupted = _summary(workdir), _summary(straight)
        loss, want = faulted.get("eval_loss_final"), uninterrupted.get("eval_loss_final")
        same_views, same_loss = _views(workdir) == _views(straight), loss is not None and loss == want
        replayed = {n: rec.get("rounds_replayed", 0) for n, rec in faulted.get("islands", {}).items()}
        print(f"rounds_replayed: {replayed}")
        print(f"views equal the uninterrupted run's: {same_views}; final eval loss {loss!r} against {want!r}")
        last += f" bitwise={'true' if same_views and same_loss else 'false'}"
    print(last)


if __name__ == "__main__":
    app.run(main)
