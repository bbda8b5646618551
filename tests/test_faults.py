"""Faults in a multi-process run: the coordinator restarts under islands (an island killed in a quorum run:
tests/test_multiprocess.py; killed islands replaying: tests/test_launch.py, tests/test_replay.py).

The roles are started by hand (`experiments/train.py --role=...`), as an
operator or a cluster scheduler would, so that each test decides when a role
dies and when it comes back.
"""

import json
import os

import pytest
from processes import TESTS, latest

pytestmark = pytest.mark.slow  # every test here starts processes

@pytest.mark.parametrize("fragments", [1, 2])
def test_the_coordinator_restarts_under_running_islands(run_dir, corpus, tmp_path, fragments):
    from tiny_config import get_config

    from island_jax.run import run_in_process

    overrides = [
        "--config.outer.rounds=6", "--config.checkpoint.every_rounds=1", "--config.eval.every_rounds=6",
        "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=400",
        f"--config.outer.fragments={fragments}",
        # reconnect attempts 0.5 s, then 1 s apart: the islands find the restarted coordinator within a second
        "--config.comm.reconnect_backoff_cap_seconds=1",
    ]
    run = run_dir(os.path.join(TESTS, "tiny_config.py"), *overrides)
    for role in ("coordinator", "a", "b"):
        run.start(role)
    run.wait_for(lambda: len(run.records("coordinator")) >= 3 * fragments)
    run.kill("coordinator")
    killed_after = len(run.records("coordinator")) // fragments
    # down until both islands have lost it and back off to reconnect
    run.wait_for(lambda: all("reconnect attempt 1 in 0.5 s" in run.log(name) for name in ("a", "b")))
    run.start("coordinator")
    run.finish()

    # The same run, never interrupted, in this process (the same bits as over gRPC: tests/test_launch.py);
    # without the link's delay, which changes when the rounds end but not what they hold.
    c = get_config()
    c.data.files = corpus
    c.outer.update(rounds=6, fragments=fragments)
    c.checkpoint.every_rounds, c.eval.every_rounds = 1, 6
    reference = tmp_path / "reference"
    run_in_process(c, str(reference))

    assert killed_after in (3, 4)  # merged rounds when it died
    for name in ("a", "b"):
        log = run.log(name)
        assert "reconnect attempt 1 in 0.5 s" in log and "the coordinator restarted" in log
        assert "to its checkpoint of round" in log and "the run goes on bit for bit" in log
    assert "resumed from the checkpoint of round" in run.log("coordinator")
    final = json.load(open(run.workdir / "coordinator" / "summary.json"))["checksum"]
    assert final == json.load(open(reference / "coordinator" / "summary.json"))["checksum"]
    for name in ("a", "b"):
        assert latest(run.records(name))[6]["checksum"] == final
