"""Two unequal islands in one process: determinism, bytes on the wire, summary."""

import json

import jax
import numpy as np
import pytest
from tiny_config import get_config, write_corpus

from island_jax.config import island
from island_jax.outer import codec
from island_jax.params import count, init_params
from island_jax.train import train_and_evaluate


def tiny_config(tmp_path):
    """The tests' tiny two-island config, on a corpus written to `tmp_path`."""
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_islands")
    config = tiny_config(tmp)
    summary = train_and_evaluate(config, str(tmp / "workdir"))
    records = [json.loads(line) for line in open(tmp / "workdir" / "metrics.jsonl")]
    return config, summary, records, tmp / "workdir"


def test_islands_hold_bit_identical_global_parameters_every_round(run):
    _, _, records, _ = run
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert set(r["checksums"]) == {"a", "b", "coordinator"}
        assert len(set(r["checksums"].values())) == 1
    assert len({r["checksums"]["a"] for r in rounds}) == 3  # parameters moved every round


def test_bytes_on_the_wire_and_summary(run):
    config, summary, records, workdir = run
    _, params, _ = init_params(config)
    per_round = codec.payload_bytes(params, "int8", 256)
    p = count(params)
    assert abs(per_round / (p * (1 + 4 / 256)) - 1) < 0.02
    for name, steps, batch in (("a", 2, 8), ("b", 2, 4)):
        isl = summary["islands"][name]
        got = {k: isl[k] for k in ("inner_steps", "tokens", "bytes_sent", "bytes_received")}
        assert got == dict(inner_steps=3 * steps, tokens=3 * steps * batch * 32,
                           bytes_sent=3 * per_round, bytes_received=3 * per_round)
        # every second of the island is compute, blocked or idle
        total = isl["compute_seconds"] + isl["seconds_blocked"] + isl["idle_seconds"]
        assert total == pytest.approx(isl["wall_seconds"], rel=1e-9)
        assert isl["compute_utilization"] == isl["ideal_compute_seconds"] / isl["wall_seconds"]
    on_disk = json.load(open(workdir / "summary.json"))
    assert on_disk["params"] == p and on_disk["rounds"] == 3 and on_disk["codec"] == "int8"
    assert on_disk["corpus"]["files"] == 30
    assert abs(on_disk["eval_loss_initial"] - np.log(256)) < 0.15
    assert on_disk["eval_loss_final"] < on_disk["eval_loss_initial"]
    weights = [r["weights"] for r in records if r["kind"] == "round"][0]
    assert weights == {"a": 2 / 3, "b": 1 / 3}  # 8 vs 4 sequences per step


def test_baseline_without_outer_loop(tmp_path):
    config = tiny_config(tmp_path)
    del config.islands["b"]
    config.islands.a = island(6, 3, 2, 12, 2)
    config.outer.enabled = False
    config.eval.batch_size = 6
    summary = train_and_evaluate(config, str(tmp_path / "baseline"))
    assert summary["islands"]["a"]["bytes_sent"] == 0 and summary["islands"]["a"]["inner_steps"] == 6
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]


def test_refuses_a_workdir_that_holds_a_run(run):
    config, _, _, workdir = run
    before = open(workdir / "metrics.jsonl").read()
    with pytest.raises(FileExistsError, match="already holds a run"):
        train_and_evaluate(config, str(workdir))
    assert open(workdir / "metrics.jsonl").read() == before


def test_inner_steps_log_routing_metrics_per_moe_layer(run):
    _, _, records, _ = run
    inner = [r for r in records if r["kind"] == "inner"]
    assert len(inner) == 12  # 2 islands x 3 rounds x 2 steps
    for r in inner:
        moe = r["moe"]
        assert set(moe) == {"expert_load", "dropped_fraction", "router_entropy", "load_balancing_loss",
                            "router_z_loss", "capacity"}
        assert len(moe["expert_load"]) == 1 and len(moe["expert_load"][0]) == 4
        assert abs(sum(moe["expert_load"][0]) - 1.0) < 1e-6
        assert 0.0 < moe["router_entropy"][0] <= np.log(4) + 1e-6
        assert r["router_entropy"] == moe["router_entropy"][0]  # the mean over one layer
    # capacity = ceil(1.0 x tokens_per_shard x 2 / 4): island a has 8 x 32 / 4 = 64 tokens per device, b 64 too
    assert {r["moe"]["capacity"][0] for r in inner} == {32}


def test_rounds_log_the_codecs_relative_error(run):
    _, _, records, _ = run
    for r in [r for r in records if r["kind"] == "round"]:
        # int8 with 256-element blocks loses well under 1% of a pseudo-gradient's norm, but not nothing
        assert set(r["codec_relative_error"]) == {"a", "b"}
        assert all(0.0 < e < 0.01 for e in r["codec_relative_error"].values())
        assert 0.0 < r["update_codec_relative_error"] < 0.01


def test_one_fragment_without_overlap_is_plain_diloco(run):
    """F = 1, tau = 0 (the run above goes through StreamingSync) against DiLoCo written out by hand:
    H steps, encode, contribute, fetch, apply; the islands' global parameters match bit for bit every round."""
    from island_jax import data as data_lib
    from island_jax.config import fingerprint_fields
    from island_jax.coordinator import Coordinator
    from island_jax.params import checksum
    from island_jax.train import build_islands

    config, _, records, _ = run
    assert config.outer.fragments == 1 and config.outer.overlap_steps == 0
    names = list(config.islands.keys())
    corpus = data_lib.load_corpus(config.data.files, config.data.eval_fraction, names)
    graphdef, params, specs = init_params(config)
    islands = build_islands(config, corpus, graphdef, params, specs)
    coordinator = Coordinator(config, params, names)
    for isl in islands:
        coordinator.join(isl.name, fingerprint_fields(config), isl.global_checksum)
    by_hand = []
    for r in range(config.outer.rounds):
        for isl in islands:
            result = isl.train_round()
            coordinator.contribute(r, isl.name, result["tokens"], isl.encode_pseudo_gradient().tobytes(),
                                   isl.global_checksum)
        for isl in islands:
            isl.apply_update(coordinator.fetch_update(r, isl.name))
        by_hand.append({isl.name: checksum(jax.device_get(isl.params)) for isl in islands})
    streamed = [{n: r["checksums"][n] for n in names} for r in records if r["kind"] == "round"]
    assert streamed == by_hand
    assert len({c["a"] for c in by_hand}) == 3
