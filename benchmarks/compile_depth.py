"""Compile time and XLA's temporaries of an island's inner step against depth, scanned blocks against unrolled ones.

  python benchmarks/compile_depth.py [--depths=4,16,64] [--d_model=128 ...] [--repeats=1] [--smoke]

The model is the Quickstart's family (`default_config()`'s: width 128, 4 heads, an MoE of 4 experts of 256,
top-2, in every block, 128-byte sequences), at L = 4, 16 and 64 blocks (`--depths`). For each depth, four
variants of the inner step (`island.step.build_train_step`: the loss, its gradients and AdamW) are compiled,
each in a fresh process (this script with `--compile_role=child`) with 4 virtual CPU devices as one island's
mesh, data=1 x fsdp=4 x expert=1, on a batch of 8 sequences:

  unrolled        `model.scan_layers=False`, `model.remat=none`;
  scanned         `model.scan_layers=True` (the blocks under `jax.lax.scan`, parameters stacked), remat none;
  scanned+remat   `model.scan_layers=True`, `model.remat=full` (the scanned body recomputed in the backward pass);
  unrolled+remat  `model.scan_layers=False`, `model.remat=full`, for reference.

The parameters and optimizer state are abstract (`ShapeDtypeStruct`s sharded by the model's partition specs):
nothing is drawn or run. A child times `jit(...).trace(...).lower()` (tracing the model and lowering to
StableHLO) and `.compile()` (XLA) of that one step, wall-clock seconds (`time.perf_counter`) and this
process's CPU seconds over every thread; imports, building the model and the device start are outside the
timing. The persistent compilation cache is off in the children (`JAX_COMPILATION_CACHE_DIR` removed from
their environment and `jax_enable_compilation_cache` False), so every figure is a real compile. With
`--repeats=N` each variant is compiled in N fresh processes and its median seconds are printed.

Per variant it prints the compiled step's temporary bytes per device (`compiled.memory_analysis()
.temp_size_in_bytes`), and per parameter as the 4 devices hold them together (per device x 4 / parameters,
the convention of docs/benchmarks.md's 21 B/param), the compiled program's lines of HLO text and its
all-gathers (how many sit in a `while` loop's body, i.e. run once per scanned unit). Then for each depth
unrolled's temporaries over each variant's (the acceptance of issue 50: at least 3 for scanned+remat), for
unrolled and scanned the seconds at the largest depth over those at the smallest (and of their parts), and
the load average before and after the runs (the machine may be shared; a child's compile uses more than one
thread). The last line is `compile_depth: ratio=R`: the scanned step's compile seconds (trace, lower
and compile, wall clock) at the largest depth over those at the smallest.

`--variants` picks the variants (all four by default; unrolled and scanned always). `--smoke` compiles those
two of a tiny model (width 32, 2 heads, experts of 64, 32-byte sequences) at 1 and 2 blocks: the same code
path and last lines, figures that are not measurements.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import _smoke
from absl import app, flags

_DEPTHS = flags.DEFINE_list("depths", ["4", "16", "64"], "Blocks of the model, smallest first (the ratio's "
                            "denominator) to largest (its numerator).")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.")
_NUM_EXPERTS = flags.DEFINE_integer("num_experts", 4, "Routed experts per block.")
_EXPERT_HIDDEN = flags.DEFINE_integer("expert_hidden_dim", 256, "Hidden width of an expert.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per inner step (a multiple of 4, the devices).")
_VARIANTS = flags.DEFINE_list("variants", ["unrolled", "scanned", "scanned+remat", "unrolled+remat"],
                              "The variants compiled (unrolled and scanned at least: the ratios' and the last line's).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Fresh processes per variant; the median of their seconds is printed.")
_ROLE = flags.DEFINE_enum("compile_role", "main", ["main", "child"], "main | child (started by main: one compile).")
_LAYERS = flags.DEFINE_integer("layers", 4, "child: the model's blocks.")
_SCAN = flags.DEFINE_bool("scan", False, "child: model.scan_layers.")
_REMAT = flags.DEFINE_string("remat", "none", "child: model.remat.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4  # the island's devices: mesh data=1 x fsdp=4 x expert=1
CHILD_SECONDS = 1800  # the longest wait for one child, seconds
# name -> (model.scan_layers, model.remat), in the order they are run and printed
VARIANTS = {"unrolled": (False, "none"), "scanned": (True, "none"), "scanned+remat": (True, "full"),
            "unrolled+remat": (False, "full")}
MB = 1e6


def _config():
    """The child's config: the flags' model on one island of `DEVICES` devices, fsdp over all of them."""
    from island_jax.config import default_config, island, validate

    c = default_config()
    c.model.update(num_layers=_LAYERS.value, d_model=_D_MODEL.value, num_heads=_NUM_HEADS.value,
                   seq_len=_SEQ_LEN.value, scan_layers=_SCAN.value, remat=_REMAT.value)
    c.moe.update(num_experts=_NUM_EXPERTS.value, expert_hidden_dim=_EXPERT_HIDDEN.value)
    c.islands.a = island(num_devices=DEVICES, data=1, fsdp=DEVICES, expert=1, batch_size=_BATCH.value, inner_steps=1)
    c.outer.enabled = False
    c.eval.batch_size = _BATCH.value
    validate(c)
    return c


def _all_gathers(hlo: str) -> tuple[int, int]:
    """(all-gathers in the compiled HLO text `hlo`, those of them in a `while` loop's body computation)."""
    import re

    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo))
    total = in_bodies = 0
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
        elif re.search(r"= \S+ all-gather(-start)?\(", line):
            total += 1
            in_bodies += name in bodies
    return total, in_bodies


def child() -> None:
    """Compiles the inner step once and prints its figures as `RESULT {json}`."""
    from island_jax.mesh import BATCH_AXES, island_mesh, use_cpu_devices

    use_cpu_devices(DEVICES)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from island_jax.island import step as step_lib
    from island_jax.model.init import abstract_params

    jax.config.update("jax_enable_compilation_cache", False)  # a real compile, whatever the environment says
    config = _config()
    mesh = island_mesh(1, 1, jax.devices()[:DEVICES], fsdp=DEVICES)
    graphdef, params, _ = abstract_params(config, mesh)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tx = step_lib.inner_optimizer(config, 100)
    train_step = step_lib.build_train_step(config, graphdef, tx)
    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(tx.init, params)
        batch = jax.ShapeDtypeStruct((_BATCH.value, _SEQ_LEN.value), jnp.int32, sharding=NamedSharding(mesh, P(BATCH_AXES)))
        wall0, cpu0 = time.perf_counter(), time.process_time()
        lowered = train_step.trace(params, opt_state, batch, batch, 0).lower()
        wall1 = time.perf_counter()
        compiled = lowered.compile()
        wall2, cpu2 = time.perf_counter(), time.process_time()
    hlo = compiled.as_text()
    gathers, in_loops = _all_gathers(hlo)
    print("RESULT " + json.dumps(dict(
        params=count, lower_seconds=wall1 - wall0, compile_seconds=wall2 - wall1, cpu_seconds=cpu2 - cpu0,
        temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes), hlo_lines=len(hlo.splitlines()),
        all_gathers=gathers, all_gathers_in_loops=in_loops,
    )), flush=True)


def run_child(layers: int, scan: bool, remat: str) -> dict:
    """One fresh process's figures for (layers, scan, remat) (`child`'s RESULT).

    Raises:
      RuntimeError: the child failed (its output's tail) or ran past `CHILD_SECONDS`.
    """
    from island_jax.mesh import without_forced_device_count

    env = without_forced_device_count(os.environ) | {"JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the persistent cache off: every compile is a real one
    cmd = [sys.executable, os.path.abspath(__file__), "--compile_role=child", f"--layers={layers}",
           f"--scan={scan}", f"--remat={remat}", f"--d_model={_D_MODEL.value}", f"--num_heads={_NUM_HEADS.value}",
           f"--num_experts={_NUM_EXPERTS.value}", f"--expert_hidden_dim={_EXPERT_HIDDEN.value}",
           f"--seq_len={_SEQ_LEN.value}", f"--batch_size={_BATCH.value}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the child {layers} layers scan={scan} remat={remat} ran past {CHILD_SECONDS} s") from e
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the child {layers} layers scan={scan} remat={remat} exited with {proc.returncode}; its "
                           f"output:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(layers: int, scan: bool, remat: str, repeats: int) -> dict:
    """`run_child`'s figures over `repeats` fresh processes: the seconds their medians, the rest the first's."""
    runs = [run_child(layers, scan, remat) for _ in range(repeats)]
    out = dict(runs[0])
    for key in ("lower_seconds", "compile_seconds", "cpu_seconds"):
        out[key] = statistics.median(r[key] for r in runs)
    out["seconds"] = statistics.median(r["lower_seconds"] + r["compile_seconds"] for r in runs)
    return out


def main_run() -> None:
    _smoke.sizes(depths=["1", "2"], d_model=32, num_heads=2, expert_hidden_dim=64, seq_len=32,
                 variants=["unrolled", "scanned"])
    variants = {name: VARIANTS[name] for name in VARIANTS if name in _VARIANTS.value}
    if set(_VARIANTS.value) - set(VARIANTS) or not {"unrolled", "scanned"} <= set(variants):
        raise app.UsageError(f"--variants is {_VARIANTS.value}; name unrolled, scanned and any of {list(VARIANTS)}")
    depths = [int(d) for d in _DEPTHS.value]
    if len(depths) < 2 or depths != sorted(depths) or depths[0] < 1:
        raise app.UsageError(f"--depths is {_DEPTHS.value}; give at least two depths, each >= 1, smallest first")
    if _BATCH.value % DEVICES or _REPEATS.value < 1:
        raise app.UsageError(f"--batch_size must be a multiple of {DEVICES} and --repeats at least 1")
    load_before = os.getloadavg()
    print(f"model: width {_D_MODEL.value}, {_NUM_HEADS.value} heads, an MoE of {_NUM_EXPERTS.value} experts of "
          f"{_EXPERT_HIDDEN.value} in every block, {_SEQ_LEN.value}-token sequences, batch {_BATCH.value}; mesh data=1 "
          f"x fsdp={DEVICES} x expert=1 on {DEVICES} CPU devices; persistent compilation cache off; "
          f"{_REPEATS.value} fresh process(es) per variant", flush=True)
    print(f"{'layers':>6} {'variant':<15} {'params':>10} {'lower s':>8} {'compile s':>10} {'total s':>8} "
          f"{'CPU s':>7} {'temp MB/dev':>12} {'temp B/param':>13} {'HLO lines':>10} {'all-gathers':>12} {'in loop':>8}",
          flush=True)
    results = {}
    for layers in depths:
        for name, (scan, remat) in variants.items():
            r = results[(layers, name)] = measure(layers, scan, remat, _REPEATS.value)
            r["per_param"] = r["temp_bytes"] * DEVICES / r["params"]
            print(f"{layers:>6} {name:<15} {r['params']:>10} {r['lower_seconds']:>8.2f} {r['compile_seconds']:>10.2f} "
                  f"{r['seconds']:>8.2f} {r['cpu_seconds']:>7.2f} {r['temp_bytes'] / MB:>12.1f} {r['per_param']:>13.2f} "
                  f"{r['hlo_lines']:>10} {r['all_gathers']:>12} {r['all_gathers_in_loops']:>8}", flush=True)
    for layers in depths:
        base = results[(layers, "unrolled")]["per_param"]
        print(f"temporaries at {layers} layers, unrolled's {base:.2f} B/param over each variant's: " + ", ".join(
            f"{name} {base / results[(layers, name)]['per_param']:.2f}" for name in variants if name != "unrolled"))
    for name in ("unrolled", "scanned"):
        first, last = results[(depths[0], name)], results[(depths[-1], name)]
        print(f"{name} compile seconds, {depths[-1]} layers over {depths[0]}: {last['seconds'] / first['seconds']:.3f} "
              f"(trace and lower {last['lower_seconds'] / first['lower_seconds']:.3f}, XLA "
              f"{last['compile_seconds'] / first['compile_seconds']:.3f}, CPU seconds "
              f"{last['cpu_seconds'] / first['cpu_seconds']:.3f})")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")
    ratio = results[(depths[-1], "scanned")]["seconds"] / results[(depths[0], "scanned")]["seconds"]
    print(f"compile_depth: ratio={ratio:.3f}")


def main(argv):
    del argv
    if _ROLE.value == "child":
        child()
    else:
        main_run()


if __name__ == "__main__":
    app.run(main)
