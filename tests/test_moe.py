"""The expert-parallel MoE layer: equal to a dense reference on every mesh, exact routing cases, wiring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.config import default_config
from island_jax.island import loss_fn
from island_jax.mesh import BATCH_AXES, EXPERT_AXIS, island_mesh
from island_jax.model import moe as moe_lib
from island_jax.model.moe import MoE, capacity, routing_bias_update
from island_jax.model.transformer import Transformer, aggregate_stats, partition_specs

D, F = 32, 64
BATCH, EXPERTS = P(BATCH_AXES), P(EXPERT_AXIS)


def run(layer, mesh_shape, x, mask=None, cotangent=None, key=None):
    """Calls `layer` on a (data, expert) or (data, fsdp, expert) mesh, its weights placed by their logical axis
    names (`transformer.partition_specs`); returns (out, stats, grads wrt x and every weight)."""
    data, fsdp, expert = mesh_shape if len(mesh_shape) == 3 else (mesh_shape[0], 1, mesh_shape[1])
    mesh = island_mesh(data, expert, jax.devices()[: data * fsdp * expert], fsdp=fsdp)
    graphdef, state = nnx.split(layer, nnx.Param)
    weights = nnx.to_pure_dict(state)
    specs = partition_specs(state)
    placed = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), weights, specs)
    cotangent = np.ones_like(x) if cotangent is None else cotangent
    mask = np.ones(x.shape[:2], np.float32) if mask is None else mask

    def objective(w, x, mask, ct):
        out, stats = nnx.merge(graphdef, nnx.State(w))(x, mask, key)
        return jnp.sum(out * ct) + 0.3 * stats["load_balancing_loss"] + 0.2 * stats["router_z_loss"], (out, stats)

    put = lambda a: jax.device_put(a, NamedSharding(mesh, BATCH))  # noqa: E731
    with jax.set_mesh(mesh):
        (_, (out, stats)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(
            placed, put(x), put(mask), put(cotangent)
        )
    return np.asarray(out), jax.device_get(stats), jax.device_get(grads)


def _inputs(shape=(8, 16, D), seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize(
    "mesh_shape,dispatch",
    [((1, 1), "capacity"), ((2, 2), "capacity"), ((1, 4), "capacity"), ((2, 4), "capacity"), ((1, 8), "capacity"),
     ((2, 1), "capacity"), ((1, 2), "capacity"), ((4, 2), "capacity"), ((4, 1), "capacity"),
     ((1, 1), "dropless"), ((4, 1), "dropless"),
     # with an fsdp axis: the expert weights split over expert and fsdp, the router over fsdp, gathered inside
     ((1, 2, 2), "capacity"), ((2, 2, 1), "dropless")],
)
def test_expert_parallel_equals_dense(mesh_shape, dispatch):
    layer = MoE(D, 8, 2, F, capacity_factor=0.0, renormalize=True, dispatch=dispatch, rngs=nnx.Rngs(0))
    x, cotangent = _inputs()
    out, stats, (grads, grad_x) = run(layer, mesh_shape, x, cotangent=cotangent)
    weights = nnx.to_pure_dict(nnx.state(layer, nnx.Param))

    def objective(w, x):
        o, lb, z = moe_lib.dense_reference(x, w, 2)
        return jnp.sum(o * cotangent) + 0.3 * lb + 0.2 * z, (o, lb, z)

    (_, (ref_out, ref_lb, ref_z)), (ref_grads, ref_grad_x) = jax.value_and_grad(objective, (0, 1), has_aux=True)(
        weights, x
    )
    tol = dict(rtol=1e-5, atol=1e-6)
    assert float(stats["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(out, ref_out, **tol)
    np.testing.assert_allclose(stats["load_balancing_loss"], ref_lb, **tol)
    np.testing.assert_allclose(stats["router_z_loss"], ref_z, **tol)
    np.testing.assert_allclose(grad_x, ref_grad_x, **tol)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(grads[name], ref_grads[name], **tol, err_msg=name)


def test_capacity_from_static_shapes():
    assert capacity(64, 4, 2, 1.25) == 40  # ceil(1.25 * 64 * 2 / 4)
    assert capacity(8, 8, 2, 4.0) == 8  # ceil(4 * 8 * 2 / 8)
    assert capacity(8, 8, 2, 16.0) == 8  # 32, clamped: an expert sees a token at most once
    assert capacity(64, 4, 2, 0.0) == 64  # no drops: worst-case buckets


def test_capacity_clamp_is_reported_and_changes_nothing():
    x, cotangent = _inputs((2, 8, D), seed=3)  # 8 tokens on each of 2 devices
    runs = []
    for factor in (4.0, 16.0):
        layer = MoE(D, 8, 2, F, capacity_factor=factor, renormalize=True, rngs=nnx.Rngs(0))
        runs.append(run(layer, (1, 2), x, cotangent=cotangent))
    (out4, stats4, grads4), (out16, stats16, grads16) = runs
    assert int(stats4["capacity"]) == 8 and int(stats16["capacity"]) == 8
    np.testing.assert_array_equal(out4, out16)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads16), strict=True):
        np.testing.assert_array_equal(a, b)


def _forced_layer(num_experts, k, to_expert, capacity_factor=0.0, **kw):
    """A layer whose router sends every token with positive features to `to_expert`."""
    layer = MoE(D, num_experts, k, F, capacity_factor=capacity_factor, renormalize=True, rngs=nnx.Rngs(0), **kw)
    router = np.full((D, num_experts), -10.0, np.float32)
    router[:, to_expert] = 10.0
    layer.router[...] = jnp.asarray(router)
    return layer


def test_uneven_batch_drops_in_token_order_and_padding_takes_no_slot():
    x = np.abs(np.random.default_rng(4).normal(size=(2, 16, D))).astype(np.float32) + 0.5
    mask = np.ones((2, 16), np.float32)
    padded = [2, 5, 9, 14]
    mask[1, padded] = 0.0  # device 1: 12 real tokens, 4 padded
    layer = _forced_layer(2, 1, to_expert=0, capacity_factor=1.25)
    out, stats, _ = run(layer, (1, 2), x, mask=mask)
    assert int(stats["capacity"]) == 10  # ceil(1.25 * 16 * 1 / 2)
    served = np.abs(out).sum(-1) > 0
    np.testing.assert_array_equal(served[0], np.arange(16) < 10)  # tokens 0-9 kept, 6 dropped
    real = [t for t in range(16) if t not in padded]
    expected = np.zeros(16, bool)
    expected[real[:10]] = True  # the first 10 real tokens; 2 dropped; padded ones take no slot
    np.testing.assert_array_equal(served[1], expected)
    assert float(stats["dropped_fraction"]) == np.float32(8) / np.float32(28)
    np.testing.assert_array_equal(stats["expert_load"], [1.0, 0.0])  # before drops
    assert stats["routed_counts"].dtype == np.int32
    np.testing.assert_array_equal(stats["routed_counts"], [28, 0])  # 16 + 12 real tokens, k = 1, before drops


def test_load_balancing_loss_per_layer_then_mean():
    x = np.abs(np.random.default_rng(5).normal(size=(1, 8, D))).astype(np.float32) + 0.5
    per_layer = [run(_forced_layer(2, 1, to_expert=e), (1, 1), x)[1] for e in (0, 1)]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *per_layer)
    assert float(aggregate_stats(stacked)["load_balancing_loss"]) == 2.0  # pooled statistics would give 1.0
    for k in (1, 2):
        uniform = MoE(D, 2, k, F, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
        uniform.router[...] = jnp.zeros((D, 2))
        stats = run(uniform, (1, 1), x)[1]
        assert float(stats["load_balancing_loss"]) == 1.0
        assert float(stats["router_entropy"]) == pytest.approx(np.log(2.0), rel=1e-6)


def _tiny_model_config():
    c = default_config()
    c.model.update(seq_len=16, num_layers=2, d_model=D, num_heads=2, mlp_hidden_dim=64)
    c.moe.update(num_experts=4, expert_hidden_dim=F, router_z_loss_coef=0.0)
    return c


def test_load_balancing_coefficient_reaches_only_the_router():
    c = _tiny_model_config()
    c.model.num_layers = 1  # one MoE layer: its experts sit after its router
    graphdef, state = nnx.split(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)
    mesh = island_mesh(1, 1, jax.devices()[:1])
    tokens = jax.device_put(np.random.default_rng(6).integers(0, 256, size=(2, 17)).astype(np.int32),
                            NamedSharding(mesh, BATCH))
    grads = {}
    for coef in (0.0, 0.01, 0.02):
        c.moe.load_balancing_loss_coef = coef
        with jax.set_mesh(mesh):
            moe_config = c.moe.copy_and_resolve_references()
            grads[coef] = jax.device_get(jax.jit(jax.grad(
                lambda p, t: loss_fn(graphdef, p, t[:, :-1], t[:, 1:], moe_config, cross_entropy_coef=0.0)[0]
            ))(params, tokens))
    for layer in (0,):
        g = {coef: grads[coef]["blocks"][layer]["moe"] for coef in grads}
        assert np.all(g[0.0]["router"] == 0.0)
        assert np.any(g[0.01]["router"] != 0.0)
        np.testing.assert_array_equal(g[0.02]["router"], 2 * g[0.01]["router"])
        for coef in grads:
            for name in ("w_gate", "w_up", "w_down"):
                assert np.all(g[coef][name] == 0.0), (coef, name)


def test_dropless_with_expert_axis_above_one_on_cpu_names_the_field():
    layer = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, dispatch="dropless", rngs=nnx.Rngs(0))
    with pytest.raises(moe_lib.DispatchError, match=r"moe.dispatch='dropless' with an expert axis of 2"):
        run(layer, (1, 2), _inputs((2, 8, D))[0])


def test_dropless_exchange_traces_with_gradients():
    """XLA:CPU cannot run ragged_all_to_all, but the exchange and its transpose lower (for GPU/TPU)."""
    mesh = island_mesh(1, 2, jax.devices()[:2])
    layer = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
    w = {k: v for k, v in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
    body = lambda x, m, key, r, *ws: moe_lib._moe_shard(  # noqa: E731
        x, m, key, r, None, *ws, k=2, capacity_factor=0.0, renormalize=True, jitter=0.0, dispatch="dropless",
        compute_dtype=jnp.float32,
    )
    fn = jax.shard_map(body, mesh=mesh, in_specs=(BATCH, BATCH, P(), P(), EXPERTS, EXPERTS, EXPERTS),
                       out_specs=(BATCH, {n: P() for n in moe_lib.LAYER_METRICS}))
    loss = lambda x, ws: jnp.sum(  # noqa: E731
        fn(x, jax.reshard(jnp.ones(x.shape[:2]), BATCH), jax.random.PRNGKey(0), *ws)[0]
    )
    weights = (w["router"], w["w_gate"], w["w_up"], w["w_down"])
    specs = (P(), EXPERTS, EXPERTS, EXPERTS)
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
            jax.ShapeDtypeStruct((2, 8, D), jnp.float32, sharding=NamedSharding(mesh, BATCH)),
            tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(weights, specs)),
        ).as_text()
    assert text.count("ragged_all_to_all") >= 4  # two forward, two in the transpose


def test_routing_bias_update_and_choice():
    bias = routing_bias_update(jnp.zeros(4), jnp.asarray([0.5, 0.25, 0.25, 0.0]), 0.001)
    np.testing.assert_array_equal(bias, np.asarray([-0.001, 0.0, 0.0, 0.001], np.float32))
    layer = MoE(D, 4, 1, F, capacity_factor=0.0, renormalize=False, routing_bias=True, rngs=nnx.Rngs(0))
    layer.routing_bias[...] = jnp.asarray([0.0, 0.0, 0.0, 10.0])  # steers every token to expert 3
    x = _inputs((1, 8, D), seed=7)[0]
    out, stats, _ = run(layer, (1, 1), x)
    np.testing.assert_array_equal(stats["expert_load"], [0.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(stats["routed_counts"], [0, 0, 0, 8])
    w = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    xt = x.reshape(8, D)
    p3 = jax.nn.softmax(xt @ w["router"], axis=-1)[:, 3:4]  # the weight is the probability, not prob + bias
    expected = moe_lib.swiglu(xt, w["w_gate"][3], w["w_up"][3], w["w_down"][3]) * p3
    np.testing.assert_allclose(out.reshape(8, D), expected, rtol=1e-5, atol=1e-6)


def test_shared_experts_add_a_dense_swiglu():
    x = _inputs((2, 8, D), seed=8)[0]
    plain = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
    shared = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, num_shared_experts=2, rngs=nnx.Rngs(0))
    for name in ("router", "w_gate", "w_up", "w_down"):
        getattr(shared, name)[...] = getattr(plain, name)[...]
    s = shared.shared_experts
    assert s.w_gate.shape == (D, 2 * F)
    expected = run(plain, (1, 2), x)[0] + np.asarray(moe_lib.swiglu(x, s.w_gate[...], s.w_up[...], s.w_down[...]))
    np.testing.assert_allclose(run(shared, (1, 2), x)[0], expected, rtol=1e-5, atol=1e-6)


def test_jitter_only_in_training():
    x = _inputs((2, 8, D), seed=9)[0]
    jittery = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, jitter_noise=0.1, rngs=nnx.Rngs(0))
    steady = MoE(D, 4, 2, F, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(run(jittery, (1, 2), x)[0], run(steady, (1, 2), x)[0])  # no key: evaluation
    trained = run(jittery, (1, 2), x, key=jax.random.PRNGKey(1))[0]
    assert not np.array_equal(trained, run(steady, (1, 2), x)[0])


def test_moe_every_n_layers_with_dense_layers_between():
    c = _tiny_model_config()
    c.model.num_layers, c.moe.every_n_layers = 4, 2
    model = Transformer(c, rngs=nnx.Rngs(0))
    kinds = ["moe" if b.moe is not None else "dense" for b in model.blocks]
    assert kinds == ["dense", "moe", "dense", "moe"]
    mesh = island_mesh(1, 1, jax.devices()[:1])
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(model)
        stats = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[1])(
            state, jax.device_put(np.zeros((1, 16), np.int32), NamedSharding(mesh, BATCH))
        )
    assert stats["expert_load"].shape == (2, 4) and stats["capacity"].shape == (2,)
