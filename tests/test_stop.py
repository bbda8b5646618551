"""The launcher stopped with SIGTERM mid-run, and the same command again: every process ends (each finishing the
checkpoint it is writing), no role waits at the start barrier, the run ends with the islands on the coordinator's
view after every round, and once finished the same command is refused. (A role that crashes stopping the others:
tests/test_launch.py's restart tests; a crashed run resuming to the same bits: tests/test_run.py.)"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from processes import CONFIG, ROOT, role_env

from island_jax.metrics import read_jsonl

pytestmark = pytest.mark.slow  # starts the launcher

ROUNDS = 12


def command(workdir, corpus):
    return [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={workdir}",
            f"--config.data.files={corpus}", f"--config.outer.rounds={ROUNDS}"]


def merged(workdir) -> int:
    path = os.path.join(workdir, "coordinator", "metrics.jsonl")
    return max((r["round"] for r in read_jsonl(path) if r["kind"] == "round"), default=0) if os.path.exists(path) else 0


def test_sigterm_to_the_launcher_then_the_same_command_resumes_without_waiting_and_agrees(corpus, tmp_path):
    workdir = tmp_path / "stopped"
    launcher = subprocess.Popen(command(workdir, corpus), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=role_env())
    try:
        deadline = time.monotonic() + 300
        while merged(workdir) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        stopped, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stopped[-3000:]
    assert "[launch] SIGTERM: stopping every process (each finishes the checkpoint it is writing, for up to 60 s)" \
        in stopped.splitlines()
    assert merged(workdir) < ROUNDS, "the run ended before the signal; nothing was tested"
    for role in ("coordinator", "islands/a", "islands/b"):  # every save the roles began is complete
        folder = workdir / role / "checkpoints"
        assert [n for n in os.listdir(folder) if not n.isdigit()] == [], role
        assert [n for n in os.listdir(folder) if n.isdigit()], role
    for pid in map(int, re.findall(r"\[launch\] started .* \(pid (\d+)\)", stopped)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    resumed = subprocess.run(command(workdir, corpus), capture_output=True, text=True, env=role_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    waits = re.findall(r"island (\w+) waited ([\d.]+) s at the start barrier", resumed.stdout)
    # an island at the coordinator's round waits for the others at the start barrier, one behind it rejoins
    assert all(float(seconds) < 30 for _, seconds in waits), waits  # the join timeout is 300 s
    assert "not every island was ready" not in resumed.stdout
    done = [line for line in resumed.stdout.splitlines() if line.startswith("[launch] done in ")]
    assert len(done) == 1 and "global parameters agree: True (every round: True)" in done[0], done
    summary = (workdir / "summary.json").read_text()
    again = subprocess.run(command(workdir, corpus), capture_output=True, text=True, env=role_env(), timeout=600)
    assert again.returncode == 1 and again.stderr.strip().splitlines()[-1] == (
        f"{workdir} holds a finished run of {ROUNDS} rounds (summary.json); raise --config.outer.rounds to extend it, "
        "or pass a new --workdir"), again.stderr[-2000:]
    assert (workdir / "summary.json").read_text() == summary  # nothing it holds was touched
