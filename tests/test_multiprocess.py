"""Islands of several processes: one jax.distributed job per island, each process moving its share.

Island a runs as 2 processes x 2 CPU devices (gloo collectives between them) and island b as 1 process x 2
devices, on the tiny config; the launcher starts them (`launch/local.py`), or the test does, one process at a
time, to kill one.
"""

import time

import numpy as np
import pytest
from processes import CONFIG, checkpointed, latest, launch, merged_and_rejoined
from tiny_config import get_config

from island_jax.metrics import read_jsonl
from island_jax.model.init import init_params
from island_jax.outer import codec

pytestmark = pytest.mark.slow  # every test here starts processes

TWO_PROCESSES = ["--config.islands.a.num_processes=2", "--config.islands.a.devices_per_process=2"]


def _rounds(workdir, role: str) -> list[dict]:
    folder = workdir / ("coordinator" if role == "coordinator" else f"islands/{role}")
    return [r for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "round"]


def _shares() -> list[int]:
    """Payload bytes of each of island a's 2 processes per round: the tiny model's int8 payload in chunks of
    at most 1024 bytes, dealt out by bytes."""
    config = get_config()
    _, params, _ = init_params(config)
    plan = codec.chunk_plan(params, "int8", config.codec.block_size, 1024)
    return [sum(c.nbytes for c in share) for share in codec.deal(plan, 2)]


def test_a_two_process_island_holds_the_global_parameters_of_every_island(tmp_path, corpus, straight):
    result = launch(tmp_path / "two", corpus, "--config.comm.chunk_bytes=1024", *TWO_PROCESSES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    stdout = result.stdout
    assert "started island a/0" in stdout and "started island a/1" in stdout and "started island b " in stdout
    merged = _rounds(tmp_path / "two", "coordinator")
    a, b = _rounds(tmp_path / "two", "a"), _rounds(tmp_path / "two", "b")
    assert [r["round"] for r in a] == [r["round"] for r in merged] == [1, 2, 3]
    shares = _shares()
    payload = sum(shares)
    assert payload == 34560 and all(0.45 <= s / payload <= 0.55 for s in shares), shares
    for ra, rb, rc in zip(a, b, merged):  # after every round: both processes of a, island b, the coordinator
        assert ra["process_checksums"] == [rc["checksum"]] * 2 and rb["checksum"] == rc["checksum"]
        assert ra["process_payload_bytes"] == shares and ra["payload_bytes"] == payload
        assert ra["bytes_sent"] == sum(ra["process_bytes_sent"])
        assert all(0.45 <= s / ra["bytes_sent"] <= 0.55 for s in ra["process_bytes_sent"])
    # island a's anchor after every round, checksummed shard by shard on its devices over both processes, is the
    # coordinator's view (a NumPy tree): one checksum whatever the layout
    saved = [r for r in read_jsonl(tmp_path / "two" / "islands/a/metrics.jsonl") if r["kind"] == "checkpoint"]
    assert [r["checksums"]["anchor"] for r in saved] == [r["checksum"] for r in merged]

    # The same run with island a as one process of 4 devices (the shared `straight` run: chunks of the default
    # size, which frame the same payload): the same data and the same first round, to float32 rounding (gloo
    # reduces in another order than the in-process all-reduce, so not bit for bit).
    workdirs = {"two": tmp_path / "two", "one": straight[0]}
    inner = {w: [r for r in read_jsonl(workdirs[w] / "islands/a/metrics.jsonl") if r["kind"] == "inner"]
             for w in ("two", "one")}
    first_round = [(x["cross_entropy"], y["cross_entropy"]) for x, y in zip(inner["two"], inner["one"]) if x["round"] == 1]
    assert len(first_round) == 2
    np.testing.assert_allclose(*zip(*first_round), rtol=1e-5)
    evals = {w: [r for r in read_jsonl(workdirs[w] / "islands/a/metrics.jsonl") if r["kind"] == "eval"][-1]
             for w in ("two", "one")}
    assert evals["two"]["round"] == evals["one"]["round"] == 3
    assert abs(evals["two"]["eval_loss"] - evals["one"]["eval_loss"]) <= 0.01


def test_a_killed_process_ends_its_peer_and_the_island_rejoins(run_dir):
    heartbeat = 5  # s
    run = run_dir(
        CONFIG, *TWO_PROCESSES, "--config.outer.rounds=16", "--config.outer.min_islands=1",
        "--config.outer.grace_seconds=2", "--config.checkpoint.every_rounds=2", "--config.eval.every_rounds=16",
        f"--config.distributed.heartbeat_timeout_seconds={heartbeat}",
        # each process keeps the residual of its own share; a checkpoint puts them together
        "--config.codec.error_feedback=True",
        # each exchange crosses an emulated link of 0.4 s one way, so that the run outlasts a's restart
        "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=400",
    )
    for role in ("coordinator", "a/0", "a/1", "b"):
        run.start(role)
    run.wait_for(lambda: checkpointed(run, "a", 2))
    peer = run.procs["a/0"]
    run.kill("a/1")
    killed = time.monotonic()
    assert peer.wait(timeout=heartbeat + 5) != 0
    assert time.monotonic() - killed <= heartbeat + 5
    log = run.log("a/0")
    # in a collective, the peer's gloo connection closes and the island's own message says so; otherwise the
    # distributed runtime ends the process when the killed one's heartbeats stop
    assert ("island a, process 0 of 2: a collective with the island's other processes failed" in log
            or "the JAX distributed service detected fatal errors" in log), log[-3000:]
    run.procs.pop("a/0")
    run.wait_for(lambda: any(r["contributors"] == ["b"] for r in run.records("coordinator")))
    run.start("a/0")
    run.start("a/1")
    run.finish()

    merged, first = merged_and_rejoined(run, "a/0", 16, resumed_at=2)
    without = [r for r in range(3, first) if merged[r]["contributors"] == ["b"]]
    assert without and all(merged[r]["weights"] == {"b": 1.0} for r in without)
    # a contributes again from its first whole round, unless that round closed after b's and the 2 s grace
    # window before a's arrived (a loaded machine); then from a later one
    again = [r for r in range(first, 17) if "a" in merged[r]["contributors"]]
    assert again and merged[again[0]]["weights"] == {"a": 512 / 768, "b": 256 / 768}
    a = latest(run.records("a"))
    b = latest(run.records("b"))
    for r in range(first, 17):
        assert a[r]["process_checksums"] == [merged[r]["checksum"]] * 2 and b[r]["checksum"] == merged[r]["checksum"]
