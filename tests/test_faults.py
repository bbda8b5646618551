"""Faults in a multi-process run: an island killed and restarted rejoins; the coordinator restarts under islands.

The roles are started by hand (`experiments/train.py --role=...`), as an
operator or a cluster scheduler would, so that each test decides when a role
dies and when it comes back.
"""

import json
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

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

THREE = """
import tiny_config
from island_jax.config import island


def get_config():
    c = tiny_config.get_config()
    c.islands.c = island(2, 1, 2, 4, 2)
    return c
"""


class Run:
    """The roles of one run in `workdir`, each a process logging to `workdir/ROLE.log`."""

    def __init__(self, workdir, config: str, overrides: list[str], port: int):
        self.workdir, self.config, self.overrides = workdir, config, overrides
        self.address = f"localhost:{port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": TESTS}

    def start(self, role: str) -> subprocess.Popen:
        which = ["--role=coordinator"] if role == "coordinator" else ["--role=island", f"--island={role}"]
        cmd = [sys.executable, "-u", os.path.join(ROOT, "experiments", "train.py"), f"--config={self.config}",
               f"--workdir={self.workdir}", f"--coordinator={self.address}", *self.overrides, *which]
        log = open(self.workdir / f"{role}.log", "a")
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self.procs[role]

    def kill(self, role: str) -> None:
        self.procs.pop(role).send_signal(signal.SIGKILL)

    def log(self, role: str) -> str:
        return (self.workdir / f"{role}.log").read_text()

    def records(self, role: str, kind: str = "round") -> list[dict]:
        folder = self.workdir / ("coordinator" if role == "coordinator" else f"islands/{role}")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_dir(tmp_path):
    runs = []

    def make(config: str, *overrides: str) -> Run:
        files = write_corpus(tmp_path / "corpus")
        run = Run(tmp_path / f"run{len(runs)}", config, [f"--config.data.files={files}", *overrides], _free_port())
        run.workdir.mkdir()
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop()


def _checkpointed(run: Run, role: str, round: int) -> bool:
    """Whether `role` holds a complete checkpoint of `round` (orbax renames it into place once complete)."""
    folder = run.workdir / ("coordinator" if role == "coordinator" else f"islands/{role}") / "checkpoints"
    return (folder / str(round)).is_dir()


def _latest(records: list[dict]) -> dict[int, dict]:
    """The newest record of each round (a round trained again after a restart is logged again)."""
    return {r["round"]: r for r in records}


def test_a_killed_island_rejoins_and_contributes_again(run_dir, tmp_path):
    (tmp_path / "three.py").write_text(THREE)
    run = run_dir(
        # 16 rounds: enough for a and b to outlast c's restart on a loaded machine (it rejoins by round 9 or so)
        str(tmp_path / "three.py"), "--config.outer.rounds=16", "--config.outer.min_islands=2",
        "--config.outer.grace_seconds=1", "--config.checkpoint.every_rounds=2", "--config.eval.every_rounds=16",
        # each exchange crosses an emulated link of 0.4 s one way, so that the run outlasts c's restart
        "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=400",
    )
    for role in ("coordinator", "a", "b", "c"):
        run.start(role)
    run.wait_for(lambda: _checkpointed(run, "c", 2))
    run.kill("c")
    run.wait_for(lambda: len(run.records("coordinator")) >= 4)
    run.start("c")
    run.finish()

    merged = _latest(run.records("coordinator"))
    assert sorted(merged) == list(range(1, 17))
    log = run.log("c")
    assert "resumed from the checkpoint of round 2" in log
    # c's first round after the restart, trained whole from the view (the records before it may include
    # rounds c sent before it was killed, so the log says which round that is)
    joined = re.findall(r"rejoined the run at round (\d+)", log)
    assert len(joined) == 1
    first = int(joined[0])
    assert first >= 4 and first in {r["round"] for r in run.records("c")}
    # c may have sent rounds after 2 before it was killed (its round-2 checkpoint completes in the background)
    sent = [r for r in range(3, first) if "c" in merged[r]["contributors"]]
    assert sent == list(range(3, 3 + len(sent)))  # it contributed until it died, then not until it rejoined
    gap = range(3 + len(sent), first)
    assert len(gap) >= 1
    for r in gap:  # without c: weights from a's and b's tokens only (8 and 4 sequences of 32 bytes, 2 steps)
        assert merged[r]["contributors"] == ["a", "b"]
        assert merged[r]["weights"] == {"a": 512 / 768, "b": 256 / 768}
    assert merged[first]["weights"]["c"] > 0
    assert merged[first]["weights"] == {"a": 512 / 1024, "b": 256 / 1024, "c": 256 / 1024}
    for r in range(first, 17):
        assert {_latest(run.records(n))[r]["checksum"] for n in "abc"} == {merged[r]["checksum"]}


@pytest.mark.parametrize("fragments", [1, 2])
def test_the_coordinator_restarts_under_running_islands(run_dir, tmp_path, fragments):
    overrides = [
        "--config.outer.rounds=6", "--config.checkpoint.every_rounds=1", "--config.eval.every_rounds=6",
        "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=400",
        f"--config.outer.fragments={fragments}",
    ]
    config = os.path.join(TESTS, "tiny_config.py")
    reference = run_dir(config, *overrides)  # the same run, never interrupted
    for role in ("coordinator", "a", "b"):
        reference.start(role)
    run = run_dir(config, *overrides)
    for role in ("coordinator", "a", "b"):
        run.start(role)
    run.wait_for(lambda: len(run.records("coordinator")) >= 3 * fragments)
    run.kill("coordinator")
    killed_after = len(run.records("coordinator")) // fragments
    time.sleep(5)
    run.start("coordinator")
    run.finish()
    reference.finish()

    assert killed_after in (3, 4)  # merged rounds when it died
    for name in ("a", "b"):
        log = run.log(name)
        assert "reconnect attempt 1 in 0.5 s" in log and "the coordinator restarted" in log
        assert "to its checkpoint of round" in log and "the run goes on bit for bit" in log
    assert "resumed from the checkpoint of round" in run.log("coordinator")
    final = json.load(open(run.workdir / "coordinator" / "summary.json"))["checksum"]
    assert final == json.load(open(reference.workdir / "coordinator" / "summary.json"))["checksum"]
    for name in ("a", "b"):
        assert _latest(run.records(name))[6]["checksum"] == final
