"""Expert-parallel MoE layer against a dense SwiGLU layer with the same active parameters.

  python benchmarks/moe_layer.py [--pairs=30] [--tokens_per_device=512] [--smoke]

On an 8-device (data=2 x expert=4) mesh of virtual CPU devices, each call takes
gradients with respect to the input and every weight:

  moe      the island_jax MoE layer: 8 experts, top-2, d_model 256, expert
           hidden 512, capacity factor 1.25, router, load-balancing and
           router z-losses included;
  dense    a SwiGLU feed-forward layer of hidden width 1024 (= k x 512, the
           active parameters of a token), weights replicated, batch split over
           data x expert;
  one_hot  the same MoE routing with GShard-style one-hot einsum dispatch and
           combine (arXiv 2006.16668), a second baseline.

After warm-up the variants are called in alternation, and each figure is the
median of the pairwise ratios. The MoE layer does capacity_factor x the
dense layer's expert FLOPs, so 1.25 is the compute floor. Last line:
`moe_layer: ratio=R` (MoE / dense).

`--smoke` times 2 pairs of 32 tokens per device (sequences of 32) in a few
seconds, most of them compiling: the same code path and printout, figures
that are not measurements.
"""

import statistics

import _smoke
from absl import app, flags

_PAIRS = flags.DEFINE_integer("pairs", 30, "Alternating MoE / dense pairs to time (at least 20, except with --smoke).")
_TOKENS = flags.DEFINE_integer("tokens_per_device", 512, "Tokens on each of the 8 devices.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help


E, K, D, F, CF = 8, 2, 256, 512, 1.25  # experts, top-k, d_model, expert hidden width, capacity factor


def _one_hot_layer():
    """GShard-style one-hot einsum dispatch and combine, with the island_jax layer's exchange and expert matmuls.

    Returns a shard_map'd function (x [B, S, D], router [D, E], w_gate and w_up
    [E, D, F], w_down [E, F, D]) -> (y [B, S, D], load-balancing loss [], router z-loss []).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from island_jax.mesh import BATCH_AXES, EXPERT_AXIS
    from island_jax.model import moe as moe_lib

    def one_hot_shard(x, router, w_gate, w_up, w_down):
        bl, s, d = x.shape
        t = bl * s
        cap = moe_lib.capacity(t, E, K, CF)
        xt = x.reshape(t, d)
        logits = xt @ router
        probs = jax.nn.softmax(logits, axis=-1)
        top_w, top_e = jax.lax.top_k(probs, K)
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        onehot = jax.nn.one_hot(top_e.reshape(-1), E, dtype=jnp.int32)
        position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        keep = position < cap
        dispatch = (jax.nn.one_hot(top_e.reshape(-1), E) * keep[:, None])[:, :, None] * jax.nn.one_hot(position, cap)[:, None, :]
        dispatch = dispatch.reshape(t, K, E, cap)
        combine = jnp.einsum("tkec,tk->tec", dispatch, top_w)
        buckets = jnp.einsum("tec,td->ecd", jnp.sum(dispatch, axis=1), xt)
        ep = jax.lax.axis_size(EXPERT_AXIS)
        el = E // ep  # the same exchange and expert matmuls as the island_jax layer
        received = jax.lax.all_to_all(buckets.reshape(ep, el, cap, d), EXPERT_AXIS, 0, 2, tiled=True)
        received = received.reshape(el, ep * cap, d)
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", received, w_gate)) * jnp.einsum("ecd,edf->ecf", received, w_up)
        y = jnp.einsum("ecf,efd->ecd", h, w_down).reshape(1, el, ep * cap, d)
        y = jax.lax.all_to_all(y, EXPERT_AXIS, 2, 0, tiled=True).reshape(E, cap, d)
        out = jnp.einsum("tec,ecd->td", combine, y)
        load = jax.lax.psum(jnp.sum(onehot, axis=0), BATCH_AXES) / (t * K * 8)
        mean_prob = jax.lax.psum(jnp.sum(probs, axis=0), BATCH_AXES) / (t * 8)
        z = jax.lax.psum(jnp.sum(jax.nn.logsumexp(logits, -1) ** 2), BATCH_AXES) / (t * 8)
        return out.reshape(bl, s, d), E * jnp.sum(load * mean_prob), z

    batch, experts = P(BATCH_AXES), P(EXPERT_AXIS)
    return jax.shard_map(
        one_hot_shard, in_specs=(batch, P(), experts, experts, experts), out_specs=(batch, P(), P())
    )


def _call_times(variants: dict, x, ct, pairs: int) -> dict[str, list[float]]:
    """Seconds per call of each variant {name: (jitted gradient, weights)}: 3 warm-up calls each, then
    `pairs` rounds calling every variant once, in alternation."""
    import time

    import jax

    def call(name):
        fn, w = variants[name]
        start = time.perf_counter()
        jax.block_until_ready(fn(w, x, ct))
        return time.perf_counter() - start

    for name in variants:  # compile and warm up
        for _ in range(3):
            call(name)
    times = {name: [] for name in variants}
    for _ in range(pairs):
        for name in variants:
            times[name].append(call(name))
    return times


def main(argv):
    del argv
    smoke = _smoke.sizes(pairs=2, tokens_per_device=32)
    pairs = _PAIRS.value if smoke else max(_PAIRS.value, 20)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from island_jax.mesh import BATCH_AXES, EXPERT_AXIS, island_mesh
    from island_jax.model import moe as moe_lib

    mesh = island_mesh(2, 4, jax.devices()[:8])
    batch, experts = P(BATCH_AXES), P(EXPERT_AXIS)
    seq = min(256, _TOKENS.value)  # sequence length, tokens
    b = 8 * _TOKENS.value // seq
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(b, seq, D)).astype(np.float32), NamedSharding(mesh, batch))
    ct = jax.device_put(rng.normal(size=(b, seq, D)).astype(np.float32), NamedSharding(mesh, batch))

    layer = moe_lib.MoE(D, E, K, F, capacity_factor=CF, renormalize=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer, nnx.Param)
    specs = {"router": P(), "w_gate": experts, "w_up": experts, "w_down": experts}
    moe_w = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in nnx.to_pure_dict(state).items()}

    def moe_objective(w, x, ct):
        out, stats = nnx.merge(graphdef, nnx.State(w))(x)
        return jnp.sum(out * ct) + 0.01 * stats["load_balancing_loss"] + 1e-3 * stats["router_z_loss"]

    init = jax.nn.initializers.lecun_normal()
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    dense_w = {
        "w_gate": init(keys[0], (D, K * F)), "w_up": init(keys[1], (D, K * F)), "w_down": init(keys[2], (K * F, D))
    }
    dense_w = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in dense_w.items()}

    def dense_objective(w, x, ct):
        return jnp.sum(moe_lib.swiglu(x, w["w_gate"], w["w_up"], w["w_down"]) * ct)

    one_hot_layer = _one_hot_layer()

    def one_hot_objective(w, x, ct):
        out, lb, z = one_hot_layer(x, w["router"], w["w_gate"], w["w_up"], w["w_down"])
        return jnp.sum(out * ct) + 0.01 * lb + 1e-3 * z

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1)))  # noqa: E731
    variants = {
        "moe": (grad(moe_objective), moe_w),
        "dense": (grad(dense_objective), dense_w),
        "one_hot": (grad(one_hot_objective), moe_w),
    }
    with jax.set_mesh(mesh):
        times = _call_times(variants, x, ct, pairs)
    ratio = {name: statistics.median(t / d for t, d in zip(times[name], times["dense"])) for name in ("moe", "one_hot")}
    for name, t in times.items():
        print(f"{name:8s} median {statistics.median(t) * 1e3:8.2f} ms per call ({len(t)} calls)")
    print(f"capacity per expert and shard: {moe_lib.capacity(_TOKENS.value, E, K, CF)} slots; compute floor 1.25")
    print(f"one_hot / dense: ratio={ratio['one_hot']:.3f}")
    print(f"moe_layer: ratio={ratio['moe']:.3f}")


if __name__ == "__main__":
    app.run(main)
