"""Parameter counts and training FLOPs per token (model/flops.py), and the MFU an island reports."""

import numpy as np
import pytest
from tiny_config import get_config, write_corpus

from island_jax import hardware
from island_jax.config import ConfigError
from island_jax.island.island import Island
from island_jax.metrics import read_jsonl
from island_jax.model.flops import model_size, train_flops_per_token
from island_jax.model.init import count, init_params
from island_jax.run import run_in_process


def test_the_tiny_models_counts_and_flops_per_token_by_hand():
    c = get_config()  # V 256, D 32, S 32, one block of 2 heads, E 4 experts of F 32, top-2
    v, d, s, e, f, k = 256, 32, 32, 4, 32, 2
    assert (c.model.vocab_size, c.model.d_model, c.model.seq_len, c.moe.num_experts, c.moe.expert_hidden_dim,
            c.moe.num_experts_per_token) == (v, d, s, e, f, k)
    routed = 3 * e * d * f  # w_gate, w_up [E, D, F] and w_down [E, F, D]
    block = d + 3 * d * d + d * d + d + d * e + routed  # two norms, qkv, out, router, experts
    total = v * d + s * d + block + d + d * v  # embedding, positions, the block, final norm, head
    assert (total, routed) == (34016, 12288)
    size = model_size(c)
    _, params, _ = init_params(c)
    assert size.total_params == count(params) == total
    assert size.routed_params == routed
    assert size.active_params == total - routed + routed * k // e == 27872
    # PaLM's 6 N + 12 L S D
    assert size.flops_per_token == train_flops_per_token(27872, 1, 32, 32) == 6 * 27872 + 12 * 1 * 32 * 32 == 179520
    assert train_flops_per_token(1e9) == 6e9  # a planner with counts only: 6 N


def test_peak_flops_on_an_accelerator_is_the_catalogs_and_on_cpu_one_measured_figure():
    assert hardware.peak_flops("h100", 8, "gpu") == 8 * 989e12
    cpu = hardware.peak_flops("cpu", 4, "cpu")
    assert cpu == hardware.peak_flops("cpu", 1, "cpu") == hardware.measured_cpu_peak_flops() > 0
    with pytest.raises(KeyError, match="hardware 'v100' is not in the catalog"):
        hardware.peak_flops("v100", 8, "gpu")


def test_every_round_record_and_the_summary_give_the_islands_mfu(tmp_path):
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.rounds = 2
    summary = run_in_process(c, str(tmp_path / "workdir"))
    peak = hardware.measured_cpu_peak_flops()  # this process's, which its islands used
    for name in ("a", "b"):
        rounds = [r for r in read_jsonl(tmp_path / "workdir" / "islands" / name / "metrics.jsonl")
                  if r["kind"] == "round"]
        tokens = c.islands[name].batch_size * c.model.seq_len
        for r in rounds:
            assert r["mfu"] == pytest.approx(179520 * tokens / (peak * r["step_seconds"]), rel=1e-12)
        weights = [r["inner_steps"] * r["step_seconds"] for r in rounds]
        expected = float(np.average([r["mfu"] for r in rounds], weights=weights))
        assert summary["islands"][name]["mfu"] == pytest.approx(expected, rel=1e-12)


def test_an_island_on_accelerators_left_at_hardware_cpu_is_refused_naming_its_kind():
    class H100:  # what an island's first device reports; the check comes before anything uses the devices
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    with pytest.raises(ConfigError, match=r"^ConfigError: islands\.a\.hardware is 'cpu' but its devices are gpu \(NVIDIA H100 80GB "
                                          r"HBM3\); set islands\.a\.hardware to their catalog name \(h100\)$"):
        Island("a", get_config(), [H100()] * 4, None, None, None, np.zeros(4096, np.uint8), 3)
