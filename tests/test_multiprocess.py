"""Islands of several processes: one jax.distributed job per island, each process moving its share.

Island a runs as 2 processes x 2 CPU devices (gloo collectives between them) and island b as 1 process x 2
devices, on the tiny config; the launcher starts them (`launch/local.py`), or the test does, one process at a
time, to kill one.
"""

import json
import os
import re
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from processes import CONFIG, ROOT, checkpointed, kill_during, latest, launch, merged_and_rejoined
from tiny_config import get_config

from island_jax.metrics import read_jsonl
from island_jax.model.init import init_params
from island_jax.outer import codec
from island_jax.outer import fragments as fragments_lib

pytestmark = pytest.mark.slow  # every test here starts processes

TWO_PROCESSES = ["--config.islands.a.num_processes=2", "--config.islands.a.devices_per_process=2"]
FSDP_OVER_PROCESSES = [*TWO_PROCESSES, "--config.islands.a.mesh.data=1", "--config.islands.a.mesh.fsdp=2"]


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


def _ranges(shards: int) -> list[int]:
    """Payload bytes of each coordinator shard's range of the tiny model's int8 payload in chunks of at most
    1024 bytes (the plan cut into contiguous ranges of near-equal bytes)."""
    config = get_config()
    _, params, _ = init_params(config)
    plan = codec.chunk_plan(params, "int8", config.codec.block_size, 1024)
    bounds, total, at = [0], sum(c.nbytes for c in plan), 0
    for k in range(1, shards):  # range k - 1 ends after the first chunk whose end reaches k / shards of the bytes
        while sum(c.nbytes for c in plan[:at]) * shards < total * k:
            at += 1
        bounds.append(at)
    bounds.append(len(plan))
    return [sum(c.nbytes for c in plan[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_a_two_process_island_holds_the_global_parameters_of_every_island(tmp_path, corpus, straight):
    """... and sends each of its chunks to the coordinator shard that owns it, of 3 (`coordinator.shards`)."""
    result = launch(tmp_path / "two", corpus, "--config.comm.chunk_bytes=1024", "--config.coordinator.shards=3",
                    *TWO_PROCESSES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    stdout = result.stdout
    assert "started island a/0" in stdout and "started island a/1" in stdout and "started island b " in stdout
    merged = _rounds(tmp_path / "two", "coordinator")
    a, b = _rounds(tmp_path / "two", "a"), _rounds(tmp_path / "two", "b")
    assert [r["round"] for r in a] == [r["round"] for r in merged] == [1, 2, 3]
    shares = _shares()
    payload = sum(shares)
    assert payload == 34560 and all(0.45 <= s / payload <= 0.55 for s in shares), shares
    # every shard took exactly its range's chunks of every island's contribution, from both of a's processes
    ranges = _ranges(3)
    assert sum(ranges) == payload
    for k, folder in enumerate(["coordinator", "coordinator-shard-1", "coordinator-shard-2"]):
        received = json.load(open(tmp_path / "two" / folder / "summary.json"))["payload_bytes_received"]
        assert received == {"a": 3 * ranges[k], "b": 3 * ranges[k]}
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
    """Island a with fsdp = 2 over its 2 processes: one is killed, its peer ends, and both started again rejoin
    from their checkpoint and the coordinator's view, each taking only its own shards of it."""
    heartbeat = 5  # s
    run = run_dir(
        CONFIG, *FSDP_OVER_PROCESSES, "--config.outer.rounds=16", "--config.outer.min_islands=1",
        "--config.outer.grace_seconds=2", "--config.checkpoint.every_rounds=2", "--config.eval.every_rounds=16",
        f"--config.distributed.heartbeat_timeout_seconds={heartbeat}",
        # each process keeps the residual of the pieces it owns; a checkpoint holds one row per process
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
    # each process fetched the view's chunks that its own shards need: with the tiny model's leaves (each one
    # piece of the view, split between the processes) that is every chunk
    taken = [re.findall(r"process \d: took (\d+) of the view's (\d+) chunks", run.log(f"a/{p}")) for p in (0, 1)]
    assert all(t and all(n == m for n, m in t) for t in taken), taken
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

STREAMING_INT4 = ["--config.comm.chunk_bytes=1024", "--config.outer.fragments=2", "--config.codec.kind=int4",
                  "--config.codec.error_feedback=True"]


def _owned_bytes(kind: str, chunk_bytes: int, fragments: int) -> list[int]:
    """Payload bytes each of island a's 2 processes owns per round when fsdp = 2 spans them, worked out element by
    element: process p holds the p-th half of every split leaf along its fsdp dimension, a chunk goes to the
    process holding most of its elements, and chunks both hold whole (the replicated leaves) are dealt by bytes."""
    config = get_config()
    _, params, specs = init_params(config)
    leaves = jax.tree.leaves(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    holder = []  # per leaf: the process of each flat element, or -1 where both hold it
    for x, spec in zip(leaves, spec_leaves):
        if "fsdp" not in tuple(spec):
            holder.append(np.full(x.size, -1))
            continue
        d = tuple(spec).index("fsdp")
        coordinate = np.arange(x.size) // int(np.prod(x.shape[d + 1:], dtype=np.int64)) % x.shape[d]
        holder.append(coordinate // (x.shape[d] // 2))
    owned = [0, 0]
    for part in fragments_lib.partition(fragments_lib.leaf_bytes(params), fragments):
        plan = codec.chunk_plan([leaves[i] for i in part], kind, config.codec.block_size, chunk_bytes)
        loads = [0, 0]
        for chunk in plan:
            held = np.zeros(2, np.int64)
            for piece in chunk.pieces:
                h = holder[part[piece.leaf]][piece.start : piece.stop]
                held += [np.sum((h == p) | (h == -1)) for p in (0, 1)]
            owner = min((p for p in (0, 1) if held[p] == held.max()), key=lambda p: (loads[p], p))
            loads[owner] += chunk.nbytes
        owned = [o + n for o, n in zip(owned, loads)]
    return owned


def test_a_two_process_fsdp_island_moves_only_its_own_chunks_and_resumes_to_the_same_bits(tmp_path, corpus):
    """fsdp = 2 over island a's 2 processes, streaming (F = 2) with int4 and error feedback: each process sends the
    chunks it owns, every checksum agrees with island b's after every round, and a run in which one of a's
    processes is killed ends with the same bits as one without a kill. (The tiny model's leaves are smaller than a
    piece of the codec, so every chunk holds whole leaves that both processes hold half of, and the chunks are
    dealt by bytes; tests/test_shards.py has owners that hold most of their chunks.)"""
    result = launch(tmp_path / "straight", corpus, *FSDP_OVER_PROCESSES, *STREAMING_INT4)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    merged = _rounds(tmp_path / "straight", "coordinator")
    a, b = _rounds(tmp_path / "straight", "a"), _rounds(tmp_path / "straight", "b")
    owned = _owned_bytes("int4", 1024, 2)
    assert owned == [9612, 7940], owned
    assert [(r["round"], r["fragment"]) for r in merged] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [r["round"] for r in a] == [r["round"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):  # both processes of a and island b hold the same global parameters after every round
        assert ra["process_checksums"] == [rb["checksum"]] * 2 and ra["checksum"] == rb["checksum"]
        assert ra["process_payload_bytes"] == owned and ra["payload_bytes"] == sum(owned)
    assert len({r["checksum"] for r in a}) == 3
    saved = [r for r in read_jsonl(tmp_path / "straight" / "islands/a/metrics.jsonl") if r["kind"] == "checkpoint"]
    assert [r["checksums"]["anchor"] for r in saved] == [r["checksum"] for r in a]

    # The same run with process 1 of island a SIGKILLed once round 2 is done everywhere (its checkpoint of round 1 is complete): the launcher starts the
    # island's two processes again, they resume from their checkpoint and replay what the run merged since, each
    # process checking its own chunks, and the run ends on the same bits.
    killed = tmp_path / "killed"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={killed}",
           f"--config.data.files={corpus}", *FSDP_OVER_PROCESSES, *STREAMING_INT4, "--restart=1"]
    returncode, out, _ = kill_during(cmd, [(r"\[launch\] round 2/3", "island a/1")])
    assert returncode == 0 and re.search(r"^\[launch\] island a/1 exited with status -9; restarting it", out, re.M), out[-4000:]
    assert re.search(r"^\[island a/0\] .*resumed from the checkpoint of round \d", out, re.M), out[-4000:]
    def by_round(records):  # a round logged again (replayed, or merged again) by its last record
        return {(r["round"], r.get("fragment", 0)): r["checksum"] for r in records}

    for role, straight in (("coordinator", merged), ("a", a), ("b", b)):
        assert by_round(_rounds(killed, role)) == by_round(straight), role
    # a replay, or (killed right after its checkpoint of the run's round) a resume that needed none: never the view
    assert json.load(open(killed / "summary.json"))["islands"]["a"]["rejoin_bitwise"] is not False
