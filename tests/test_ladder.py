"""The ladder of model configs: each docstring's counts are the shapes' (model.flops), and the shapes' are the
initialized model's for the rungs small enough to draw in a test (model.flops counts the same Transformer under
nnx.eval_shape, so the 1B and 705B configs are checked from their abstract shapes only)."""

import importlib.util
import os
import re

import jax
import pytest

from island_jax.config import validate
from island_jax.model.flops import model_size
from island_jax.model.init import count, init_params
from island_jax.plan import from_config, plan

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "configs")
STATED = re.compile(r"([\d,]+) parameters, ([\d,]+) active per token, ([\d.]+) GFLOPs per token to train")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,initialized", [
    ("ladder_20m", True), ("ladder_125m", True),
    ("ladder_1b", False),  # drawing its 4.2 GB took 28 CPU seconds, a 20th of the suite's (docs/benchmarks.md)
    ("deepseek_v3_like", False),
])
def test_each_rung_states_the_counts_of_its_shapes_and_its_model_has_them(name, initialized):
    module = _load(name)
    config = module.get_config()
    validate(config)
    size = model_size(config)
    (total, active, gflops), = STATED.findall(" ".join(module.__doc__.split()))
    assert (int(total.replace(",", "")), int(active.replace(",", ""))) == (size.total_params, size.active_params)
    assert gflops == f"{size.flops_per_token / 1e9:.4f}"
    assert config.model.positions == "rope"
    if initialized:  # every parameter made, counted
        # with XLA's optimizations (the suite turns most off to compile faster): the 1B draw is 3x faster so
        previous = jax.config.values["jax_disable_most_optimizations"]
        jax.config.update("jax_disable_most_optimizations", False)
        try:
            _, params, _ = init_params(config)
        finally:
            jax.config.update("jax_disable_most_optimizations", previous)
        assert count(params) == size.total_params


def test_the_planner_takes_the_705b_config_from_its_shapes():
    config = _load("deepseek_v3_like").get_config()
    p = plan(*from_config(config))
    assert p.model.total_params == 704_921_055_488 and p.model.active == 38_681_030_912
    assert p.payload_bytes == pytest.approx(704_921_055_488 * p.outer.wire_bytes_per_param(), rel=1e-12)
