"""Round planning from the hardware catalog, and token-weighted merging of unequal rounds."""

import numpy as np
import pytest

from island_jax import config as config_lib
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, FragmentCoordinator
from island_jax.hardware import CATALOG, lookup
from island_jax.outer import codec
from island_jax.outer.inner_steps import plan_inner_steps


def _h100_and_a100():
    c = default_config()
    c.islands.fast = island(8, 2, 4, 64, 50, hardware="h100")
    c.islands.slow = island(8, 2, 4, 64, 100, hardware="a100")
    c.outer.update(sync="auto", reference_island="slow", learning_rate=1.0, momentum=0.0, nesterov=False)
    c.codec.kind = "none"
    return c


def test_catalog_figures():
    assert lookup("a100").peak_tflops == 312.0 and lookup("h100").peak_tflops == 989.0
    assert set(CATALOG) >= {"cpu", "a100", "h100", "h200", "b200", "tpu-v4", "tpu-v5p", "tpu-v6e"}
    with pytest.raises(KeyError, match="'v100' is not in the catalog"):
        lookup("v100")


def test_auto_steps_scale_with_devices_times_peak_and_merge_by_tokens():
    c = _h100_and_a100()
    config_lib.validate(c)
    plan = plan_inner_steps(c)
    assert plan == {"fast": 317, "slow": 100}  # round(100 x 8 x 989 / (8 x 312)) = round(316.99)
    c.outer.sync = "steps"
    assert plan_inner_steps(c) == {"fast": 50, "slow": 100}
    c.outer.sync = "auto"
    coordinator = FragmentCoordinator(c, {"w": np.zeros(2, np.float32)}, ["fast", "slow"])
    for name in ("fast", "slow"):
        coordinator.join(name, fingerprint_fields(c), coordinator.checksum)
    for name, pg in (("fast", [1.0, 0.0]), ("slow", [0.0, 1.0])):
        tokens = plan[name] * c.islands[name].batch_size * c.model.seq_len
        coordinator.contribute(ContributionHeader(0, name, tokens), codec.encode({"w": np.asarray(pg, np.float32)}, "none", 256))
    rec = coordinator.history[-1]
    assert rec.weights == {"fast": 317 / 417, "slow": 100 / 417}


def test_auto_needs_equal_per_device_batch_and_known_hardware():
    c = _h100_and_a100()
    c.islands.fast.batch_size = 128
    with pytest.raises(config_lib.ConfigError, match="equal per-device batch"):
        config_lib.validate(c)
    c = _h100_and_a100()
    c.islands.fast.hardware = "v100"
    with pytest.raises(config_lib.ConfigError, match="islands.fast.hardware is 'v100', not in the hardware catalog"):
        config_lib.validate(c)


def test_time_rounds_give_a_half_speed_island_about_half_its_tokens(tmp_path):
    """hetero_islands in short form, in one process: b trains at simulated_speed 0.5 for the same wall clock."""
    from tiny_config import get_config, write_corpus

    from island_jax.metrics import read_jsonl
    from island_jax.run import run_in_process

    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.islands.b.simulated_speed = 0.5
    c.outer.update(sync="time", round_seconds=2.0, rounds=3)
    run_in_process(c, str(tmp_path / "run"))
    b_rounds = [r for r in read_jsonl(tmp_path / "run" / "islands" / "b" / "metrics.jsonl") if r["kind"] == "round"]
    for r in b_rounds[1:]:  # after compiling
        # A step costs its compute and a sleep of the median recent compute (SimulatedSpeed), so b's median step
        # takes about twice its median compute: about half the steps, and tokens, in the round's wall clock.
        # Medians on both sides, as the sleep uses: on a loaded machine the steps' mean runs above their median.
        full_speed_steps = c.outer.round_seconds / r["compute_step_seconds"]
        half_speed_steps = c.outer.round_seconds / r["step_seconds"]
        assert 0.35 < half_speed_steps / full_speed_steps < 0.65, r
    merged = read_jsonl(tmp_path / "run" / "coordinator" / "metrics.jsonl")
    for rec in [r for r in merged if r["kind"] == "round"]:
        total = sum(rec["tokens"].values())
        assert rec["weights"] == {k: v / total for k, v in rec["tokens"].items()}


def test_measured_plan_from_round_zero_step_times():
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 10)
    c.islands.b = island(1, 1, 1, 2, 10)  # another per-device batch: fine when measured
    c.outer.update(sync="auto", auto_from="measured", learning_rate=1.0, momentum=0.0, nesterov=False)
    c.codec.kind = "none"
    config_lib.validate(c)
    coordinator = FragmentCoordinator(c, {"w": np.zeros(2, np.float32)}, ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(c), coordinator.checksum)
    pg = codec.encode({"w": np.ones(2, np.float32)}, "none", 256)
    coordinator.contribute(ContributionHeader(0, "a", 100, None, 0.1), pg)
    assert coordinator.planned_inner_steps("b") is None
    coordinator.contribute(ContributionHeader(0, "b", 100, None, 0.25), pg)
    assert coordinator.plan_steps == {"a": 10, "b": 4}  # round(10 x 0.1 / 0.25)


def test_measured_plan_in_a_run(tmp_path):
    from tiny_config import get_config, write_corpus

    from island_jax.metrics import read_jsonl
    from island_jax.run import run_in_process

    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.islands.a.inner_steps = 4
    c.islands.b.simulated_speed = 0.25
    c.outer.update(sync="auto", auto_from="measured", rounds=3)
    run_in_process(c, str(tmp_path / "run"))
    rounds = {
        name: [r for r in read_jsonl(tmp_path / "run" / "islands" / name / "metrics.jsonl") if r["kind"] == "round"]
        for name in ("a", "b")
    }
    expected_b = max(1, round(4 * rounds["a"][0]["step_seconds"] / rounds["b"][0]["step_seconds"]))
    assert rounds["b"][0]["inner_steps"] == 2  # round 0: the catalog plan, round(4 x 2 devices / 4 devices)
    assert [r["inner_steps"] for r in rounds["b"][1:]] == [expected_b, expected_b]
    assert [r["inner_steps"] for r in rounds["a"]] == [4, 4, 4]
