"""Multi-process runs of the tiny config: with the launcher (`launch`), or roles started by hand
(`experiments/train.py --role=...`), as an operator or a cluster scheduler would, so that a test decides when
each one dies and when it comes back.

Fixtures (tests/conftest.py imports them for every test module):
- `corpus`: the tiny corpus, written once per pytest run;
- `straight`: one launcher run of tests/tiny_config.py, three rounds start to end, started once per pytest run
  (by the first pytest-xdist worker that needs it) and shared by every test that only reads its workdir (its
  folder and the launcher's stdout);
- `run_dir`: makes a `Run` in the test's folder with the tiny corpus; `Run.start("a/1")` starts process 1 of a
  multi-process island a.
"""

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from filelock import FileLock
from tiny_config import write_corpus

from island_jax.mesh import without_forced_device_count
from island_jax.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CONFIG = os.path.join(TESTS, "tiny_config.py")


def role_env() -> dict:
    """The environment of a process a test starts: this one's, without the 8 virtual devices tests/conftest.py
    forces (each role sets its own device count), with tests/ importable (tiny_config) and island_jax imported
    from this checkout (whichever copy is installed); the compilation cache settings are inherited."""
    return without_forced_device_count(os.environ) | {"PYTHONPATH": os.pathsep.join([TESTS, ROOT])}


def launch(workdir, files: str, *overrides: str, config: str = CONFIG) -> subprocess.CompletedProcess:
    """`launch/local.py` on `config` with the corpus `files` into `workdir`; its completed process (text)."""
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={config}", f"--workdir={workdir}",
           f"--config.data.files={files}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=role_env(), timeout=600)


def kill_during(cmd: list[str], kills: list[tuple[str, str]]) -> tuple[int, str, list[str]]:
    """Runs the launcher `cmd`; for each (pattern, role) of `kills` in turn, once it prints a line that matches the
    regular expression `pattern` (`re.match`), SIGKILLs the current process of `role` (as started, or restarted,
    by the launcher). Returns (its status, its output, the roles killed)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=role_env())
    kills, seen, killed = list(kills), [], []
    try:
        for got in proc.stdout:
            seen.append(got)
            if kills and re.match(kills[0][0], got):
                role = kills.pop(0)[1]
                pids = re.findall(rf"(?:started {re.escape(role)} \(pid|{re.escape(role)} (?:exited|was stopped) .*pid) "
                                  r"(\d+)\)", "".join(seen))
                os.kill(int(pids[-1]), signal.SIGKILL)
                killed.append(role)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen), killed


def views(workdir) -> dict[int, str]:
    """{round: the coordinator's view checksum after it} (its latest record of the round; fragment 0's)."""
    return {r["round"]: r["checksum"] for r in read_jsonl(pathlib.Path(workdir) / "coordinator" / "metrics.jsonl")
            if r["kind"] == "round" and r.get("fragment", 0) == 0}


def _shared(tmp_path_factory):
    """The folder every pytest-xdist worker of this run sees (the base temporary folder's parent under xdist),
    for what a run makes once."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    root = _shared(tmp_path_factory)
    with FileLock(str(root / "corpus.lock")):  # written once; the other workers wait for it
        if not (root / "corpus").is_dir():
            write_corpus(root / "corpus.partial")
            (root / "corpus.partial").rename(root / "corpus")
    return str(root / "corpus" / "*.py")


def shared_folder(tmp_path_factory, name: str, make) -> pathlib.Path:
    """The folder `name` that every pytest-xdist worker of this run sees, filled once by `make(folder)`: the first
    worker that asks runs it, the others wait for it (a file lock) and read the same folder. For what tests only
    read; a module-scoped fixture would run once per worker instead. A `make` that raises leaves nothing done, and
    the next worker to ask tries again."""
    root = _shared(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed first try left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def straight(tmp_path_factory, corpus):
    """Three rounds of tests/tiny_config.py, start to end, with the launcher: (workdir, the launcher's stdout).
    The first worker that needs it runs it; the others wait for it and read the same folder."""

    def make(folder):
        result = launch(folder / "workdir", corpus)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (folder / "stdout").write_text(result.stdout)

    folder = shared_folder(tmp_path_factory, "straight", make)
    return folder / "workdir", (folder / "stdout").read_text()


class Run:
    """The roles of one run in `workdir`, each a process logging to `workdir/ROLE.log`."""

    def __init__(self, workdir, config: str, overrides: list[str], port: int):
        self.workdir, self.config, self.overrides = workdir, config, overrides
        self.address = f"localhost:{port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = role_env()
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
def run_dir(tmp_path, corpus):
    runs = []

    def make(config: str, *overrides: str) -> Run:
        run = Run(tmp_path / f"run{len(runs)}", config, [f"--config.data.files={corpus}", *overrides], free_port())
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
