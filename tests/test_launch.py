"""The multi-process run: launcher, roles over gRPC, checkpoints, TensorBoard events, crash and resume."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from processes import CONFIG, kill_during, launch, role_env, views
from tiny_config import get_config

from island_jax.metrics import read_jsonl
from island_jax.model.init import count, init_params
from island_jax.run import run_in_process

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_launcher_summary_bytes_and_agreement(straight, corpus):
    workdir, stdout = straight
    summary = json.load(open(workdir / "summary.json"))
    config = get_config()
    config.data.files = corpus
    _, params, _ = init_params(config)
    target = count(params) * (1 + 4 / 256)
    assert summary["rounds"] == 3 and summary["params"] == count(params) and summary["codec"] == "int8"
    assert summary["checksums_agree"] is True
    assert abs(summary["eval_loss_initial"] - np.log(256)) < 0.15
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
    for name, batch in (("a", 8), ("b", 4)):
        isl = summary["islands"][name]
        assert isl["inner_steps"] == 6 and isl["tokens"] == 6 * batch * 32
        for rec in [r for r in read_jsonl(workdir / "islands" / name / "metrics.jsonl") if r["kind"] == "round"]:
            assert abs(rec["bytes_sent"] / target - 1) < 0.02
            assert abs(rec["bytes_received"] / target - 1) < 0.02
    coordinator = [r for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["round"] for r in coordinator] == [1, 2, 3]
    assert coordinator[0]["weights"] == {"a": 2 / 3, "b": 1 / 3}
    assert set(coordinator[0]["pseudo_gradient_norm"]) == {"a", "b"} and set(coordinator[0]["cosine_similarity"]) == {"a/b"}
    assert len(re.findall(r"\[launch\] round \d/3 \| loss a=", stdout)) == 3
    assert re.search(r"^\[island b\] .*round 3/3", stdout, re.M)


def _names(folder):
    """Files below `folder` by relative path; TensorBoard event files by kind (their names carry host and time),
    checkpoints down to each round's top level (orbax names its data files at random)."""
    names = set()
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if rel.name.startswith("events.out.tfevents."):
            rel = rel.with_name("events.out.tfevents")
        if "checkpoints" in rel.parts and len(rel.parts) - rel.parts.index("checkpoints") > 3:
            continue
        names.add(str(rel))
    return names


def test_multi_process_run_equals_the_in_process_run(straight, corpus, tmp_path):
    from island_jax.run import run_in_process

    workdir, _ = straight
    config = get_config()
    config.data.files = corpus
    in_process = tmp_path / "in_process"
    run_in_process(config, str(in_process))
    for role in ("coordinator", "islands/a", "islands/b"):
        ours = [r for r in read_jsonl(in_process / role / "metrics.jsonl") if r["kind"] == "round"]
        theirs = [r for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == "round"]
        assert [r["checksum"] for r in ours] == [r["checksum"] for r in theirs]
        if role != "coordinator":  # the in-process transport counts the frames gRPC sends
            assert [(r["bytes_sent"], r["bytes_received"]) for r in ours] == [
                (r["bytes_sent"], r["bytes_received"]) for r in theirs]
    for part in ("coordinator", "islands"):
        assert _names(in_process / part) == _names(workdir / part)
    assert {p.name for p in in_process.iterdir()} == {p.name for p in workdir.iterdir()}


def test_tensorboard_reads_back_the_logged_losses(straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir, _ = straight
    for role in ("islands/a", "islands/b"):
        events = EventAccumulator(str(workdir / role))
        events.Reload()
        logged = [r for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == "inner"]
        scalars = events.Scalars("inner/loss")
        assert [s.step for s in scalars] == [1, 2, 3, 4, 5, 6]
        assert [s.value for s in scalars] == [float(np.float32(r["loss"])) for r in logged]
    events = EventAccumulator(str(workdir / "coordinator"))
    events.Reload()
    norms = [r["pseudo_gradient_norm"]["a"] for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl")
             if r["kind"] == "round"]
    assert [s.value for s in events.Scalars("round/pseudo_gradient_norm/a")] == [float(np.float32(v)) for v in norms]


RESTORE = """
import sys, json
import jax
jax.config.update("jax_num_cpu_devices", 1)
sys.path.insert(0, {tests!r})
from tiny_config import get_config
from island_jax.checkpoint import Checkpointer
from island_jax.coordinator import Coordinator
from island_jax.model.init import checksum, init_params
config = get_config()
_, params, _ = init_params(config)
like = Coordinator(config, params, list(config.islands.keys())).state()
state = Checkpointer({folder!r}, 1, 2).restore(like)["fragments"][0]
print(json.dumps({{k: checksum(v) for k, v in state.items()}} | {{"round_value": int(state["round"])}}))
"""


def test_coordinator_checkpoint_restores_in_a_new_process_to_the_same_bits(straight):
    workdir, _ = straight
    folder = str(workdir / "coordinator" / "checkpoints")
    env = role_env()
    out = subprocess.run([sys.executable, "-c", RESTORE.format(tests=os.path.join(ROOT, "tests"), folder=folder)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    restored = json.loads(out.stdout.strip().splitlines()[-1])
    saved = [r for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "checkpoint"]
    assert [r["round"] for r in saved] == [1, 2, 3]
    assert restored["round_value"] == 3
    assert {k: restored[k] for k in ("master", "opt_state", "view", "round")} == {
        k: saved[-1]["checksums"][f"fragments/0/{k}"] for k in ("master", "opt_state", "view", "round")
    }


def test_streaming_fragments_across_processes(corpus, tmp_path):
    """Two fragments, tau = 1, one process per role: every fragment of every round goes out once, the islands
    end on the coordinator's view, and the run writes its accounting, events and timeline."""
    workdir = tmp_path / "streaming"
    cpus = sorted(os.sched_getaffinity(0))
    a_cpu, b_cpu = cpus[0], cpus[-1]  # each island on a CPU of its own where there are two
    result = launch(
        workdir, corpus, "--config.outer.fragments=2", "--config.outer.overlap_steps=1", f"--cpus=a={a_cpu}",
        f"--cpus=b={b_cpu}", "--config.metrics.plots=timeline",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(rf"started island a \(pid \d+\) on CPUs {a_cpu}\n", result.stdout)
    assert re.search(rf"started island b \(pid \d+\) on CPUs {b_cpu}\n", result.stdout)
    assert re.search(r"started coordinator \(pid \d+\)\n", result.stdout)
    summary = json.load(open(workdir / "summary.json"))
    assert summary["checksums_agree"] is True
    coordinator = [r for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    assert [(r["round"], r["fragment"]) for r in coordinator] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    for name in ("a", "b"):
        isl = summary["islands"][name]
        assert isl["inner_steps"] == 6
        total = isl["compute_seconds"] + isl["seconds_blocked"] + isl["idle_seconds"]
        assert total == pytest.approx(isl["wall_seconds"], rel=1e-6)
        assert isl["compute_utilization"] == pytest.approx(isl["ideal_compute_seconds"] / isl["wall_seconds"])
        # A checkpoint every round, timed apart from the rounds; the only evaluation comes after the last.
        assert isl["checkpoint_seconds"] > 0 and isl["eval_seconds"] == 0.0
        events = read_jsonl(workdir / "islands" / name / "events.jsonl")
        sends = sorted((e["round"], e["fragment"]) for e in events if e["kind"] == "send")
        assert sends == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
        rounds = [r for r in read_jsonl(workdir / "islands" / name / "metrics.jsonl") if r["kind"] == "round"]
        assert [r["overlap_steps"] for r in rounds] == [1, 1, 1]
    assert (workdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpus_flag_refuses_bad_placements_before_starting_anything(corpus, tmp_path):
    """The launcher exits before it creates the workdir or starts a role; every message `parse_cpus` gives is
    in tests/test_supervisor.py."""
    workdir = tmp_path / "never"
    result = launch(workdir, corpus, "--cpus=a=0", "--cpus=a=0")
    assert result.returncode == 1
    assert "--cpus: role 'a' is placed twice" in result.stderr
    assert not workdir.exists()


class _Relay:
    """A TCP forwarder on 127.0.0.1 to `port`, as a proxy or NAT between islands and coordinator would be."""

    def __init__(self, port):
        self.target, self.connections = port, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            a.close()
            b.close()


def test_restart_and_dial_an_island_crashes_again_after_its_restart_and_the_run_stops(corpus, tmp_path):
    """Islands dial the coordinator through a forwarder (--dial); island b, which fails at the start of
    round 3 every time, is started once more (--restart=1), resumes, fails again, and every process stops."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    relay = _Relay(port)
    try:
        result = launch(tmp_path / "restart", corpus, "--config.islands.b.crash_at_round=3", "--restart=1",
                        "--host=127.0.0.1", f"--port={port}", f"--dial=127.0.0.1:{relay.port}")
    finally:
        relay.server.close()
    out = result.stdout
    assert result.returncode == 1, out[-3000:] + result.stderr[-3000:]
    launcher = [re.sub(r"pid \d+", "pid N", line) for line in out.splitlines() if line.startswith("[launch]")]
    rounds = [line for line in launcher if line.startswith("[launch] round ")]
    assert [line for line in launcher if line not in rounds] == [
        "[launch] started coordinator (pid N)",
        "[launch] started island a (pid N)",
        "[launch] started island b (pid N)",
        "[launch] island b exited with status 1; restarting it (restart 1 of 1, pid N)",
        "[launch] island b exited with status 1; stopping the other processes",
    ]
    assert [line.split(" | ")[0] for line in rounds] == ["[launch] round 1/3", "[launch] round 2/3"]
    restart = out.index("restarting it (restart 1 of 1")
    assert re.search(r"^\[island b\] .*resumed from the checkpoint of round 2", out[restart:], re.M)
    assert relay.connections >= 3  # islands a and b, and b again
    pids = [int(p) for p in re.findall(r"pid (\d+)\)", out)]
    assert len(pids) == 4
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _kill_mid_run(cmd: list[str], line: str, role: str, before=None, merged: bool = False) -> tuple[int, str, str]:
    """Runs the launcher `cmd` until it prints a line starting with `line`, then (after `before(output so far)`)
    SIGKILLs the process of `role` it started; (its status, its stdout, its stderr: "" with `merged` into stdout)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                            text=True, env=role_env())
    seen = []
    try:
        for got in proc.stdout:
            seen.append(got)
            if got.startswith(line):
                break
        assert seen and seen[-1].startswith(line), "".join(seen)[-3000:]
        if before is not None:
            before("".join(seen))
        os.kill(int(re.search(rf"started {re.escape(role)} \(pid (\d+)\)", "".join(seen))[1]), signal.SIGKILL)
        rest, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen) + rest, err or ""


def test_restart_kills_of_islands_and_the_coordinator_end_on_the_uninterrupted_bits(corpus, tmp_path):
    """Every island needed, checkpoints every 2 rounds, 8 rounds under `launch/local.py --restart`: island b
    SIGKILLed after round 3 merged, island a after round 5, the coordinator after round 6, b again after round 7,
    and the coordinator again while b replays.
    Each restarted island replays the rounds since its checkpoint, and the run ends on the bits of a run never
    interrupted (its per-round views and final eval loss)."""
    config = get_config()
    config.data.files = corpus
    config.outer.rounds, config.checkpoint.every_rounds = 8, 2
    straight = run_in_process(config, str(tmp_path / "straight"))
    workdir = tmp_path / "killed"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={workdir}",
           f"--config.data.files={corpus}", "--config.outer.rounds=8", "--config.checkpoint.every_rounds=2",
           # an emulated link of 0.3 s one way (the bits do not depend on it): a round outlasts a kill's notice
           "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=300", "--restart=2"]
    # each as its role logs the round (an island's line ends its round; the next one starts, 0.6 s or more)
    kills = [(r"\[island b\] .*\] island b round 3/8 \|", "island b"), (r"\[island a\] .*\] island a round 5/8 \|", "island a"),
             (r"\[coordinator\] .*\] round 6/8 merged", "coordinator"), (r"\[island b\] .*\] island b round 7/8 \|", "island b"),
             (r"\[island b\] .*island b replays ", "coordinator")]  # the coordinator dies during b's replay
    returncode, out, killed = kill_during(cmd, kills)
    assert returncode == 0 and killed == [role for _, role in kills], out[-4000:]
    assert len(re.findall(r"^\[launch\] island b exited with status -9; restarting it", out, re.M)) == 2
    assert len(re.findall(r"^\[launch\] coordinator exited with status -9; restarting it", out, re.M)) == 2
    assert views(workdir) == views(tmp_path / "straight")
    summary = json.load(open(workdir / "summary.json"))
    assert summary["eval_loss_final"] == straight["eval_loss_final"] and summary["checksums_agree"] is True
    assert summary["islands"]["b"]["rejoin_bitwise"] is True and summary["islands"]["a"]["rejoin_bitwise"] is True
    for name in ("a", "b"):  # each restart replayed from its checkpoint (an even round), or rolled back to one
        rejoins = [r for r in read_jsonl(workdir / "islands" / name / "metrics.jsonl") if r["kind"] == "rejoin"]
        assert {r["source"] for r in rejoins} <= {"replay", "checkpoint"} and rejoins, rejoins
        replays = [r for r in rejoins if r["source"] == "replay"]
        assert all(r["rounds_before"] % 2 == 0 and r["replayed"] == r["round"] - r["rounds_before"] for r in replays)
        assert summary["islands"][name]["rounds_replayed"] == sum(r["replayed"] for r in replays)
    assert re.search(r"^\[launch\] done in .*; rejoins: a replayed \d+ rounds, bitwise, b replayed \d+ rounds, "
                     r"bitwise; summary in", out, re.M), out[-3000:]


def test_two_coordinator_shards_with_tls_and_tokens_one_killed_give_the_same_bits_and_write_no_secret(
        straight, corpus, tmp_path):
    """Two coordinator shards (several chunks each) under one set of TLS credentials and tokens; shard 1 is
    SIGKILLed once round 1 is merged, the shard group restarts from its newest committed checkpoint set, the
    islands roll back, and the run ends on the bits of the uninterrupted, unsharded run."""
    workdir = tmp_path / "secure"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={workdir}",
           f"--config.data.files={corpus}", "--tls", "--restart=1", "--config.coordinator.shards=2",
           "--config.comm.chunk_bytes=8192", "--config.comm.reconnect_backoff_cap_seconds=1",
           # each exchange crosses an emulated link of 0.3 s one way (which changes when rounds end, not what they
           # hold), so that the kill lands before the last round is merged on a loaded machine
           "--config.comm.link.bandwidth_gbps=10", "--config.comm.link.latency_ms=300"]
    returncode, out, err = _kill_mid_run(cmd, "[launch] round 1/3", "coordinator/1")
    assert returncode == 0, out[-3000:] + err[-3000:]
    assert "[launch] coordinator/1 exited with status -9; restarting it (restart 1 of 1" in out
    resumed = {int(k): int(r) for k, r in re.findall(r"shard (\d) of 2 resumed from the checkpoint set of round (\d)", out)}
    start = resumed.get(0, 0)  # no line: no set was committed yet, and both start from the seed
    assert resumed.get(1, 0) == start and start in (0, 1, 2), resumed
    # after the restart, each shard merged each round once, from the round after its set on
    for folder in ("coordinator", "coordinator-shard-1"):
        merged = [r["round"] for r in read_jsonl(workdir / folder / "metrics.jsonl") if r["kind"] == "round"]
        assert merged[len(merged) - (3 - start):] == list(range(start + 1, 4)), merged
    final = json.load(open(workdir / "coordinator" / "summary.json"))["checksum"]
    assert final == json.load(open(straight[0] / "coordinator" / "summary.json"))["checksum"]
    result = subprocess.CompletedProcess(cmd, returncode, out, err)
    secrets = workdir / "secrets"
    token = (secrets / "token_a").read_text().strip()
    key = (secrets / "server.key").read_text()
    body = "".join(line for line in key.splitlines() if "-----" not in line)
    assert {p.name for p in secrets.iterdir()} >= {"ca.pem", "server.pem", "server.key", "tokens.json", "token_a"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in secrets.iterdir())
    logs = result.stdout + result.stderr
    assert token not in logs and body[:40] not in logs
    for path in workdir.rglob("*"):
        if path.is_file() and secrets not in path.parents and "checkpoints" not in path.parts:
            data = path.read_bytes()
            assert token.encode() not in data and body[:40].encode() not in data, path


def test_off_loopback_without_tls_the_coordinator_exits_naming_the_settings(corpus, tmp_path):
    env = role_env()
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), f"--config={CONFIG}",
           f"--workdir={tmp_path / 'open'}", f"--config.data.files={corpus}", "--role=coordinator",
           "--coordinator=0.0.0.0:0"]
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1
    assert "SecurityError" in refused.stderr and "comm.tls" in refused.stderr and "--insecure" in refused.stderr


def test_the_launcher_refuses_to_expose_the_coordinator_without_tls_before_starting_anything(corpus, tmp_path):
    result = launch(tmp_path / "open", corpus, "--host=0.0.0.0")
    assert result.returncode == 1 and "[launch] started" not in result.stdout
    assert "comm.tls" in result.stderr and "--insecure" in result.stderr and "--tls makes them" in result.stderr
