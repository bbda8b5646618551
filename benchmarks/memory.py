"""Peak host memory of an island's processes and of the coordinator, in bytes per parameter, for four layouts.

  python benchmarks/memory.py [--d_model=768 --num_layers=6 ...] [--layouts=fsdp,two_process,replicated,two_shards]
      [--itemize] [--scan_layers] [--remat=full] [--smoke]

One island `a` of 4 devices and a coordinator, each role a process of its own started as a cluster would
(`experiments/train.py --role=...`, gRPC over loopback), trains a MoE of about 100M parameters (by default
the shape of experiments/configs/fsdp_100m.py: 6 blocks of width 768, 4 experts of 1536) for `--rounds`
rounds of `--inner_steps` steps, int8 pseudo-gradients without error feedback, in four layouts (the blocks
unrolled and no remat unless `--scan_layers` and `--remat` say otherwise):

  fsdp          one process x 4 devices, mesh data=1 x fsdp=4 x expert=1;
  two_process   two processes x 2 devices, the same mesh over both (`jax.distributed`, gloo);
  replicated    one process x 4 devices, data=4 (every device holds the whole state);
  two_shards    the island as in fsdp, the coordinator cut into two shards by chunk range
                (`coordinator.shards = 2`): two processes, `coordinator/0` and `coordinator/1`, each measured
                on its own as the one coordinator process is.

On XLA:CPU a device's memory is host memory, so a process's resident set holds its devices' parameters,
gradients, AdamW moments and anchor (20 bytes per parameter over the island, at float32), activations,
and what the outer loop keeps on the host (the global view, the pseudo-gradient, the payload). Each
process's peak resident set is the kernel's own figure (`ru_maxrss`, from `os.wait4`). A no-model
baseline, measured in the same run, is subtracted: a process that imports what a role imports and starts
the same number of CPU devices, then exits. The batch (`--batch_size` sequences of `--seq_len` tokens) is
small so that the activations stay under a tenth of the state; the estimate of both is printed.

With `--itemize` every role runs under benchmarks/_memory_probe.py with tracemalloc on, and the table adds,
at the sampled peak, the bytes of live JAX arrays on the process's devices, the host bytes Python and NumPy
hold, and the rest (runtime, compiled programs, XLA's temporaries); tracemalloc itself adds time and a
little memory, so those runs' peaks are not the figures of the last line.

With fsdp and two_shards run, a line `memory_shards: coordinator_bytes_per_param=C shard_bytes_per_param=S0,S1
ratio=R` (the line before the last when every layout ran): the one-process coordinator's figure (the fsdp
run's), each shard's (its process less the same one-device baseline), and the larger shard's over the
one-process figure (the target: 0.6). What a shard holds that does not shrink with its range (the whole
initial parameters while it starts, the shards' coordination service and its client, its compiled chunk
program) is in its figure, so a small model misses the target on that alone.

The last line is `memory: fsdp_bytes_per_param=X two_process_ratio=Y replicated_bytes_per_param=Z
coordinator_bytes_per_param=C planner_coordinator_bytes_per_param=D`: bytes per parameter of each layout's
larger process less the baseline, the two-process figure over the one-process fsdp figure, the
coordinator's (its fsdp run's process less a one-device baseline), and the planner's coordinator memory for
the same model (`island_jax.plan`, master + momentum + view + contributions + kept update) per parameter.

`--smoke` runs a tiny model (width 64, 2 blocks) for 1 round of 1 step: the same code path and printout,
figures that are not measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import _children
import _smoke
from absl import app, flags

_D_MODEL = flags.DEFINE_integer("d_model", 768, "Model width.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 6, "Blocks (each an MoE).")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 12, "Attention heads.")
_NUM_EXPERTS = flags.DEFINE_integer("num_experts", 4, "Routed experts per block.")
_EXPERT_HIDDEN = flags.DEFINE_integer("expert_hidden_dim", 1536, "Hidden width of an expert.")
_SCAN_LAYERS = flags.DEFINE_bool("scan_layers", False, "model.scan_layers: the blocks scanned, parameters stacked.")
_REMAT = flags.DEFINE_string("remat", "none", "model.remat: none | full | a jax.checkpoint policy's name.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Sequences per inner step (a multiple of 4, the devices).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds of each run.")
_INNER_STEPS = flags.DEFINE_integer("inner_steps", 2, "Inner steps per round.")
_ITEMIZE = flags.DEFINE_bool("itemize", False, "Run every role under the memory probe (tracemalloc on) and print "
                             "where each process's bytes are at its peak.")
_LAYOUTS = flags.DEFINE_list("layouts", ["fsdp", "two_process", "replicated", "two_shards"], "The layouts to run "
                             "(the last line needs the first three; the shards' line fsdp and two_shards).")
_MEMORY_ROLE = flags.DEFINE_string("memory_role", "main", "main | baseline (started by main).")
_DEVICES = flags.DEFINE_integer("devices", 1, "baseline: the CPU devices it starts.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "experiments", "train.py")
PROBE = os.path.join(ROOT, "benchmarks", "_memory_probe.py")
RUN_SECONDS = 1800  # the longest wait for one layout's processes, seconds
DEVICES = 4  # the island's devices in every layout
# name -> (island processes, mesh data, fsdp, expert, coordinator shards)
LAYOUTS = {"fsdp": (1, 1, 4, 1, 1), "two_process": (2, 1, 4, 1, 1), "replicated": (1, 4, 1, 1, 1),
           "two_shards": (1, 1, 4, 1, 2)}
MB = 1e6

CONFIG = '''"""benchmarks/memory.py's run: one island a of {devices} devices and a coordinator."""

from island_jax.config import default_config, island


def get_config():
    config = default_config()
    config.model.update(seq_len={seq_len}, num_layers={num_layers}, d_model={d_model}, num_heads={num_heads},
                        scan_layers={scan_layers}, remat={remat!r})
    config.moe.update(num_experts={num_experts}, expert_hidden_dim={expert_hidden_dim})
    config.islands.a = island(num_devices={devices}, data={data}, fsdp={fsdp}, expert={expert}, batch_size={batch},
                              inner_steps={inner_steps}, num_processes={processes})
    config.outer.rounds = {rounds}
    config.coordinator.shards = {shards}
    config.codec.update(kind="int8", error_feedback=False)
    config.eval.update(num_windows={batch}, batch_size={batch}, every_rounds={rounds})
    return config
'''


def _env() -> dict:
    from island_jax.mesh import without_forced_device_count

    return without_forced_device_count(os.environ) | {"JAX_PLATFORMS": "cpu"}


def _wait_all(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    """Waits for every process; returns each one's peak resident set, bytes (`ru_maxrss`).

    Raises:
      RuntimeError: a process failed (its log's tail) or they ran past `timeout` seconds (all are killed).
    """
    peaks, deadline = {}, time.monotonic() + timeout
    while len(peaks) < len(procs):
        for name, proc in procs.items():
            if name in peaks:
                continue
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            peaks[name] = usage.ru_maxrss * 1024  # KiB on Linux
            if proc.returncode != 0:
                _stop(procs)
                raise RuntimeError(f"{name} exited with status {proc.returncode}; its log:\n{_tail(proc)}")
        if time.monotonic() > deadline:
            _stop(procs)
            tails = "\n".join(f"--- {name}\n{_tail(proc)}" for name, proc in procs.items())
            raise RuntimeError(f"the run's processes ran past {timeout:.0f} s; their logs:\n{tails}")
        time.sleep(0.2)
    return peaks


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """Kills and reaps every process still running."""
    for proc in procs.values():
        if proc.returncode is None:
            proc.kill()
            proc.wait()


def _tail(proc: subprocess.Popen) -> str:
    proc.log.flush()
    with open(proc.log.name) as f:
        return f.read()[-3000:]


def _start(cmd: list[str], log_path: str, probe_out: str | None) -> subprocess.Popen:
    env = _env()
    if probe_out is not None:
        cmd = [sys.executable, PROBE, probe_out, *cmd[1:]]
        env["MEMORY_PROBE_TRACEMALLOC"] = "1"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    proc.log = log
    return proc


def baseline(devices: int, folder: str) -> int:
    """Peak resident set of a process that imports what a role imports and starts `devices` CPU devices, bytes."""
    cmd = [sys.executable, os.path.abspath(__file__), "--memory_role=baseline", f"--devices={devices}"]
    proc = _start(cmd, os.path.join(folder, f"baseline{devices}.log"), None)
    return _wait_all({"baseline": proc}, 300)["baseline"]


def write_config(name: str, folder: str) -> str:
    """The run's config file for layout `name` in `folder`; its path."""
    processes, data, fsdp, expert, shards = LAYOUTS[name]
    config = os.path.join(folder, f"{name}.py")
    with open(config, "w") as f:
        f.write(CONFIG.format(
            devices=DEVICES, data=data, fsdp=fsdp, expert=expert, processes=processes, seq_len=_SEQ_LEN.value,
            num_layers=_NUM_LAYERS.value, d_model=_D_MODEL.value, num_heads=_NUM_HEADS.value,
            num_experts=_NUM_EXPERTS.value, expert_hidden_dim=_EXPERT_HIDDEN.value, batch=_BATCH.value,
            inner_steps=_INNER_STEPS.value, rounds=_ROUNDS.value, scan_layers=_SCAN_LAYERS.value, remat=_REMAT.value,
            shards=shards,
        ))
    return config


def run_layout(name: str, folder: str, itemize: bool) -> tuple[dict[str, int], dict[str, dict]]:
    """One layout's run: (peak resident set per process, bytes; the probe's samples per process, with --itemize)."""
    processes, shards = LAYOUTS[name][0], LAYOUTS[name][4]
    config = write_config(name, folder)
    workdir, addresses = os.path.join(folder, name), ",".join(f"localhost:{_children.free_port()}" for _ in range(shards))
    common = [sys.executable, TRAIN, f"--config={config}", f"--workdir={workdir}", f"--coordinator={addresses}"]
    if shards == 1:
        roles = {"coordinator": ["--role=coordinator"]}
    else:  # each shard a process of its own, as launch/local.py starts them; shard 0 runs their service
        service = f"localhost:{_children.free_port()}"
        roles = {f"coordinator/{k}": ["--role=coordinator", f"--shard={k}", f"--shard_service={service}"]
                 for k in range(shards)}
    island_address = f"localhost:{_children.free_port()}"
    for p in range(processes):
        roles[f"a/{p}"] = ["--role=island", "--island=a"] + (
            [f"--process_id={p}", f"--island_coordinator={island_address}"] if processes > 1 else [])
    probes = {role: os.path.join(folder, f"{name}.{role.replace('/', '.')}.json") if itemize else None for role in roles}
    procs = {}
    for role, args in roles.items():
        procs[role] = _start(common + args, os.path.join(folder, f"{name}.{role.replace('/', '.')}.log"), probes[role])
    peaks = _wait_all(procs, RUN_SECONDS)
    samples = {}
    for role, path in probes.items():
        if path is not None:
            with open(path) as f:
                samples[role] = json.load(f)
    return peaks, samples


def _model_figures(config_path: str) -> tuple[int, int, int, float, float]:
    """(parameters, the island's state bytes, its activation bytes (estimate), the planner's coordinator bytes,
    and per shard of the config's `coordinator.shards`)."""
    import importlib.util

    from island_jax import config as config_lib
    from island_jax import plan as plan_lib
    from island_jax.island import memory
    from island_jax.model.flops import model_size

    spec = importlib.util.spec_from_file_location("memory_config", config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config_lib.validate(config)
    params = model_size(config).total_params
    b = memory.budget(config, "a")
    planned = plan_lib.plan(*plan_lib.from_config(config))
    return params, b.state * DEVICES, b.activations * DEVICES, planned.coordinator_memory["total"], \
        planned.shard_memory["total"]


def main_run() -> None:
    _smoke.sizes(d_model=64, num_layers=2, num_heads=4, num_experts=4, expert_hidden_dim=128, seq_len=32,
                 batch_size=4, rounds=1, inner_steps=1)
    itemize = _ITEMIZE.value
    unknown = sorted(set(_LAYOUTS.value) - set(LAYOUTS))
    if unknown:
        raise app.UsageError(f"--layouts names {unknown}; choose from {sorted(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="memory-") as folder:
        bases = {n: baseline(n, folder) for n in (1, 2, 4)}
        print("no-model baseline (imports and CPU devices, no model): "
              + ", ".join(f"{n} device{'s' if n > 1 else ''} {b / MB:.0f} MB" for n, b in bases.items()), flush=True)
        runs = {}
        for name in _LAYOUTS.value:
            runs[name] = run_layout(name, folder, itemize)
            print(f"{name}: done", flush=True)
        params, state, activations, planner, _ = _model_figures(write_config("fsdp", folder))
        planner_shard = _model_figures(write_config("two_shards", folder))[4]

    print(f"model: {params / 1e6:.1f}M parameters; the island's state {state / MB:.0f} MB over its {DEVICES} devices "
          f"(parameters, gradients, AdamW, anchor: {state / params:.1f} bytes per parameter); activations "
          f"{activations / MB:.0f} MB by the estimate ({activations / state:.3f} of the state); "
          f"model.scan_layers={_SCAN_LAYERS.value}, model.remat={_REMAT.value}")
    header = f"{'layout':<12} {'process':<14} {'peak MB':>9} {'less base MB':>13} {'bytes/param':>12}"
    if itemize:
        header += f" {'devices MB':>11} {'host MB':>9} {'rest MB':>9}"
    print(header)
    per_param = {}
    for name, (peaks, samples) in runs.items():
        processes = LAYOUTS[name][0]
        for role, peak in peaks.items():
            base = bases[1] if role.startswith("coordinator") else bases[DEVICES // processes]
            net = peak - base
            per_param[(name, role)] = net / params
            line = f"{name:<12} {role:<14} {peak / MB:>9.0f} {net / MB:>13.0f} {net / params:>12.1f}"
            if itemize:
                s = samples[role]
                rest = s["resident_bytes"] - s["device_bytes"] - s["host_traced_bytes"]
                line += f" {s['device_bytes'] / MB:>11.0f} {s['host_traced_bytes'] / MB:>9.0f} {rest / MB:>9.0f}"
            print(line)
            if itemize:
                for where, nbytes in samples[role].get("top", []):
                    print(f"{'':<27} host {nbytes / MB:>7.0f} MB  {os.path.relpath(where, ROOT)}")

    def island(name: str) -> float:
        return max(v for (n, role), v in per_param.items() if n == name and not role.startswith("coordinator"))

    print(f"planner's coordinator memory for this model: {planner / MB:.0f} MB ({planner / params:.1f} bytes per "
          "parameter)")
    if "two_shards" in runs:
        print(f"planner's memory per coordinator shard of 2: {planner_shard / MB:.0f} MB ({planner_shard / params:.1f} "
              "bytes per parameter)")
    if {"fsdp", "two_shards"} <= set(runs):
        one = per_param[("fsdp", "coordinator")]
        shards = [v for (n, role), v in sorted(per_param.items()) if n == "two_shards" and role.startswith("coordinator")]
        print(f"memory_shards: coordinator_bytes_per_param={one:.1f} "
              f"shard_bytes_per_param={','.join(f'{v:.1f}' for v in shards)} ratio={max(shards) / one:.3f}")
    if not {"fsdp", "two_process", "replicated"} <= set(runs):
        return
    fsdp, two = island("fsdp"), island("two_process")
    print(f"memory: fsdp_bytes_per_param={fsdp:.1f} two_process_ratio={two / fsdp:.3f} "
          f"replicated_bytes_per_param={island('replicated'):.1f} "
          f"coordinator_bytes_per_param={per_param[('fsdp', 'coordinator')]:.1f} "
          f"planner_coordinator_bytes_per_param={planner / params:.1f}")


def main_baseline() -> None:
    """What every role imports and starts, without a model, with the roles' allocator settings."""
    from island_jax import allocator

    allocator.configure()
    import island_jax.comm.grpc_client  # noqa: F401
    import island_jax.comm.grpc_server  # noqa: F401
    import island_jax.roles.coordinator  # noqa: F401
    import island_jax.roles.island  # noqa: F401
    from island_jax.mesh import use_cpu_devices

    use_cpu_devices(_DEVICES.value)
    import jax
    import jax.numpy as jnp

    for d in jax.devices():
        jax.block_until_ready(jax.device_put(jnp.ones(8), d) + 1)


def main(argv):
    del argv
    if _MEMORY_ROLE.value == "baseline":
        main_baseline()
    else:
        main_run()


if __name__ == "__main__":
    app.run(main)
