"""Faults in a multi-process run: an island killed and restarted rejoins; the coordinator restarts under islands.

The roles are started by hand (`experiments/train.py --role=...`), as an
operator or a cluster scheduler would, so that each test decides when a role
dies and when it comes back.
"""

import json
import os

import pytest
from processes import TESTS, checkpointed, latest, merged_and_rejoined

pytestmark = pytest.mark.slow  # every test here starts processes

THREE = """
import tiny_config
from island_jax.config import island


def get_config():
    c = tiny_config.get_config()
    c.islands.c = island(2, 1, 2, 4, 2)
    return c
"""


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
    run.wait_for(lambda: checkpointed(run, "c", 2))
    run.kill("c")
    run.wait_for(lambda: len(run.records("coordinator")) >= 4)
    run.start("c")
    run.finish()

    # c's first round after the restart, trained whole from the view (the records before it may include
    # rounds c sent before it was killed, so the log says which round that is)
    merged, first = merged_and_rejoined(run, "c", 16, resumed_at=2)
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
        assert {latest(run.records(n))[r]["checksum"] for n in "abc"} == {merged[r]["checksum"]}


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
