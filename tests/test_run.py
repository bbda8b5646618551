"""Every role in one process (`run_in_process`): determinism, bytes on the wire, workdir, resume, baseline."""

import json
import math
import os

import jax
import numpy as np
import pytest
from tiny_config import get_config, write_corpus

from island_jax import data as data_lib
from island_jax import experiment
from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import wire
from island_jax.config import fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator
from island_jax.island import Island
from island_jax.metrics import read_jsonl
from island_jax.model.init import checksum, count, init_params
from island_jax.outer import codec
from island_jax.run import run_in_process

ROUNDS = 4


def tiny_config(tmp_path, rounds=ROUNDS):
    """The tests' tiny two-island config over `rounds` rounds, on a corpus written to `tmp_path`."""
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.rounds = rounds
    c.metrics.routing_probe_tokens = 128  # the schema's default: these runs' records hold the top-k overlap
    c.metrics.plots = "timeline,routing"  # the schema's default: the workdir's figures are tested here
    return c


def records(workdir, role, kind):
    return [r for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == kind]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_islands")
    config = tiny_config(tmp)
    summary = run_in_process(config, str(tmp / "workdir"))
    return config, summary, tmp / "workdir"


def test_islands_end_every_round_on_the_coordinators_view(run):
    _, summary, workdir = run
    view = [r["checksum"] for r in records(workdir, "coordinator", "round")]
    assert [r["round"] for r in records(workdir, "coordinator", "round")] == [1, 2, 3, 4]
    for name in ("a", "b"):
        assert [r["checksum"] for r in records(workdir, f"islands/{name}", "round")] == view
    assert len(set(view)) == 4  # the parameters moved every round
    assert summary["checksums_agree"] is True and summary["checksums_agree_every_round"] is True


def test_a_run_with_topk_up_and_int8_down_agrees_every_round_in_the_codecs_bytes(tmp_path):
    config = tiny_config(tmp_path, rounds=2)
    config.codec.update(kind="topk", update_kind="int8")
    summary = run_in_process(config, str(tmp_path / "workdir"))
    _, params, _ = init_params(config)
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    topk_bytes = sum(math.ceil(min(64, min(4096, n - s)) * 14 / 8) + 4 for n in sizes for s in range(0, n, 4096))
    int8_bytes = sum(n + 4 * math.ceil(n / 256) for n in sizes)
    assert (summary["codec"], summary["update_codec"]) == ("topk", "int8")
    assert (summary["contribution_bytes"], summary["update_bytes"]) == (topk_bytes, int8_bytes)
    assert summary["checksums_agree"] is True and summary["checksums_agree_every_round"] is True
    for name in ("a", "b"):
        assert [r["payload_bytes"] for r in records(tmp_path / "workdir", f"islands/{name}", "round")] == [topk_bytes] * 2


def test_frame_bytes_tokens_and_summary(run):
    config, summary, workdir = run
    _, params, _ = init_params(config)
    plan = codec.chunk_plan(params, "int8", 256, config.comm.chunk_bytes)
    layout = codec.layout(params, "int8", 256)
    payload = codec.payload_bytes(params, "int8", 256)
    chunks = payload + len(plan) * wire.FRAMING_BYTES
    view = [r["checksum"] for r in records(workdir, "coordinator", "round")]
    for name, batch in (("a", 8), ("b", 4)):
        rounds = records(workdir, f"islands/{name}", "round")
        inner = records(workdir, f"islands/{name}", "inner")
        for r, rec in enumerate(rounds):
            # the frames a gRPC island sends: one header (step_seconds is a fixed-size double) and the chunks; the
            # header carries the round's routed counts (varints), the probe's top-2 choices of 128 tokens in its 1
            # MoE layer (a byte each) and, from the second round on, the post-sync loss change (a double)
            counts = np.sum([s["moe"]["routed_counts"] for s in inner if s["round"] == r + 1], axis=0)
            header = pb.PayloadHeader(
                round=r, island=name, tokens=2 * batch * 32, layout=layout,
                params_checksum=view[r - 1] if r else checksum(params), step_seconds=1.0, streams=1,
                total_bytes=payload, attempt=wire.new_attempt(), incarnation="0" * 32,  # a fixed64, 32 hex digits
                routed_counts=counts.reshape(-1).tolist(), routing_probe=bytes(1 * 128 * 2),
                post_sync_loss_change=0.0 if r else None,
            )
            trailer = pb.PayloadHeader(round=r, island=name, layout=layout, total_bytes=payload, crc32=1)
            assert rec["payload_bytes"] == payload
            assert rec["bytes_sent"] == len(wire.header_frame(header)) + chunks
            assert rec["bytes_received"] == chunks + len(wire.trailer_frame(trailer))
        isl = summary["islands"][name]
        assert isl["inner_steps"] == ROUNDS * 2 and isl["tokens"] == ROUNDS * 2 * batch * 32
        assert isl["bytes_sent"] == sum(r["bytes_sent"] for r in rounds)
        # every second of the island is compute, blocked or idle
        total = isl["compute_seconds"] + isl["seconds_blocked"] + isl["idle_seconds"]
        assert total == pytest.approx(isl["wall_seconds"], rel=1e-9)
        assert isl["compute_utilization"] == isl["ideal_compute_seconds"] / isl["wall_seconds"]
    on_disk = json.load(open(workdir / "summary.json"))
    assert on_disk["params"] == count(params) and on_disk["rounds"] == ROUNDS and on_disk["codec"] == "int8"
    assert on_disk["corpus"]["files"] == 30
    assert abs(on_disk["eval_loss_initial"] - np.log(256)) < 0.15
    assert on_disk["eval_loss_final"] < on_disk["eval_loss_initial"]
    assert on_disk["eval_bits_per_byte_final"] == on_disk["eval_loss_final"] / math.log(2)  # bytes: exactly
    evals = records(workdir, "islands/a", "eval")
    assert evals and all(r["eval_bits_per_byte"] == r["eval_loss"] / math.log(2) for r in evals)
    assert records(workdir, "coordinator", "round")[0]["weights"] == {"a": 2 / 3, "b": 1 / 3}  # 8 vs 4 sequences


def test_the_workdir_holds_every_roles_folder(run):
    _, _, workdir = run
    # max_to_keep 2; islands keep 3 at every_rounds 1, as a coordinator restart may need (workdir.checkpoint_schedule)
    for role, kept in (("coordinator", ["3", "4"]), ("islands/a", ["2", "3", "4"]), ("islands/b", ["2", "3", "4"])):
        assert {"config.json", "metrics.jsonl", "summary.json", "checkpoints"} <= {p.name for p in (workdir / role).iterdir()}
        assert sorted(p.name for p in (workdir / role / "checkpoints").iterdir()) == kept
        saved = records(workdir, role, "checkpoint")
        assert [r["round"] for r in saved] == [1, 2, 3, 4]
    assert (workdir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # beside it: plots.plot_routing
    evals = records(workdir, "islands/a", "eval")
    assert [r["round"] for r in evals] == [0, 3, 4] and not records(workdir, "islands/b", "eval")


def test_every_role_records_where_its_run_came_from(run):
    import platform
    import socket
    import subprocess
    import sys

    from island_jax import provenance

    _, _, workdir = run
    head = subprocess.run(["git", "-C", provenance._REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    for role in ("coordinator", "islands/a", "islands/b"):
        (start,) = json.loads((workdir / role / "run_info.json").read_text())["starts"]
        assert start["git"]["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
        assert isinstance(start["git"]["dirty"], bool) or start["git"]["commit"] is None
        assert start["versions"]["jax"] == jax.__version__ and start["versions"]["jaxlib"] == jax.lib.__version__
        assert set(start["versions"]) == set(provenance.PACKAGES) and start["versions"]["island_jax"] == "0.1.0"
        assert start["python"] == platform.python_version() and start["cpu"] == provenance.cpu_model()
        assert start["accelerator"] == dict(platform="cpu", kind="cpu", count=len(jax.local_devices()))
        assert start["hostname"] == socket.gethostname() and start["command"][0] == sys.executable
        assert isinstance(start["time"], float) and start["cpu_count"] == os.cpu_count()


def test_refuses_a_workdir_that_holds_a_finished_run(run):
    config, _, workdir = run
    before = (workdir / "summary.json").read_text()
    with pytest.raises(FileExistsError, match="holds a finished run"):
        run_in_process(config, str(workdir))
    assert (workdir / "summary.json").read_text() == before


def test_stopped_after_round_two_resumes_to_the_same_bits(run, tmp_path):
    config, _, straight = run
    config = tiny_config(tmp_path)
    config.islands.a.crash_at_round = 3
    workdir = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="island a crashes at round 3 on purpose"):
        run_in_process(config, str(workdir))
    for role in ("coordinator", "islands/a", "islands/b"):
        assert sorted(p.name for p in (workdir / role / "checkpoints").iterdir()) == ["1", "2"]
    config.islands.a.crash_at_round = 0
    summary = run_in_process(config, str(workdir))
    assert summary["checksums_agree"] is True
    for role in ("coordinator", "islands/a", "islands/b"):
        resumed = {r["round"]: r["checksum"] for r in records(workdir, role, "round")}
        assert resumed == {r["round"]: r["checksum"] for r in records(straight, role, "round")}
    assert summary["islands"]["b"]["inner_steps"] == ROUNDS * 2  # rounds trained twice count once
    # the routing diagnostics read back as the summaries read rounds: each round once, none missing, as straight
    rounds = {name: experiment.Result.load(str(w)).rounds for name, w in (("resumed", workdir), ("straight", straight))}
    routing = {name: r[r["role"] == "coordinator"].set_index("round").filter(like="routing.") for name, r in rounds.items()}
    assert list(routing["resumed"].index) == list(range(1, ROUNDS + 1))
    spikes = ["routing.post_sync_loss_change.a", "routing.post_sync_loss_change.b"]
    assert routing["resumed"][spikes].iloc[1:].notna().all().all()  # from round 2: the step after round 1's update
    assert routing["resumed"][spikes].iloc[0].isna().all()
    for column in ["routing.js_divergence", "routing.topk_overlap.a/b", "routing.router_distance.a", *spikes]:
        assert routing["resumed"][column].tolist()[1:] == routing["straight"][column].tolist()[1:], column


def test_inner_steps_log_routing_metrics_per_moe_layer(run):
    _, _, workdir = run
    for name in ("a", "b"):
        inner = records(workdir, f"islands/{name}", "inner")
        assert [r["step"] for r in inner] == list(range(1, 2 * ROUNDS + 1))
        for r in inner:
            moe = r["moe"]
            assert set(moe) == {"expert_load", "dropped_fraction", "router_entropy", "load_balancing_loss",
                                "router_z_loss", "capacity", "routed_counts"}
            # every real token (a: 8, b: 4 sequences of 32, none padded) routed to k = 2 experts, before drops
            assert sum(moe["routed_counts"][0]) == {"a": 8, "b": 4}[name] * 32 * 2
            assert len(moe["expert_load"]) == 1 and len(moe["expert_load"][0]) == 4
            assert abs(sum(moe["expert_load"][0]) - 1.0) < 1e-6
            assert 0.0 < moe["router_entropy"][0] <= np.log(4) + 1e-6
            assert r["router_entropy"] == moe["router_entropy"][0]  # the mean over one layer
            # capacity = ceil(1.0 x tokens_per_shard x 2 / 4): a has 8 x 32 / 4 = 64 tokens per device, b 64 too
            assert moe["capacity"] == [32]


def test_rounds_log_the_codecs_relative_error(run):
    _, _, workdir = run
    for name in ("a", "b"):
        # int8 with 256-element blocks loses well under 1% of a pseudo-gradient's norm, but not nothing
        assert all(0.0 < r["codec_relative_error"] < 0.01 for r in records(workdir, f"islands/{name}", "round"))
    assert all(0.0 < r["update_codec_relative_error"] < 0.01 for r in records(workdir, "coordinator", "round"))


def _islands(config):
    names = list(config.islands.keys())
    corpus = data_lib.load_corpus(config.data.files, config.data.eval_fraction, names)
    graphdef, params, specs = init_params(config)
    devices, out, start = jax.devices(), [], 0
    for name in names:
        n = config.islands[name].num_devices
        out.append(Island(name, config, devices[start : start + n], graphdef, params, specs,
                          corpus.train[name], config.outer.rounds))
        start += n
    return params, out


def test_one_fragment_without_overlap_is_plain_diloco(run):
    """F = 1, tau = 0 through the drivers, against DiLoCo written out by hand: H steps, encode,
    contribute, fetch, apply; the islands' global parameters match bit for bit every round."""
    config, _, workdir = run
    assert config.outer.fragments == 1 and config.outer.overlap_steps == 0
    params, islands = _islands(config)
    coordinator = Coordinator(config, params, [i.name for i in islands])
    for isl in islands:
        coordinator.join(isl.name, fingerprint_fields(config), isl.global_checksum)
    by_hand = []
    for r in range(config.outer.rounds):
        for isl in islands:
            result = isl.train_round()
            encoder = isl.encode_fragment(0, isl.fragment_pseudo_gradient(0))
            coordinator.contribute(ContributionHeader(r, isl.name, result["tokens"], isl.global_checksum), encoder.tobytes())
        for isl in islands:
            isl.apply_fragment(0, isl.decode_fragment(0, coordinator.fetch_update(r, isl.name)))
        by_hand.append(islands[0].global_checksum)
        assert islands[1].global_checksum == by_hand[-1]
    assert [r["checksum"] for r in records(workdir, "islands/a", "round")] == by_hand


def test_data_parallel_baseline_runs_through_run_island_with_no_exchange(tmp_path):
    """One island, no outer loop: the driver's parameters equal the same inner steps taken by hand."""
    config = tiny_config(tmp_path, rounds=3)
    del config.islands["b"]
    config.islands.a = island(6, 3, 2, 12, 2)
    config.outer.enabled = False
    config.eval.batch_size = 6
    summary = run_in_process(config, str(tmp_path / "baseline"))
    isl = summary["islands"]["a"]
    assert isl["bytes_sent"] == 0 and isl["inner_steps"] == 6 and isl["tokens"] == 6 * 12 * 32
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
    assert not (tmp_path / "baseline" / "coordinator").exists()
    _, (by_hand,) = _islands(config)
    for _ in range(config.outer.rounds):
        by_hand.train_round()
    rounds = records(tmp_path / "baseline", "islands/a", "round")
    assert rounds[-1]["checksum"] == checksum(jax.device_get(by_hand.params))
    windows = data_lib.eval_windows(data_lib.load_corpus(config.data.files, config.data.eval_fraction, ["a"]).eval,
                                    config.model.seq_len, config.eval.num_windows, config.eval.seed)
    losses = by_hand.evaluate(data_lib.eval_batches(windows, config.eval.batch_size))
    assert (summary["eval_loss_final"], summary["eval_loss_final_stderr"]) == data_lib.mean_and_stderr(losses)
    assert summary["eval_windows"] == 8 and summary["eval_windows_sha256"] == data_lib.windows_sha256(windows)


def test_a_role_stopped_before_its_first_round_is_a_new_run_and_one_with_rounds_is_refused(tmp_path):
    from island_jax.workdir import open_role

    config = tiny_config(tmp_path)
    folder = tmp_path / "islands" / "a"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps(dict(kind="eval", round=0, eval_loss=5.5)) + "\n")
    (folder / "config.json").write_text(json.dumps({"seed": 1}))  # whatever config it named
    open_role(config, str(folder)).close()  # stopped while compiling: a new run, and what it logged set aside
    assert read_jsonl(folder / "attempts" / "1" / "metrics.jsonl") == [dict(kind="eval", round=0, eval_loss=5.5)]
    assert json.loads((folder / "attempts" / "1" / "config.json").read_text()) == {"seed": 1}
    assert read_jsonl(folder / "metrics.jsonl") == [] and not (folder / "config.json").exists()  # written at begin
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps(dict(kind="round", round=1)) + "\n")
    with pytest.raises(FileExistsError, match="holds rounds of a run but no checkpoint to resume from"):
        open_role(config, str(folder))
    assert [r["kind"] for r in read_jsonl(folder / "metrics.jsonl")] == ["round"]


@pytest.mark.slow  # starts launch/local.py (which refuses before it starts any role)
def test_a_resume_under_another_config_is_refused_alike_unless_allowed(tmp_path, monkeypatch):
    import subprocess

    from processes import launch

    from island_jax import experiment
    from island_jax.config import ConfigChangeError

    config = tiny_config(tmp_path, rounds=2)
    config.islands.a.crash_at_round = 2
    workdir = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="island a crashes at round 2 on purpose"):
        run_in_process(config, str(workdir))
    files = {p: p.read_bytes() for p in workdir.rglob("*.json*")}
    changed = tiny_config(tmp_path, rounds=2)  # crash_at_round back to 0: a field that may change
    changed.inner.learning_rate = 1e-3
    message = (f"ConfigError: {workdir / 'coordinator'} was started with another config: inner.learning_rate "
               "(started with 0.003, now 0.001). Resume with the config it started with (its config.json), pass a "
               "new --workdir, or pass --allow_config_change to go on under this one and record the change")
    with pytest.raises(ConfigChangeError) as refused:
        run_in_process(changed, str(workdir))
    assert str(refused.value) == message
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("experiment.run started a process"))
    with pytest.raises(ConfigChangeError) as refused:
        experiment.run(changed, str(workdir), progress=False)
    assert str(refused.value) == message
    monkeypatch.undo()
    result = launch(workdir, changed.data.files, "--config.outer.rounds=2", "--config.inner.learning_rate=0.001")
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == message, result.stderr[-2000:]
    assert {p: p.read_bytes() for p in workdir.rglob("*.json*")} == files  # nothing was changed

    summary = run_in_process(changed, str(workdir), allow_config_change=True)
    assert summary["rounds"] == 2 and summary["checksums_agree"] is True
    for role in ("coordinator", "islands/a", "islands/b"):
        assert json.loads((workdir / role / "config.json").read_text())["inner"]["learning_rate"] == 1e-3
        # the change allowed, and the one that needs no leave (crash_at_round), both recorded
        changes = records(workdir, role, "config_change")
        assert [isinstance(r.pop("time"), float) for r in changes] == [True]  # when it was written, Unix seconds
        assert changes == [dict(
            kind="config_change", round=1, changes=[dict(field="inner.learning_rate", started=0.003, now=0.001),
                                                    dict(field="islands.a.crash_at_round", started=2, now=0)],
        )]
        starts = json.loads((workdir / role / "run_info.json").read_text())["starts"]
        assert len(starts) == 2 and "config_changes" not in starts[0]
        assert starts[1]["config_changes"] == [["inner.learning_rate", 0.003, 0.001], ["islands.a.crash_at_round", 2, 0]]
        assert json.loads((workdir / role / "config.json").read_text())["islands"]["a"]["crash_at_round"] == 0


def test_bits_per_byte_counts_the_texts_bytes_not_the_tokens():
    assert data_lib.bits_per_byte(2.0, 1000, 1000) == 2.0 / math.log(2)
    assert data_lib.bits_per_byte(2.0, 1000, 3370) == 2.0 / math.log(2) * (1000 / 3370)  # 3.37 bytes per BPE token
    with pytest.raises(ValueError, match="bits per byte of 0 bytes of text; score at least one byte"):
        data_lib.bits_per_byte(2.0, 10, 0)


def test_one_island_with_outer_lr_1_no_momentum_and_no_codec_is_data_parallel(tmp_path):
    """DiLoCo with M = 1, outer SGD lr 1, momentum 0 and codec none against `baseline_dp`'s run (the outer loop
    off) on the same 6 devices, batch 12 and data, 2 rounds of 2 inner steps.

    Each round the island sends pg = a - l (a: the round's global parameters, l: its own after the inner steps)
    and takes back the view a - pg: l, up to rounding. Four float32 operations round on the way (pg = a - l at
    the island; the master a - pg and the update master - a at the coordinator; a + update at the island),
    each by at most 2^-24 of its result, so each element of the view is within 2^-23 (|a - l| + |l|) of l: the
    bound asserted every round (a defect of the outer loop, momentum left on or an lr of 0.99, is orders of
    magnitude outside it). The inner steps are data parallel's bit for bit from equal parameters (round 1), and
    after both rounds every held-out window's loss is within 2 float32 ulps of data parallel's: the rounding's
    perturbation of round 1 carried through round 2's two AdamW steps (measured: 1 ulp at most)."""
    import copy

    config = tiny_config(tmp_path, rounds=2)
    del config.islands["b"]
    config.islands.a = island(6, 3, 2, 12, 2)
    config.outer.update(learning_rate=1.0, momentum=0.0)
    config.codec.kind = "none"
    baseline = copy.deepcopy(config)
    baseline.outer.enabled = False
    _, (dp,) = _islands(baseline)
    params, (isl,) = _islands(config)
    coordinator = Coordinator(config, params, ["a"])
    coordinator.join("a", fingerprint_fields(config), isl.global_checksum)

    def leaves(tree):
        return [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(tree))]

    anchor = leaves(params)
    for r in range(config.outer.rounds):
        dp.train_round()
        result = isl.train_round()
        # the round's routed assignments: its steps' summed, every real token to num_experts_per_token experts
        routed = isl.take_routed_counts(0, result["tokens"])
        assert routed["routed_counts"].dtype == np.int64 and routed["unrouted_tokens"] == 0
        assert routed["routed_counts"].tolist() == np.sum([m["routed_counts"] for m in result["layers"]], 0).tolist()
        assert routed["routed_counts"].sum(1).tolist() == [result["tokens"] * config.moe.num_experts_per_token]
        assert isl.routed_steps.tolist() == [0] and not isl.routed_pending.any()  # taken: counted again from zero
        local = leaves(isl.params)
        if r == 0:  # the same inner steps from the same parameters
            assert checksum(jax.device_get(isl.params)) == checksum(jax.device_get(dp.params))
        encoder = isl.encode_fragment(0, isl.fragment_pseudo_gradient(0))
        coordinator.contribute(ContributionHeader(r, "a", result["tokens"], isl.global_checksum, **routed),
                               encoder.tobytes())
        isl.apply_fragment(0, isl.decode_fragment(0, coordinator.fetch_update(r, "a")))
        view = leaves(isl.params)
        for v, end, a in zip(view, local, anchor):
            assert np.all(np.abs(v - end) <= 2.0**-23 * (np.abs(a - end) + np.abs(end)))
        anchor = view
    windows = data_lib.eval_windows(data_lib.load_corpus(config.data.files, config.data.eval_fraction, ["a"]).eval,
                                    config.model.seq_len, config.eval.num_windows, config.eval.seed)
    batches = list(data_lib.eval_batches(windows, 6))
    diloco_losses, dp_losses = isl.evaluate(batches), dp.evaluate(batches)
    assert diloco_losses.dtype == dp_losses.dtype == np.float32 and len(dp_losses) == 8
    assert np.all(np.abs(diloco_losses - dp_losses) <= 2 * np.spacing(dp_losses))


def test_the_inner_learning_rate_is_one_schedule_over_the_whole_run(tmp_path):
    """Two islands, 3 rounds of H = 2: each island's warm-up (2 steps) and cosine decay (to 0.1 x peak) span its
    6 inner steps, not each round. Logged steps are counted from 1; the schedule reads the steps taken before."""
    config = tiny_config(tmp_path, rounds=3)
    config.inner.update(learning_rate=3e-3, warmup_steps=2, min_learning_rate_ratio=0.1)
    config.metrics.writers = "jsonl"
    run_in_process(config, str(tmp_path / "workdir"))
    peak, end = 3e-3, 3e-4
    expected = {
        3: peak,  # round 2's first step: the warm-up's end (a schedule restarted each round would give 0 here)
        5: end + (peak - end) * 0.5 * (1 + math.cos(math.pi * 2 / 4)),  # round 3's first: half-way down the cosine
        6: end + (peak - end) * 0.5 * (1 + math.cos(math.pi * 3 / 4)),  # round 3's last
    }
    for name in ("a", "b"):
        logged = {r["step"]: r["learning_rate"] for r in records(tmp_path / "workdir", f"islands/{name}", "inner")}
        assert sorted(logged) == [1, 2, 3, 4, 5, 6]
        assert logged[1] == 0.0
        for step, lr in expected.items():
            assert logged[step] == pytest.approx(lr, rel=1e-6), (name, step)
