"""A real SLURM run: launch/slurm.py submits the tiny two-island run to this machine's SLURM and it finishes.

Needs a SLURM that accepts jobs (`sudo launch/slurm_single_node.sh` sets up a single node; `.ci/run` does so
before the suite). Without one the test is skipped, and the skip says why.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml
from processes import CONFIG, ROOT, role_env

from island_jax.comm import security

pytestmark = pytest.mark.slow  # submits a job that starts processes

NODES = 4  # the coordinator, island a's two processes, island b


def _why_not() -> str | None:
    """None when SLURM accepts jobs here, else why not (with the last line of the setup's log when `.ci/run` ran
    launch/slurm_single_node.sh: ISLAND_JAX_SLURM_SETUP_LOG)."""
    reason = _reason()
    log = os.environ.get("ISLAND_JAX_SLURM_SETUP_LOG", "")
    if reason and log and os.path.exists(log):
        lines = [line for line in open(log, encoding="utf-8", errors="replace").read().splitlines() if line.strip()]
        reason += f"; the setup said: {lines[-1] if lines else '(nothing)'}"
    return reason


def _reason() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "SLURM is not installed here (sbatch, sinfo); run: sudo launch/slurm_single_node.sh"
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=60)
    ready = [s for s in states.stdout.split() if s in ("idle", "mixed")]
    if states.returncode or len(ready) < NODES:
        return (f"SLURM has {len(ready)} node(s) that accept jobs, and the run needs {NODES} (sinfo: "
                f"{' '.join(states.stdout.split()) or states.stderr.strip()}); run: sudo launch/slurm_single_node.sh")
    return None


def _finished(job: str, timeout: float) -> str:
    """The state `job` ended in, once it has (polled every 0.2 s, up to `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, timeout=60)
        states = re.findall(r"JobState=(\S+)", shown.stdout)  # one per heterogeneous-job component
        if states and all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for s in states):
            return next((s for s in states if s != "COMPLETED"), "COMPLETED")
        time.sleep(0.2)
    raise TimeoutError(f"SLURM job {job} did not end within {timeout} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_tiny_run_submitted_to_slurm_finishes_with_checksums_agreeing(tmp_path, corpus):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    host = socket.gethostname()
    secrets = security.make_run_credentials(str(tmp_path / "secrets"), ["a", "b"], [host, socket.getfqdn()])
    description = {
        # islands check the certificate for "localhost", which it names, whichever node the coordinator gets
        "coordinator": {"scheduler": "slurm", "addresses": [f"auto:{_free_port()}"], "server_name": "localhost",
                        "cert_file": secrets["cert_file"], "key_file": secrets["key_file"],
                        "tokens_file": secrets["tokens_file"]},
        # island a as 2 processes on 2 nodes (2 CPU devices each): --process_id and --island_coordinator from the job
        "islands": {name: {"scheduler": "slurm", "nodes": nodes, "token_file": secrets["token_files"][name]}
                    for name, nodes in (("a", 2), ("b", 1))},
        "tls": {k: secrets[k] for k in ("ca_file", "client_cert_file", "client_key_file")},
        "island_port": _free_port(),
        "python": sys.executable,
        "repo": ROOT,
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(description))
    workdir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "slurm.py"), f"--config={CONFIG}", f"--config.data.files={corpus}",
         "--config.islands.a.num_processes=2", f"--cluster={tmp_path / 'cluster.yaml'}", f"--workdir={workdir}"],
        capture_output=True, text=True, env=role_env(), timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    submitted = re.fullmatch(r"\[slurm\] submitted (\S+): job (\d+)\n", done.stdout)
    assert submitted and submitted.group(1) == str(workdir / "launch" / "slurm-job.sbatch"), done.stdout
    state = _finished(submitted.group(2), timeout=600)
    logs = sorted((workdir / "launch").glob("slurm-*.out"))
    log = logs[0].read_text() if logs else "(no job log)"
    assert state == "COMPLETED" and len(logs) == 1, f"job state {state}\n{log[-4000:]}"
    summary = json.loads((workdir / "summary.json").read_text())
    assert (summary["rounds"], summary["checksums_agree"]) == (3, True)
    done_line = [line for line in log.splitlines() if "[summarize] done in" in line][0]
    assert re.search(r"global parameters agree: True \(every round: True\); per island and round [\d,]+ bytes up "
                     r"\(int8, [\d.]+ bits a parameter\) and [\d,]+ down \(int8, [\d.]+\); summary in "
                     + re.escape(str(workdir / "summary.json")) + "$", done_line), done_line
    # each role wrote its own folder, and all three hold the same final global parameters
    checksums = {role: json.loads((workdir / role / "summary.json").read_text())["checksum"]
                 for role in ("coordinator", "islands/a", "islands/b")}
    assert len(set(checksums.values())) == 1, checksums
