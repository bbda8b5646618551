"""One prepared check of an island on a machine with an accelerator (GPU or TPU), in at most 10 minutes.

  python benchmarks/accelerator_check.py [--steps=10] [--smoke]

Runs, on the machine's accelerators (JAX's default backend):
  ep_dense      the MoE layer on a mesh of the accelerators (fsdp and expert where there are 4 or more)
                against its dense oracle (`moe.dense_reference`) at "highest" matmul precision: outputs, both
                auxiliary losses and every gradient to rtol 1e-5;
  bf16          50 inner steps (10 with --smoke) of the test model in bfloat16 compute (float32 parameters) against float32:
                every loss within docs/island.md's 0.5%;
  step          the step time, MFU and XLA's temporary bytes (`compiled.memory_analysis()`) of the ~100M
                config (experiments/configs/fsdp_100m.py) on one island over every accelerator, sharded
                over fsdp, without remat;
  step_remat    the same with `model.remat=full`;
  mixed         a 2-round run of the test model's two islands, island a on the accelerators and island b on
                CPU devices, in one process: every island's checksum equal to the coordinator's;
  packed        on a GPU, attention over packed documents (`transformer.segment_mask` with the causal mask)
                by cuDNN's fused kernel against XLA's, in bfloat16: outputs and the gradients of q, k and v
                within PACKED_RTOL of the largest value.
On a machine without an accelerator it runs the first four on virtual CPU devices (and `step` at the test
model's size under --smoke) and reports `mixed` and `packed` as not run. Each check prints one line, `check NAME: ok ...`,
`FAILED ...` or `not run (why)`. Last line: `accelerator_check: ran=R not_run=N failed=F`; the exit status is
1 when a check failed.

`--smoke` runs the `step` checks at the test model's size with 2 timed steps: the same code path and
printout in seconds, figures that are not measurements.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time

import _smoke
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEPS = flags.DEFINE_integer("steps", 10, "Inner steps timed per `step` check, after one that compiles.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

BF16_RTOL = 5e-3  # docs/island.md, "Remat and precision"
PACKED_RTOL = 2e-2  # two bfloat16 attention kernels: a few bfloat16 ulps (2^-8) apart
CPU_DEVICES = 8


def _load(*path: str):
    """The module of the file at ROOT/path: tests/tiny_config.py (the test model, `get_config`, and its corpus,
    `write_corpus`) or a config of experiments/configs/."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(path[-1])[0], os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_config():
    return _load("tests", "tiny_config.py")


def check_ep_dense(devices) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from island_jax.mesh import BATCH_AXES, island_mesh
    from island_jax.model import moe as moe_lib
    from island_jax.model.transformer import partition_specs

    n = len(devices)
    fsdp, expert = (2, 2) if n >= 4 else (1, n)
    mesh = island_mesh(1, expert, devices[: fsdp * expert], fsdp=fsdp)
    d, f, e, k = 64, 128, 8, 2
    layer = moe_lib.MoE(d, e, k, f, capacity_factor=0.0, renormalize=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer, nnx.Param)
    weights = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    x, ct = (rng.normal(size=(8, 16, d)).astype(np.float32) for _ in range(2))

    def objective(w, x):
        out, stats = nnx.merge(graphdef, nnx.State(w))(x)
        return jnp.sum(out * ct) + 0.3 * stats["load_balancing_loss"] + 0.2 * stats["router_z_loss"], out

    def oracle(w, x):
        out, lb, z = moe_lib.dense_reference(x, w, k)
        return jnp.sum(out * ct) + 0.3 * lb + 0.2 * z, out

    with jax.default_matmul_precision("highest"):
        with jax.set_mesh(mesh):
            placed = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), weights, partition_specs(state))
            xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
            (_, out), grads = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(placed, xs)
        (_, ref_out), ref_grads = jax.jit(jax.value_and_grad(oracle, (0, 1), has_aux=True))(weights, x)
    worst = 0.0
    for a, b in zip(jax.tree.leaves((out, grads)), jax.tree.leaves((ref_out, ref_grads)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        worst = max(worst, float(np.max(np.abs(a - b))))
    return f"mesh data=1 x fsdp={fsdp} x expert={expert} on {devices[0].platform}, worst absolute error {worst:.2e}"


def _corpus():
    import numpy as np

    folder = tempfile.mkdtemp(prefix="accelerator-check-")
    import pathlib

    _tiny_config().write_corpus(pathlib.Path(folder))
    return folder, np.frombuffer(b"".join(p.read_bytes() for p in sorted(pathlib.Path(folder).glob("*.py"))), np.uint8)


def check_bf16(devices, steps: int) -> str:
    import jax
    import numpy as np

    from island_jax import data as data_lib
    from island_jax.island.step import train_losses
    from island_jax.mesh import island_mesh

    _, corpus = _corpus()
    mesh = island_mesh(1, min(2, len(devices)), devices[: min(2, len(devices))])
    curves, tiny = {}, _tiny_config()
    for dtype in ("float32", "bfloat16"):
        c = tiny.get_config()
        c.model.compute_dtype = dtype
        with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
            curves[dtype] = np.array(train_losses(c, mesh, data_lib.train_dataset(corpus, c.model.seq_len, 8, 0),
                                                  steps)[0])
    rel = np.abs(curves["bfloat16"] - curves["float32"]) / curves["float32"]
    np.testing.assert_allclose(curves["bfloat16"], curves["float32"], rtol=BF16_RTOL)
    return (f"{steps} steps, loss {curves['float32'][0]:.4f} -> {curves['float32'][-1]:.4f} (float32), worst relative "
            f"difference {rel.max():.2e} (allowed {BF16_RTOL:g})")


def check_step(devices, remat: str, smoke: bool) -> str:
    import jax
    import numpy as np

    from island_jax.config import validate
    from island_jax.island import memory
    from island_jax.island.island import Island
    from island_jax.model.init import init_params

    c = (_tiny_config() if smoke else _load("experiments", "configs", "fsdp_100m.py")).get_config()
    n = len(devices)
    del c.islands["b"]
    c.outer.enabled = False
    c.islands.a.update(num_devices=n, batch_size=max(8, n) // n * n, hardware="cpu")
    c.islands.a.mesh.update(data=1, fsdp=n, expert=1)
    c.eval.batch_size = n
    c.model.remat = remat
    if devices[0].platform != "cpu":
        from island_jax.hardware import kind_of

        c.islands.a.hardware = kind_of(devices[0]) or "h100"
        c.model.update(compute_dtype="bfloat16")
    validate(c)
    memory.check_fits(c)
    graphdef, params, specs = init_params(c)
    corpus = np.random.default_rng(0).integers(0, 256, 64 * c.model.seq_len * c.islands.a.batch_size, dtype=np.uint8)
    island = Island("a", c, devices, graphdef, params, specs, corpus, 1)
    temp = memory.compiled_activation_bytes(island)
    island.train_round(1)  # compiles
    steps = 2 if smoke else _STEPS.value
    start = time.perf_counter()
    result = island.train_round(steps)
    seconds = (time.perf_counter() - start) / steps
    jax.block_until_ready(island.params)
    return (f"{island.flops_per_token * island.tokens_per_step / 1e9:.3g} GFLOP per step on {n} {devices[0].platform} "
            f"device(s) (fsdp={n}, remat={remat}, {c.model.compute_dtype}): {seconds * 1e3:.1f} ms per step, MFU "
            f"{100 * island.mfu(result['step_seconds']):.1f}% of {island.peak_flops / 1e12:.1f} TFLOP/s, temporary "
            f"{temp / 1e6:.1f} MB per device")


def check_mixed(accelerators, cpus) -> str:
    from island_jax.run import run_in_process

    folder, _ = _corpus()
    c = _tiny_config().get_config()
    c.data.files = os.path.join(folder, "*.py")
    c.outer.rounds = 2
    c.eval.every_rounds = 2
    n = len(accelerators)
    expert = 2 if n % 2 == 0 else 1
    from island_jax.hardware import kind_of

    c.islands.a.update(num_devices=n, batch_size=8 // n * n if n <= 8 else n, hardware=kind_of(accelerators[0]) or "h100")
    c.islands.a.mesh.update(data=n // expert, fsdp=1, expert=expert)
    summary = run_in_process(c, os.path.join(folder, "workdir"), devices={"a": accelerators, "b": cpus[:2]})
    if not summary["checksums_agree"]:
        raise AssertionError(f"checksums disagree: {summary}")
    return (f"island a on {n} {accelerators[0].platform} device(s), island b on 2 cpu devices: checksums agree "
            f"after 2 rounds, eval loss {summary['eval_loss_final']:.4f}")


def check_packed() -> str:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from island_jax.model.transformer import segment_mask

    b, s, h, d = 2, 256, 4, 64
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.bfloat16) for _ in range(4))
    segments = np.stack([np.repeat(np.arange(1, 5), s // 4), np.repeat([1, 2], s // 2)])
    mask = segment_mask(jnp.asarray(segments, jnp.int32))

    def objective(q, k, v, implementation):
        y = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    out = {}
    for implementation in ("cudnn", "xla"):
        grad = jax.value_and_grad(functools.partial(objective, implementation=implementation), (0, 1, 2), has_aux=True)
        (_, y), grads = jax.jit(grad)(q, k, v)
        out[implementation] = [np.asarray(x, np.float32) for x in (y, *grads)]
    worst = 0.0
    for name, a, ref in zip(("out", "dq", "dk", "dv"), out["cudnn"], out["xla"]):
        worst = max(worst, float(np.abs(a - ref).max() / np.abs(ref).max()))
        if not worst <= PACKED_RTOL:
            raise AssertionError(f"{name}: cuDNN and XLA differ by {worst:.3g} of the largest value (> {PACKED_RTOL})")
    return f"cuDNN against XLA with 4 and 2 documents per row: largest difference {worst:.3g} of the largest value"


def main(argv):
    del argv
    smoke = _smoke.sizes(steps=2)
    import jax

    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    cpus = jax.devices("cpu")
    devices = accelerators or cpus[:4]
    checks = [
        ("ep_dense", lambda: check_ep_dense(devices)),
        ("bf16", lambda: check_bf16(devices, 10 if smoke else 50)),
        ("step", lambda: check_step(devices, "none", smoke or not accelerators)),
        ("step_remat", lambda: check_step(devices, "full", smoke or not accelerators)),
        ("mixed", (lambda: check_mixed(accelerators, cpus)) if accelerators else "needs an accelerator beside the CPU"),
        ("packed", check_packed if accelerators and accelerators[0].platform == "gpu" else "needs a GPU (cuDNN)"),
    ]
    ran = not_run = failed = 0
    for name, check in checks:
        if isinstance(check, str):
            print(f"check {name}: not run ({check})", flush=True)
            not_run += 1
            continue
        start = time.perf_counter()
        try:
            line = check()
            print(f"check {name}: ok in {time.perf_counter() - start:.1f} s: {line}", flush=True)
        except Exception as e:  # noqa: BLE001 - every check runs; the exit status says one failed
            print(f"check {name}: FAILED in {time.perf_counter() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
            failed += 1
        ran += 1
    print(f"accelerator_check: ran={ran} not_run={not_run} failed={failed}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
