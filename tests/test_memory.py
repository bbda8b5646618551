"""The memory budget per device (island/memory.py): from shapes, as placed, and the refusal of a config that
cannot fit, before anything is made."""

import os
import subprocess
import sys

import jax
import pytest
from tiny_config import get_config, write_corpus

from island_jax.config import ConfigError, default_config, island
from island_jax.island import memory
from island_jax.mesh import without_forced_device_count
from island_jax.model.flops import model_size
from island_jax.model.init import abstract_params
from island_jax.run import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_state_bytes_shard_every_embed_dimension_over_fsdp():
    c = get_config()  # the tiny model: V 256, D 32, S 32, one block, 4 experts of F 32
    c.islands.a.mesh.update(data=1, fsdp=4, expert=1)
    d, v, s, e, f = 32, 256, 32, 4, 32
    whole = 3 * d  # the three norms' scales: replicated
    embed = v * d + s * d + 3 * d * d + d * d + d * e + 3 * e * d * f + d * v  # every other leaf has D
    assert whole + embed == model_size(c).total_params
    params = 4 * (whole + embed // 4)
    assert memory.state_bytes(c, "a") == (params, params, 2 * params, params)
    # island b: data=1 x fsdp=1 x expert=2, the experts split over expert only
    experts = 3 * e * d * f
    assert memory.state_bytes(c, "b")[0] == 4 * (whole + embed - experts + experts // 2)


def test_a_run_that_cannot_fit_is_refused_before_anything_is_made(tmp_path):
    c = default_config()
    c.model.update(d_model=2048, num_layers=12, num_heads=16)
    c.moe.update(num_experts=4, expert_hidden_dim=4096)
    c.islands.a = island(1, 1, 1, 1, 1, memory_gb=1)
    c.outer.enabled = False
    c.eval.batch_size = 1
    c.data.files = write_corpus(tmp_path / "corpus")
    total = model_size(c).total_params
    assert 1e9 < total < 1.7e9  # a 1B-parameter model
    need = memory.budget(c, "a")
    assert need.params == 4 * total and need.state == 20 * total
    expected = (f"ConfigError: islands.a needs {need.total / 1e9:.2f} GB per device but its devices have 1.00 GB "
                f"(islands.a.memory_gb, or the catalog's for 'cpu'): parameters {4 * total / 1e9:.2f}, gradients "
                f"{4 * total / 1e9:.2f}, optimizer state {8 * total / 1e9:.2f}, anchor {4 * total / 1e9:.2f} and "
                f"activations {need.activations / 1e9:.2f} GB (estimated from shapes). Shard the state over more "
                "devices (islands.a.mesh.fsdp, now 1), recompute activations (model.remat='full'), or lower "
                "islands.a.batch_size (now 1)")
    with pytest.raises(ConfigError) as raised:
        run_in_process(c, str(tmp_path / "workdir"))
    assert str(raised.value) == expected
    assert not (tmp_path / "workdir").exists()  # nothing made, nothing saved
    c.islands.a.memory_gb = 0  # unknown (the cpu catalog's 0): not checked
    memory.check_fits(c)


def test_remat_full_keeps_less_by_the_estimate():
    c = get_config()  # d 32, 2 heads over 32 positions, 4 experts of 32 (top-2), 256 symbols, float32
    c.model.num_layers = 4
    # per token and block: 9 d and H S (4 + 2 x 4) bytes for attention, 4 E of router logits, k (2 d + 4 F) for
    # the experts
    block = 9 * 32 * 4 + 2 * 32 * (4 + 2 * 4) + 4 * 4 + 2 * (2 * 32 + 4 * 32) * 4
    head = 3 * 256 * 4
    tokens = 8 * 32 // 4  # island a: 8 sequences of 32 over 4 devices
    estimates = {}
    for remat in ("none", "dots_saveable", "full", "nothing_saveable"):
        c.model.remat = remat
        estimates[remat] = memory.estimated_activation_bytes(c, "a")
    assert estimates == {
        "none": tokens * (4 * block + head), "dots_saveable": tokens * (4 * block + head),  # saves some: as none
        "full": tokens * (4 * 32 * 4 + block + head), "nothing_saveable": tokens * (4 * 32 * 4 + block + head),
    }
    assert estimates["none"] == 1_085_440 and estimates["full"] == 451_584


def test_a_dry_run_compiles_every_program_from_shapes_and_allocates_nothing():
    c = get_config()
    c.islands.a.mesh.update(data=1, fsdp=2, expert=2)
    before = jax.live_arrays()  # held, so that no array of another test is freed and its id reused meanwhile
    results = memory.dry_run(c, ["a", "b"], jax.devices()[:4])
    assert [a for a in jax.live_arrays() if all(a is not b for b in before)] == []  # nothing drawn, placed or run
    for name in ("a", "b"):
        r = results[name]
        assert r.estimate == memory.budget(c, name)
        assert r.compiled.devices == f"{c.islands[name].num_devices} cpu" and r.compiled.target is None
        inner, evaluation, pseudo_gradient = r.compiled.programs
        params, optimizer = r.estimate.params, r.estimate.optimizer
        # the parameters and AdamW's moments and two int32 counts, donated; the batch: two int32 [B, 32] (the step
        # seeds no router jitter here, and jit leaves out an argument its program does not read)
        batch = 2 * c.islands[name].batch_size * 32 * 4 // c.islands[name].num_devices
        assert (inner.argument, inner.alias, inner.resident) == (params + optimizer + 8 + batch,
                                                                 params + optimizer + 8, params)
        assert (evaluation.resident, pseudo_gradient.resident) == (params + optimizer + 8, 2 * params + 8)
        # the pseudo-gradient's float32 outer leaves, and XLA:CPU's table of their buffers (8 bytes a leaf)
        leaves = len(jax.tree.leaves(abstract_params(c)[1]))
        assert (pseudo_gradient.argument, pseudo_gradient.output) == (2 * params, params + 8 * leaves)
    lines = memory.table(results, c).splitlines()
    assert lines[0] == "island a: 4 cpu, mesh data=1 x fsdp=2 x expert=2, cpu: memory unknown"
    assert [line.split()[0] for line in lines[2:6]] == ["inner_step", "eval_step", "pseudo_gradient", "estimate"]
    assert lines[1].split()[:3] == ["program", "argument", "MB"]


@pytest.mark.slow
def test_the_dry_run_command_prints_the_budget_and_refuses_what_cannot_fit(tmp_path):
    env = without_forced_device_count(os.environ) | {"PYTHONPATH": os.path.join(ROOT, "tests")}
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--config=tests/tiny_config.py", "--dry_run"]
    done = subprocess.run(cmd + ["--target=a=tpu-v5p-8", "--role=island", "--island=a"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and lines[0] == ("island a: 4 TPU v5 (target tpu-v5p-8), mesh data=2 x fsdp=1 x expert=2, "
                                            "tpu-v5p: 95 GB per device")
    assert [line.split()[0] for line in lines[2:6]] == ["inner_step", "eval_step", "pseudo_gradient", "estimate"]
    assert [line.split()[-1] for line in lines[2:6]] == ["yes"] * 4
    # libtpu looks for the TPU VM it is on unless told otherwise, and logs that it found none
    assert "TPU_WORKER_HOSTNAMES" not in done.stderr and "TPU_ACCELERATOR_TYPE" not in done.stderr
    refused = subprocess.run(cmd + ["--config.islands.b.memory_gb=1e-6"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith("ConfigError: islands.b needs 0.00 GB per device but "
                                                              "its devices have 0.00 GB")


def test_the_planner_prints_each_islands_memory_from_shapes():
    from island_jax.plan import memory_lines

    c = get_config()
    c.islands.a.memory_gb = 1e-4
    a, b = memory.budget(c, "a"), memory.budget(c, "b")
    assert memory_lines(c).splitlines() == [
        "memory per device, from shapes (parameters, gradients, optimizer state, anchor; activations):",
        f"  a: {a.total / 1e9:.3f} GB of 0.0001 GB ({a.params / 1e9:.3f}, {a.grads / 1e9:.3f}, {a.optimizer / 1e9:.3f}, "
        f"{a.anchor / 1e9:.3f}; {a.activations / 1e9:.3f}) DOES NOT FIT",
        f"  b: {b.total / 1e9:.3f} GB of unknown GB ({b.params / 1e9:.3f}, {b.grads / 1e9:.3f}, {b.optimizer / 1e9:.3f}, "
        f"{b.anchor / 1e9:.3f}; {b.activations / 1e9:.3f})",
    ]
    assert a.total > 1e5  # the tiny model's state and activations exceed 0.0001 GB
