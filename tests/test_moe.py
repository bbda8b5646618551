"""The expert-parallel MoE layer equals a single-device dense computation of the same routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.mesh import island_mesh
from island_jax.models.moe import MoE, capacity

E, K, D, F = 4, 2, 32, 64
SPECS = {"router": P(), "w_gate": P("expert"), "w_up": P("expert"), "w_down": P("expert")}


def _dense_reference(x, router, w_gate, w_up, w_down):
    """Every expert on every token, combined with the top-k (renormalised) router weights."""
    xt = x.reshape(-1, D)
    logits = xt @ router
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_e = jax.lax.top_k(probs, K)
    top_w = top_w / top_w.sum(-1, keepdims=True)
    gate = jnp.einsum("td,edf->tef", xt, w_gate)
    up = jnp.einsum("td,edf->tef", xt, w_up)
    all_out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, w_down)  # [T, E, D]
    combine = jnp.sum(jax.nn.one_hot(top_e, E) * top_w[..., None], axis=1)  # [T, E]
    out = jnp.einsum("ted,te->td", all_out, combine).reshape(x.shape)
    f = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, E), axis=1), axis=0) / K
    lb = E * jnp.sum(f * jnp.mean(probs, axis=0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return out, lb, z


def _objective(out, lb, z, cotangent):
    return jnp.sum(out * cotangent) + 0.3 * lb + 0.2 * z


def test_capacity_from_static_shapes():
    assert capacity(64, 4, 2, 1.25) == 40  # ceil(1.25 * 64 * 2 / 4)
    assert capacity(64, 4, 2, 10.0) == 64  # clamped: an expert sees a token at most once
    assert capacity(64, 4, 2, 0.0) == 64  # dropless


def test_matches_dense_reference_on_2x2_mesh():
    layer = MoE(D, E, K, F, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer, nnx.Param)
    weights = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16, D)).astype(np.float32)
    cotangent = rng.normal(size=(8, 16, D)).astype(np.float32)

    mesh = island_mesh(2, 2, jax.devices()[:4])
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in weights.items()}
    batch = NamedSharding(mesh, P(("data", "expert")))

    def sharded(w, x, ct):
        out, stats = nnx.merge(graphdef, nnx.State(w))(x)
        return _objective(out, stats["load_balancing_loss"], stats["router_z_loss"], ct), (out, stats)

    with jax.set_mesh(mesh):
        (_, (out, stats)), grads = jax.jit(jax.value_and_grad(sharded, has_aux=True))(
            placed, jax.device_put(x, batch), jax.device_put(cotangent, batch)
        )

    def dense(w, x, ct):
        out, lb, z = _dense_reference(x, w["router"], w["w_gate"], w["w_up"], w["w_down"])
        return _objective(out, lb, z, ct), (out, lb, z)

    (_, (ref_out, ref_lb, ref_z)), ref_grads = jax.value_and_grad(dense, has_aux=True)(weights, x, cotangent)

    assert float(stats["dropped_fraction"]) == 0.0
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, **tol)
    np.testing.assert_allclose(float(stats["load_balancing_loss"]), ref_lb, **tol)
    np.testing.assert_allclose(float(stats["router_z_loss"]), ref_z, **tol)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(np.asarray(grads[name]), ref_grads[name], **tol, err_msg=name)
    np.testing.assert_allclose(float(np.sum(stats["expert_load"])), 1.0, rtol=1e-6)


def test_drops_past_capacity_in_token_order():
    """Capacity 1 per expert and shard: only the first assignment to each expert survives."""
    layer = MoE(D, E, 1, F, capacity_factor=1.0 / 16, renormalize=True, rngs=nnx.Rngs(1))
    mesh = island_mesh(1, 1, jax.devices()[:1])
    x = np.random.default_rng(2).normal(size=(1, 16, D)).astype(np.float32)
    graphdef, state = nnx.split(layer, nnx.Param)
    weights = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in nnx.to_pure_dict(state).items()}
    with jax.set_mesh(mesh):
        out, stats = jax.jit(lambda w, x: nnx.merge(graphdef, nnx.State(w))(x))(
            weights, jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
        )
    probs = jax.nn.softmax(x.reshape(16, D) @ np.asarray(layer.router[...]), axis=-1)
    experts = np.asarray(jnp.argmax(probs, axis=-1))
    first = {int(e): t for t, e in reversed(list(enumerate(experts)))}
    kept = np.zeros(16, bool)
    kept[list(first.values())] = True
    assert float(stats["dropped_fraction"]) == pytest.approx(1 - kept.sum() / 16, abs=1e-7)
    np.testing.assert_array_equal(np.abs(np.asarray(out)[0]).sum(-1) > 0, kept)
