"""Compile time and XLA's temporaries of the inner step against depth, scanned (`model.scan_layers`) and unrolled.

  python benchmarks/compile_depth.py [--depths=4,16,64] [--d_model=64 ...] [--smoke]

One model family (by default width 64, 2 heads, every block an MoE of 4 experts of 128, 64-token sequences, a
batch of 8) at each depth of `--depths`, in four variants: unrolled and scanned, each without remat and with
`model.remat = "full"` (`unrolled_remat`, `scanned_remat`). Each variant compiles in a fresh process (this script with `--role=child`), on 4
virtual CPU devices as one island's mesh data=1 x fsdp=4 x expert=1, with the persistent compilation cache off,
so that every figure is a compile from nothing. The child times `jax.jit(train_step).lower(...)` (tracing and
lowering) and `.compile()` (XLA) of the island's inner step (`island.step.build_train_step`: AdamW, gradients,
the routing-bias update), on the parameters and optimizer state placed as an island places them, and reads the
compiled program's temporary bytes per device (`memory_analysis().temp_size_in_bytes`; on XLA:CPU the
figure of the whole program, every device's share).

It prints one row per depth and variant: compile seconds (lower + compile), the part that is XLA's, the
temporaries in MB and per parameter; then, per depth, unrolled's temporaries over those of scanned with remat
`full`. The last line is `compile_depth: ratio=R`, the scanned (no remat) compile seconds at the deepest depth
over those at the shallowest.

`--variants` picks the variants compiled (all four by default). `--smoke` compiles the scanned variant at depths
1 and 2 of a width-16 model: the same code path and last line, figures that are not measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _children
import _smoke
from absl import app, flags

_DEPTHS = flags.DEFINE_list("depths", ["4", "16", "64"], "Blocks per model, shallowest first.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "Model width.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 2, "Attention heads.")
_NUM_EXPERTS = flags.DEFINE_integer("num_experts", 4, "Routed experts per MoE block.")
_EXPERT_HIDDEN = flags.DEFINE_integer("expert_hidden_dim", 128, "Hidden width of an expert.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per inner step (a multiple of 4, the devices).")
_VARIANTS = flags.DEFINE_list("variants", ["unrolled", "scanned", "unrolled_remat", "scanned_remat"],
                              "Variants to compile (the factor line needs unrolled and scanned_remat; the last line "
                              "needs scanned).")
_ROLE = flags.DEFINE_string("role", "main", "main | child (started by main: one compile, one JSON line).")
_LAYERS = flags.DEFINE_integer("layers", 4, "child: blocks.")
_SCAN = flags.DEFINE_bool("scan", False, "child: model.scan_layers.")
_REMAT = flags.DEFINE_string("remat", "none", "child: model.remat.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

DEVICES = 4
# variant -> (model.scan_layers, model.remat)
VARIANTS = {"unrolled": (False, "none"), "scanned": (True, "none"), "unrolled_remat": (False, "full"),
            "scanned_remat": (True, "full")}
CHILD_SECONDS = 1800  # the longest one compile may take, seconds
MB = 1e6


def _config():
    from island_jax.config import default_config

    c = default_config()
    c.model.update(seq_len=_SEQ_LEN.value, num_layers=_LAYERS.value, d_model=_D_MODEL.value,
                   num_heads=_NUM_HEADS.value, scan_layers=_SCAN.value, remat=_REMAT.value)
    c.moe.update(num_experts=_NUM_EXPERTS.value, expert_hidden_dim=_EXPERT_HIDDEN.value)
    return c


def main_child() -> None:
    """Compiles the inner step once and prints {"seconds", "xla_seconds", "temp_bytes", "params"} as JSON."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np

    from island_jax.island import step as step_lib
    from island_jax.island.placement import Shardings
    from island_jax.mesh import island_mesh
    from island_jax.model.init import count, init_params

    config = _config()
    mesh = island_mesh(1, 1, jax.devices()[:DEVICES], fsdp=DEVICES)
    graphdef, params, specs = init_params(config)
    shardings = Shardings(mesh, specs)
    tx = step_lib.inner_optimizer(config, 100)
    train_step = step_lib.build_train_step(config, graphdef, tx)
    windows = np.random.default_rng(0).integers(0, 256, (_BATCH.value, _SEQ_LEN.value + 1)).astype(np.uint8)
    with jax.set_mesh(mesh):
        placed = shardings.place(params)
        opt_state = jax.jit(tx.init)(placed)
        args = step_lib.batch_args(shardings.batch_of(windows), 0)
        start = time.perf_counter()
        lowered = train_step.lower(placed, opt_state, *args)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
    print(json.dumps(dict(seconds=end - start, xla_seconds=end - lowered_at,
                          temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes), params=count(params))))


def _child(layers: int, scan: bool, remat: str) -> dict:
    from island_jax.mesh import without_forced_device_count

    flag_args = [f"--{f.name}={f.value}" for f in (_D_MODEL, _NUM_HEADS, _NUM_EXPERTS, _EXPERT_HIDDEN, _SEQ_LEN,
                                                   _BATCH)]
    cmd = [sys.executable, os.path.abspath(__file__), "--role=child", f"--layers={layers}", f"--scan={scan}",
           f"--remat={remat}", *flag_args]
    env = without_forced_device_count(os.environ) | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = _children.read_line(proc, "{", CHILD_SECONDS)
    if proc.wait() != 0:
        raise RuntimeError(f"the compile of {layers} layers (scan {scan}, remat {remat}) exited with {proc.returncode}")
    return json.loads(line)


def main_run() -> None:
    depths = [int(d) for d in _DEPTHS.value]
    print(f"inner step of width {_D_MODEL.value}, {_NUM_HEADS.value} heads, an MoE of {_NUM_EXPERTS.value} experts "
          f"of {_EXPERT_HIDDEN.value} in every block, batch {_BATCH.value} x {_SEQ_LEN.value}; mesh data=1 x "
          f"fsdp={DEVICES} x expert=1 on {DEVICES} CPU devices; no compilation cache", flush=True)
    print(f"{'layers':>6}  {'variant':<22} {'params':>10} {'compile s':>9} {'of it XLA':>9} {'temp MB':>9} "
          f"{'temp B/param':>12}", flush=True)
    results = {}
    for layers in depths:
        for name in _VARIANTS.value:
            scan, remat = VARIANTS[name]
            r = results[(layers, name)] = _child(layers, scan, remat)
            label = ("scanned" if scan else "unrolled") + ("" if remat == "none" else f", remat {remat}")
            print(f"{layers:>6}  {label:<22} {r['params']:>10,} {r['seconds']:>9.2f} {r['xla_seconds']:>9.2f} "
                  f"{r['temp_bytes'] / MB:>9.2f} {r['temp_bytes'] / r['params']:>12.2f}", flush=True)
    if {"unrolled", "scanned_remat"} <= set(_VARIANTS.value):
        for layers in depths:
            factor = results[(layers, "unrolled")]["temp_bytes"] / results[(layers, "scanned_remat")]["temp_bytes"]
            print(f"{layers} layers: unrolled temporaries / scanned with remat full = {factor:.2f}", flush=True)
    for name in ("unrolled", "scanned"):
        if name in _VARIANTS.value:
            ratio = results[(depths[-1], name)]["seconds"] / results[(depths[0], name)]["seconds"]
            print(f"{name}: compile seconds at {depths[-1]} layers / at {depths[0]} = {ratio:.3f}", flush=True)
    ratio = results[(depths[-1], "scanned")]["seconds"] / results[(depths[0], "scanned")]["seconds"]
    print(f"compile_depth: ratio={ratio:.3f}", flush=True)


def main(argv):
    del argv
    _smoke.sizes(depths=["1", "2"], d_model=16, expert_hidden_dim=16, seq_len=16, batch_size=4, variants=["scanned"])
    if "scanned" not in _VARIANTS.value:
        raise app.UsageError("--variants must include scanned, the last line's")
    main_child() if _ROLE.value == "child" else main_run()


if __name__ == "__main__":
    app.run(main)
