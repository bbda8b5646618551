"""`model.scan_layers`: the blocks' repeating unit under `jax.lax.scan`, its parameters stacked on a leading
`layers` axis, trains as the unrolled blocks do from the same (converted) parameters."""

import jax
import numpy as np
import pytest
from test_precision import BF16_RTOL
from tiny_config import get_config, write_corpus

from island_jax import data as data_lib
from island_jax.island import step as step_lib
from island_jax.mesh import island_mesh, spec_of
from island_jax.model import stacking
from island_jax.model.init import init_params

STEPS = 20


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    write_corpus(folder)
    text = np.frombuffer(b"".join(p.read_bytes() for p in sorted(folder.glob("*.py"))), np.uint8)
    return data_lib.train_dataset(text, get_config().model.seq_len, 8, 0)


def _config(scan: bool, every_n_layers: int, shared: int, num_layers: int, dtype: str = "float32"):
    c = get_config()
    c.model.update(num_layers=num_layers, scan_layers=scan, compute_dtype=dtype)
    c.moe.update(every_n_layers=every_n_layers, num_shared_experts=shared, expert_hidden_dim=32)
    c.moe.routing_bias_update_rate = 0.001 if shared else 0.0
    return c


@pytest.mark.parametrize("every_n_layers,shared,num_layers", [(1, 0, 3), (1, 1, 2), (2, 0, 4), (2, 1, 5)])
def test_scanned_blocks_train_as_unrolled_ones_for_20_steps(batches, every_n_layers, shared, num_layers):
    # (2, 1, 5): units of a dense and an MoE block (with a shared expert and aux-loss-free routing biases)
    # scanned twice, then block 4 (dense) unrolled; with shared experts the routing biases move too
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)
    runs = {}
    for scan in (False, True):
        c = _config(scan, every_n_layers, shared, num_layers)
        runs[scan] = step_lib.train_losses(c, mesh, batches, STEPS)
    (losses, params), (scanned_losses, scanned_params) = runs[False], runs[True]
    assert losses[-1] < losses[0] - 1  # it trained
    np.testing.assert_allclose(scanned_losses, losses, rtol=1e-5)
    per_layer = stacking.unstack(jax.device_get(scanned_params))
    assert jax.tree.structure(per_layer) == jax.tree.structure(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(params)), jax.tree.leaves(per_layer)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    if shared:  # the routing biases moved, each layer's by its own load
        biases = [np.asarray(params["blocks"][i]["moe"]["routing_bias"]) for i in (every_n_layers - 1, 2 * every_n_layers - 1)]
        assert not np.array_equal(biases[0], biases[1])
        assert np.abs(biases[0]).max() > 0


def test_scanned_blocks_in_bfloat16_train_as_unrolled_ones(batches):
    mesh = island_mesh(1, 2, jax.devices()[:4], fsdp=2)
    curves = [step_lib.train_losses(_config(scan, 2, 0, 4, "bfloat16"), mesh, batches, STEPS)[0] for scan in (False, True)]
    np.testing.assert_allclose(curves[1], curves[0], rtol=BF16_RTOL)


def test_the_stacked_axis_is_never_split():
    c = _config(True, 2, 1, 5)
    _, params, specs = init_params(c)
    shapes = jax.tree.map(np.shape, params)
    assert shapes["layers"][1]["moe"]["w_gate"] == (2, 4, 32, 32)  # [U, E, D, F]
    assert shapes["layers"][0]["mlp"]["w_gate"] == (2, 32, 512)  # [U, D, mlp_hidden_dim]
    assert shapes["tail"][0]["mlp"]["w_down"] == (512, 32)
    assert specs["layers"][1]["moe"]["w_gate"] == jax.P(None, "expert", "fsdp", None)
    assert specs["layers"][0]["attn"]["qkv"]["kernel"] == jax.P(None, "fsdp", None)
    assert specs["layers"][1]["moe"]["routing_bias"] == jax.P(None, None)
    assert specs["tail"][0]["mlp"]["w_down"] == jax.P("fsdp", None)
    assert spec_of(("layers", "embed", "mlp")) == jax.P(None, "fsdp", None)
    # converted, the stacked draw is the unrolled one's, bit for bit
    _, unrolled, unrolled_specs = init_params(_config(False, 2, 1, 5))
    assert jax.tree.all(jax.tree.map(np.array_equal, stacking.unstack(params), unrolled))
    assert jax.tree.all(jax.tree.map(np.array_equal, stacking.stack(unrolled, 2), params))
    assert stacking.unstack(specs, take=lambda spec, u: jax.P(*spec[1:]), repeats=2) == unrolled_specs


def test_the_memory_budget_counts_stacked_parameters_as_their_layers():
    from island_jax.config import island
    from island_jax.island import memory

    budgets = {}
    for scan in (False, True):
        c = _config(scan, 2, 1, 5)
        c.islands = {"a": island(4, 1, 2, 8, 2, fsdp=2)}
        budgets[scan] = memory.state_bytes(c, "a")
    assert budgets[True] == budgets[False]
