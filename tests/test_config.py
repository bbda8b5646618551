"""Config validation: every rule names its field and the fix, before anything compiles."""

import os
import subprocess
import sys

import pytest

from island_jax.config import ConfigError, default_config, island, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _two_islands():
    c = default_config()
    c.islands.a = island(4, 2, 2, 16, 25)
    c.islands.b = island(2, 1, 2, 8, 25)
    return c


def test_two_islands_is_valid():
    validate(_two_islands(), num_available_devices=6)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.islands.b.update(num_devices=4),
         r"islands\.b\.mesh has data=1, fsdp=1, expert=2 \(2 devices\) but islands\.b\.num_devices is 4; make data x "
         r"fsdp x expert equal num_devices"),
        (lambda c: c.moe.update(num_experts=5), r"moe\.num_experts=5 is not divisible by islands\.a\.mesh\.expert=2"),
        (lambda c: c.islands.a.mesh.update(data=1, fsdp=3),
         r"islands\.a\.mesh has data=1, fsdp=3, expert=2 \(6 devices\) but islands\.a\.num_devices is 4"),
        (lambda c: c.model.update(d_model=90, num_heads=2) or c.islands.a.mesh.update(data=1, fsdp=4, expert=1),
         r"model\.d_model=90 is not divisible by islands\.a\.mesh\.fsdp=4: fsdp splits every parameter on its "
         r"leading dimension that is not the experts' .*; choose fsdp as a divisor of d_model$"),
        (lambda c: c.model.update(seq_len=66) or c.islands.a.mesh.update(data=1, fsdp=4, expert=1),
         r"model\.seq_len=66 is not divisible by islands\.a\.mesh\.fsdp=4: .*; choose fsdp as a divisor of seq_len$"),
        (lambda c: c.moe.update(expert_hidden_dim=30) or c.islands.a.mesh.update(data=1, fsdp=4, expert=1),
         r"moe\.expert_hidden_dim=30 is not divisible by islands\.a\.mesh\.fsdp=4: .*; choose fsdp as a divisor "
         r"of expert_hidden_dim$"),
        (lambda c: c.islands.b.update(memory_gb=-1.0), r"islands\.b\.memory_gb is -1\.0; use 0"),
        (lambda c: c.islands.a.update(batch_size=10), r"islands\.a\.batch_size=10 is not divisible by data x fsdp x expert = 4"),
        (lambda c: c.moe.update(num_experts_per_token=5), r"moe\.num_experts_per_token \(top-k\) is 5 but moe\.num_experts is 4"),
        (lambda c: c.codec.update(kind="int3"), r"codec\.kind is 'int3', an unknown codec"),
        (lambda c: c.codec.update(block_size=0), r"codec\.block_size is 0"),
        (lambda c: c.codec.update(update_kind="int2"), r"codec\.update_kind is 'int2', an unknown codec"),
        (lambda c: c.codec.update(topk_k=5000), r"codec\.topk_group is 4096 and codec\.topk_k 5000; keep 1 <= topk_k"),
        (lambda c: c.codec.update(error_feedback_decay=1.5), r"codec\.error_feedback_decay is 1\.5; give beta in"),
        (lambda c: c.islands.b.update(inner_steps=0), r"islands\.b\.inner_steps is 0"),
        (lambda c: c.model.update(num_heads=3), r"model\.d_model=128 is not divisible by model\.num_heads=3"),
        (lambda c: c.outer.update(enabled=False), r"outer\.enabled is False but there are 2 islands"),
        (lambda c: c.moe.update(dispatch="ragged"),
         r"moe\.dispatch is 'ragged'; choose one of \('capacity', 'dropless'\)"),
        (lambda c: c.outer.update(overlap_steps=25), r"outer\.overlap_steps is 25 but islands\.a\.inner_steps is 25"),
        (lambda c: c.comm.update(connections=0), r"comm\.connections is 0; use 1\.\.256 gRPC channels per island"),
        (lambda c: c.comm.link.update(latency_ms=5.0),
         r"comm\.link\.latency_ms and window_bytes only apply to an emulated link"),
        (lambda c: c.checkpoint.update(max_to_keep=0), r"checkpoint\.max_to_keep is 0; keep at least 1"),
        (lambda c: c.eval.update(batch_size=6), r"eval\.batch_size=6 is not divisible by islands\.a's 4 devices"),
        (lambda c: c.data.update(eval_fraction=1.0), r"data\.eval_fraction is 1\.0; use a value in \(0, 1\)"),
        (lambda c: c.model.update(vocab_size=128),
         r"model\.vocab_size is 128 but the byte-level data has 256 symbols; use a vocab_size of at least 256"),
        (lambda c: c.metrics.update(plots="timeline,loss"),
         r"metrics\.plots is 'timeline,loss'; name figures among timeline, routing, comma-separated \(\'\' for none\)"),
    ],
)
def test_rules(edit, message):
    c = _two_islands()
    edit(c)
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_more_devices_than_the_machine_has():
    with pytest.raises(ConfigError, match=r"the islands need 6 devices in all .* this machine has 4"):
        validate(_two_islands(), num_available_devices=4)


def test_error_text_starts_with_its_kind():
    assert str(ConfigError("x")) == "ConfigError: x"


@pytest.mark.slow  # starts experiments/train.py
def test_cli_refuses_bad_config_before_compiling(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "experiments/train.py", "--config=experiments/configs/two_islands.py",
         f"--workdir={workdir}", "--config.moe.num_experts=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "ConfigError: moe.num_experts=5 is not divisible by islands.a.mesh.expert=2" in proc.stderr
    assert not workdir.exists()  # stopped before anything was written or compiled


@pytest.mark.slow  # starts experiments/train.py and launch/local.py
@pytest.mark.parametrize("script", ["experiments/train.py", "launch/local.py"])
def test_an_override_of_no_field_exits_with_one_line_naming_the_nearest(tmp_path, script):
    proc = subprocess.run(
        [sys.executable, script, "--config=experiments/configs/two_islands.py", f"--workdir={tmp_path / 'run'}",
         "--config.outer.roundz=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "ConfigError: outer.roundz is not a field of the config; did you mean outer.rounds? (the fields are listed "
        "in island_jax/config/schema.py)"
    ], proc.stderr
    assert not (tmp_path / "run").exists()


def test_every_key_is_documented_in_the_config_module():
    """The config module is the schema's one documentation: a comment on (or above) every default, and
    every key of an island's entry in `island`'s docstring."""
    import inspect
    import re

    from island_jax.config import schema as config_lib

    defaults = inspect.getsource(config_lib).replace(inspect.getsource(config_lib.island), "")
    lines = defaults.splitlines()

    def leaves(tree, prefix=""):
        for k, v in tree.items():
            if hasattr(v, "items"):
                yield from leaves(v, prefix + k + ".")
            else:
                yield k, prefix + k

    for key, path in leaves(default_config()):
        found = [i for i, line in enumerate(lines) if re.match(rf"\s*(c\.)?{key}\s*=", line)]
        assert found, path
        for i in found:
            assert "#" in lines[i] or lines[i - 1].strip().startswith("#"), f"{path}: no comment on line {i + 1}"
    for key, path in leaves(island(4, 2, 2, 16, 25)):
        assert f"  {key}: " in config_lib.island.__doc__, path


def test_a_config_json_from_before_a_field_existed_resumes_while_the_field_keeps_its_default():
    import json

    from island_jax.config import config_changes

    c = default_config()
    c.islands.a = island(2, 1, 1, 2, 5)
    started = json.loads(c.to_json_best_effort())
    del started["model"]["positions"], started["model"]["rope_theta"], started["islands"]["a"]["simulated_speed"]
    assert config_changes(started, c) == []
    c.model.positions = "rope"
    c.islands.a.simulated_speed = 0.5
    assert config_changes(started, c) == [("islands.a.simulated_speed", None, 0.5), ("model.positions", None, "rope")]
