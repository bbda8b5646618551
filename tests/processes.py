"""Roles of a multi-process run started by hand (`experiments/train.py --role=...`), as an operator or a
cluster scheduler would, so that a test decides when each one dies and when it comes back.

`run_dir` (a fixture: import it into the test module) makes a `Run` in the test's folder with the tiny
corpus; `Run.start("a/1")` starts process 1 of a multi-process island a.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from tiny_config import write_corpus

from island_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


class Run:
    """The roles of one run in `workdir`, each a process logging to `workdir/ROLE.log`."""

    def __init__(self, workdir, config: str, overrides: list[str], port: int):
        self.workdir, self.config, self.overrides = workdir, config, overrides
        self.address = f"localhost:{port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": TESTS}
        self.island_coordinators: dict[str, str] = {}  # of the islands of several processes

    def start(self, role: str) -> subprocess.Popen:
        """Starts "coordinator", island "NAME", or process I of island NAME of several ("NAME/I")."""
        name, _, process = role.partition("/")
        which = ["--role=coordinator"] if role == "coordinator" else ["--role=island", f"--island={name}"]
        if process:
            address = self.island_coordinators.setdefault(name, f"localhost:{free_port()}")
            which += [f"--process_id={process}", f"--island_coordinator={address}"]
        cmd = [sys.executable, "-u", os.path.join(ROOT, "experiments", "train.py"), f"--config={self.config}",
               f"--workdir={self.workdir}", f"--coordinator={self.address}", *self.overrides, *which]
        log = open(self.workdir / f"{role.replace('/', '.')}.log", "a")
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self.procs[role]

    def kill(self, role: str) -> None:
        self.procs.pop(role).send_signal(signal.SIGKILL)

    def log(self, role: str) -> str:
        return (self.workdir / f"{role.replace('/', '.')}.log").read_text()

    def records(self, role: str, kind: str = "round") -> list[dict]:
        folder = self.workdir / ("coordinator" if role == "coordinator" else f"islands/{role.partition('/')[0]}")
        path = folder / "metrics.jsonl"
        return [r for r in read_jsonl(path) if r["kind"] == kind] if path.exists() else []

    def wait_for(self, what, timeout: float = 240.0, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            failed = {r: p.returncode for r, p in self.procs.items() if p.poll() not in (None, 0)}
            assert not failed and time.monotonic() < deadline, (failed, self.tails())
            time.sleep(poll)

    def finish(self, timeout: float = 300.0) -> None:
        for role, p in self.procs.items():
            assert p.wait(timeout=timeout) == 0, (role, self.tails())

    def tails(self) -> str:
        return "\n".join(f"--- {r}\n{self.log(r)[-2500:]}" for r in self.procs)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_dir(tmp_path):
    runs = []

    def make(config: str, *overrides: str) -> Run:
        files = write_corpus(tmp_path / "corpus")
        run = Run(tmp_path / f"run{len(runs)}", config, [f"--config.data.files={files}", *overrides], free_port())
        run.workdir.mkdir()
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop()


def checkpointed(run: Run, role: str, round: int) -> bool:
    """Whether `role` holds a complete checkpoint of `round` (orbax renames it into place once complete)."""
    folder = run.workdir / ("coordinator" if role == "coordinator" else f"islands/{role}") / "checkpoints"
    return (folder / str(round)).is_dir()


def latest(records: list[dict]) -> dict[int, dict]:
    """The newest record of each round (a round trained again after a restart is logged again)."""
    return {r["round"]: r for r in records}




def rejoined_round(log: str) -> int:
    """The round an island rejoined the run at, from its log (which says so once)."""
    joined = re.findall(r"rejoined the run at round (\d+)", log)
    assert len(joined) == 1, joined
    return int(joined[0])


def merged_and_rejoined(run: Run, role: str, rounds: int, resumed_at: int) -> tuple[dict[int, dict], int]:
    """After `run.finish()`: checks that the coordinator merged every one of `rounds` rounds and that `role`
    resumed from its checkpoint of round `resumed_at`; returns (the newest record of each merged round, the
    round `role` rejoined the run at)."""
    merged = latest(run.records("coordinator"))
    assert sorted(merged) == list(range(1, rounds + 1))
    log = run.log(role)
    assert f"resumed from the checkpoint of round {resumed_at}" in log
    return merged, rejoined_round(log)
