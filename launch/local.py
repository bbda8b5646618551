"""Starts a multi-process run on this machine: the coordinator and one process per island.

  python launch/local.py --config=experiments/configs/two_islands.py --workdir=workdir/two_islands

Each role is `experiments/train.py --role=...` in its own process with its own
JAX runtime and virtual CPU devices, talking gRPC over localhost, exactly as a
cluster launch would. Their log lines are shown prefixed with the role
(`[coordinator]`, `[island a]`), and one progress line per round gathers the
islands' losses, bytes and the ETA. If any process fails, the others are
stopped and the launcher exits with that process's status; on success it
writes `WORKDIR/summary.json` from all roles. Overrides (`--config.a.b=v`, with
`=`) go to every role. Running it again with the same workdir resumes every
role from its newest checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (one subfolder per role).")
_HOST = flags.DEFINE_string("host", "localhost", "Host the coordinator listens on.")
_PORT = flags.DEFINE_integer("port", 0, "Port the coordinator listens on; 0 picks a free one.")
flags.mark_flags_as_required(["config", "workdir"])

TRAIN = Path(__file__).resolve().parents[1] / "experiments" / "train.py"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: receive SIGTERM if the launcher dies, so no role outlives it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _forward(prefix: str, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{prefix}] {line}")
            sys.stdout.flush()


class Progress:
    """Prints one line per round once every island has logged it (from their metrics.jsonl)."""

    def __init__(self, workdir: str, names: list[str], rounds: int):
        from island_jax.roles import island_dir

        self.paths = {n: os.path.join(island_dir(workdir, n), "metrics.jsonl") for n in names}
        self.offsets = dict.fromkeys(names, 0)
        self.rounds_seen: dict[int, dict[str, dict]] = {}
        self.names, self.rounds = names, rounds
        self.next_round, self.timed_from = None, None
        self.eval_loss = None

    def poll(self) -> list[str]:
        import json

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
                    rec = json.loads(line)
                    if rec.get("kind") == "round":
                        self.rounds_seen.setdefault(rec["round"], {})[name] = rec
        lines = []
        while True:
            if self.next_round is None:
                if not self.rounds_seen:
                    return lines
                self.next_round = min(self.rounds_seen)
            recs = self.rounds_seen.get(self.next_round, {})
            if len(recs) < len(self.names):
                return lines
            lines.append(self._line(self.next_round, recs))
            self.next_round += 1

    def _line(self, r: int, recs: dict[str, dict]) -> str:
        now = time.perf_counter()
        eta = "after round 2"
        if self.timed_from is None:
            self.timed_from = (r, now)
        elif r > self.timed_from[0]:
            from island_jax.metrics import format_eta

            done, since = r - self.timed_from[0], now - self.timed_from[1]
            eta = format_eta(since / done * (self.rounds - r))
        for rec in recs.values():
            self.eval_loss = rec.get("eval_loss", self.eval_loss)
        first = recs[self.names[0]]
        return (
            f"round {r}/{self.rounds} | loss "
            + " ".join(f"{n}={recs[n]['train_loss']:.4f}" for n in self.names)
            + (f" | eval {self.eval_loss:.4f}" if self.eval_loss is not None else "")
            + f" | sent/received per island {first['bytes_sent'] / 1e6:.2f}/{first['bytes_received'] / 1e6:.2f} MB"
            + f" | exchange {max(rec['exchange_seconds'] for rec in recs.values()):.1f} s | ETA {eta}"
        )


def main(argv):
    from island_jax import config as config_lib

    config, workdir = _CONFIG.value, _WORKDIR.value
    try:
        config_lib.validate(config)
    except config_lib.ConfigError as e:
        sys.exit(str(e))
    if not config.outer.enabled:
        sys.exit("outer.enabled is False: a run without the outer loop has no coordinator; "
                 "run it in one process with experiments/train.py")
    if os.path.exists(os.path.join(workdir, "summary.json")):
        sys.exit(f"{workdir} holds a finished run (summary.json); pass a new --workdir, or move that one away "
                 "first, so that nothing it holds is overwritten")
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    address = f"{_HOST.value}:{_PORT.value or _free_port(_HOST.value)}"
    del argv
    overrides = [a for a in sys.argv[1:] if a.startswith("--config")]  # the config and its overrides
    base = [sys.executable, "-u", str(TRAIN), f"--workdir={workdir}", f"--coordinator={address}", *overrides]
    roles = [("coordinator", base + ["--role=coordinator"])] + [
        (f"island {n}", base + ["--role=island", f"--island={n}"]) for n in config.islands.keys()
    ]
    lock = threading.Lock()
    procs, threads = {}, []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for role, cmd in roles:  # every process first: preexec_fn is only safe before threads start
        procs[role] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                       preexec_fn=_die_with_parent)
        print(f"[launch] started {role} (pid {procs[role].pid})", flush=True)
    for role, p in procs.items():
        threads.append(threading.Thread(target=_forward, args=(role, p.stdout, lock), daemon=True))
        threads[-1].start()
    progress = Progress(workdir, list(config.islands.keys()), config.outer.rounds)
    failed, failures = None, []
    try:
        while failed is None and any(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
            for line in progress.poll():
                with lock:
                    print(f"[launch] {line}", flush=True)
            failures = [(r, p.returncode) for r, p in procs.items() if p.poll() not in (None, 0)]
            failed = failures[0] if failures else None
    except KeyboardInterrupt:
        failed = ("launch", 130)
    if failed is not None:
        for role, code in failures if failed[0] != "launch" else [failed]:
            print(f"[launch] {role} exited with status {code}; stopping the other processes", flush=True)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in procs.values():
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in threads:
            t.join(timeout=5)
        sys.exit(failed[1] if failed[1] > 0 else 1)
    for t in threads:
        t.join(timeout=5)
    for line in progress.poll():
        print(f"[launch] {line}", flush=True)
    from island_jax.roles import combine_summaries

    summary = combine_summaries(config, workdir, time.perf_counter() - start)
    print(
        f"[launch] done in {summary['wall_seconds']:.1f} s: eval loss {summary['eval_loss_initial']:.4f} -> "
        f"{summary['eval_loss_final']:.4f} nats/byte; global parameters agree: {summary['checksums_agree']}; "
        f"summary in {os.path.join(workdir, 'summary.json')}",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
