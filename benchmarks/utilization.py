"""Compute utilization of plain DiLoCo against Streaming DiLoCo with overlap, side by side.

  python benchmarks/utilization.py [--rounds=6] [--inner_steps=32] [--latency_ms=50] [--simulated_speed=0.5]
      [--step_ms=MS] [--overrides=KEY=VALUE,...] [--smoke]

Two equal islands of the two_islands model (2 devices each, 4 sequences per
step), H = 32 (`--inner_steps`), each in its own process with the coordinator in a third
(`launch/local.py`, gRPC over loopback), under an emulated link set so that
moving the whole int8 model once, up and back, takes about half a round of
compute: rate = 2 x payload bytes x 8 / (0.5 x H x step seconds), with 50 ms
one way.

Each island runs on a CPU of its own (`launch/local.py --cpus`; the
coordinator may use either), as each would on its own host. Sharing the
cores, an island's steps would run faster whenever the other island sleeps,
and the runs would measure how the islands' steps happen to interleave.

The islands run at `simulated_speed` 0.5 (`--simulated_speed`): each step
sleeps as long as it computed. An island on accelerators leaves its host's
cores free while it computes, and they run the exchange; on a machine whose
few cores are the islands' compute devices, the sleep stands for that. With
1.0 every core computes, and the exchange's own CPU work (encode, merge,
decode, on the same two cores) slows the steps beside it.

First a short calibration run (plain DiLoCo, no link) measures the step time
that sizes the link (`--step_ms` gives it instead, e.g. the `reference step`
a calibration printed before, and skips that run). Then two runs under that
link:
  plain      outer.fragments = 1, outer.overlap_steps = 0 (DiLoCo: wait for every update)
  streaming  outer.fragments = 4, outer.overlap_steps = auto (arXiv 2501.18512)

Compute utilization, per island, is the runs' own accounting (see
`island_jax/island/accounting.py`): inner steps x the step time measured in
the same run with no exchange in flight (the median of the island's last 32 such
steps, per round), over wall seconds. The benchmark sums it over the rounds
after the first (which carries the islands' start, one behind the other) and
before the last (which waits for the final update: every run must), so it
measures the steady state; the whole-run figure (`summary.json`'s
`compute_utilization`) and the figure against the calibration run's step
time are printed beside it. The reference comes from the compared run itself
because separate runs of the same program on a shared machine differ in step
time by more than the effect measured (the figures are in docs/benchmarks.md).
The printed value of a run is the lower of its two islands. Last line:
`utilization: plain=P streaming=U` (target U >= 0.95, U > P).

`--overrides` changes the config of every run and of the payload's model,
e.g. `--overrides=model.d_model=64,model.num_layers=2`.

`--smoke` runs the two compared runs for 3 rounds of H = 4 with the test
model's size (one layer, d_model 32, 4 experts; `--rounds=3 --inner_steps=4`,
`--overrides` of `SMOKE_MODEL`) under a link sized by a 20 ms step
(`--step_ms=20`, no calibration run unless `--step_ms=0` is given): the same
printout, in about the time of the runs' start-up (tens of seconds); its
figures are not measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import _smoke
import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "two_islands.py")
CPUS = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []  # island a's and b's


_ROUNDS = flags.DEFINE_integer("rounds", 6, "Rounds of each compared run (at least 3: the first and the last are "
                               "not steady).")
_INNER_STEPS = flags.DEFINE_integer("inner_steps", 32, "H, inner steps per round of both islands (at least 4, "
                                    "the streaming run's fragments).")
_LATENCY_MS = flags.DEFINE_float("latency_ms", 50.0, "One-way latency of the emulated link, milliseconds.")
_SIMULATED_SPEED = flags.DEFINE_float("simulated_speed", 0.5, "islands.NAME.simulated_speed of both islands, in (0, 1].")
_STEP_MS = flags.DEFINE_float("step_ms", 0.0, "The step time that sizes the link, milliseconds; 0 measures it with "
                              "a calibration run first.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "KEY.PATH=VALUE config overrides of every run and of the payload's "
                               "model, e.g. model.d_model=64.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

SMOKE_MODEL = [  # the test model's size (tests/tiny_config.py)
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.seq_len=32", "moe.num_experts=4",
    "moe.expert_hidden_dim=32", "eval.batch_size=4", "eval.num_windows=8",
]


def launch(workdir: str, overrides: list[str], speed: float) -> tuple[dict, dict]:
    """Runs launch/local.py to completion; returns ({island: [round records]}, the run's summary)."""
    H = _INNER_STEPS.value
    equal = [
        "--config.islands.a.num_devices=2", "--config.islands.a.mesh.data=1", "--config.islands.a.batch_size=4",
        f"--config.islands.a.inner_steps={H}", f"--config.islands.b.inner_steps={H}",
        f"--config.islands.a.simulated_speed={speed}", f"--config.islands.b.simulated_speed={speed}",
        "--config.eval.every_rounds=1000", "--config.checkpoint.every_rounds=1000",
        *(f"--cpus={name}={cpu}" for name, cpu in zip("ab", CPUS)),
        *(f"--config.{item}" for item in _OVERRIDES.value),
    ]
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), f"--config={CONFIG}", f"--workdir={workdir}",
           *equal, *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"run failed ({' '.join(overrides)}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    records = {}
    for name in ("a", "b"):
        with open(os.path.join(workdir, "islands", name, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        records[name] = [r for r in rows if r.get("kind") == "round"]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        return records, json.load(f)


def utilization(rounds: list[dict], step: float | None = None, steady: bool = True) -> float:
    """Ideal compute seconds / wall seconds over the steady rounds (or all of them). The ideal compute is
    each round's `ideal_compute_seconds` (its inner steps x the run's own clean step), or with `step`
    (seconds) inner steps x `step`."""
    chosen = rounds[1:-1] if steady else rounds
    ideal = sum(r["ideal_compute_seconds"] if step is None else r["inner_steps"] * step for r in chosen)
    return ideal / sum(r["wall_seconds"] for r in chosen)


def _override(config, item: str) -> None:
    """Sets one `--overrides` item, "KEY.PATH=VALUE", in `config`, as the launcher's --config.KEY.PATH=VALUE."""
    path, sep, text = item.partition("=")
    *parents, leaf = path.split(".")
    node = config
    try:
        for name in parents:
            node = node[name]
        old = node[leaf]
    except KeyError:
        sys.exit(f"--overrides item {item!r} names no config key; write KEY.PATH=VALUE, e.g. model.d_model=64")
    if not sep:
        sys.exit(f"--overrides item {item!r} has no value; write KEY.PATH=VALUE, e.g. model.d_model=64")
    node[leaf] = text.lower() in ("1", "true") if isinstance(old, bool) else type(old)(text)


def main(argv) -> None:
    del argv
    _smoke.sizes(rounds=3, inner_steps=4, overrides=SMOKE_MODEL, step_ms=20.0)
    if _ROUNDS.value < 3 or _INNER_STEPS.value < 4:
        sys.exit("--rounds must be at least 3 (steady rounds lie between the first and the last) and --inner_steps "
                 "at least 4 (one step per fragment of the streaming run)")
    if _STEP_MS.value < 0:
        sys.exit(f"--step_ms is {_STEP_MS.value}; give a step time in milliseconds, or 0 to measure it")
    H = _INNER_STEPS.value
    from island_jax.model.init import init_params
    from island_jax.outer import codec

    exec_globals: dict = {}
    with open(CONFIG, encoding="utf-8") as f:
        exec(compile(f.read(), CONFIG, "exec"), exec_globals)
    model_config = exec_globals["get_config"]()
    for item in _OVERRIDES.value:
        _override(model_config, item)
    _, params, _ = init_params(model_config)
    payload = codec.payload_bytes(params, "int8", model_config.codec.block_size)

    with tempfile.TemporaryDirectory() as tmp:
        speed = _SIMULATED_SPEED.value
        if _STEP_MS.value:
            step, source = _STEP_MS.value / 1e3, "--step_ms"
        else:
            calibration, _ = launch(os.path.join(tmp, "calibrate"), ["--config.outer.rounds=3"], speed)
            step = max(float(np.median([r["step_seconds"] for r in rounds[1:]])) for rounds in calibration.values())
            source = f"calibration: no link, simulated_speed {speed}"
        round_seconds = H * step
        gbps = 2 * payload * 8 / (0.5 * round_seconds) / 1e9
        if len(CPUS) < 2:
            print("fewer than 2 CPUs (or no sched_setaffinity): the islands share the CPUs")
        print(f"reference step {step * 1e3:.1f} ms ({source}; sizes the link); round {round_seconds:.2f} s of compute; "
              f"int8 payload {payload} bytes; link {gbps * 1e3:.2f} Mbit/s, {_LATENCY_MS.value:.0f} ms one way "
              f"(whole model up and back: {2 * payload * 8 / gbps / 1e9:.2f} s)")
        link = [f"--config.comm.link.bandwidth_gbps={gbps}", f"--config.comm.link.latency_ms={_LATENCY_MS.value}",
                f"--config.outer.rounds={_ROUNDS.value}"]
        results = {}
        for label, extra in (
            ("plain", ["--config.outer.fragments=1", "--config.outer.overlap_steps=0"]),
            ("streaming", ["--config.outer.fragments=4", "--config.outer.overlap_steps=auto"]),
        ):
            records, summary = launch(os.path.join(tmp, label), link + extra, speed)
            steady = {n: utilization(r) for n, r in records.items()}
            whole = {n: summary["islands"][n]["compute_utilization"] for n in records}
            against_calibration = {n: utilization(r, step) for n, r in records.items()}
            clean = {n: np.median([x["clean_step_seconds"] for x in r[1:-1]]) for n, r in records.items()}
            blocked = {n: sum(x["seconds_blocked"] for x in r) for n, r in records.items()}
            taus = sorted({x["overlap_steps"] for r in records.values() for x in r})
            results[label] = min(steady.values())
            print(f"{label:9s}: steady rounds {' '.join(f'{n}={v:.3f}' for n, v in steady.items())} | whole run "
                  f"{' '.join(f'{n}={v:.3f}' for n, v in whole.items())} | against the calibration step "
                  f"{' '.join(f'{n}={v:.3f}' for n, v in against_calibration.items())} | clean step "
                  f"{' '.join(f'{n}={v * 1e3:.1f}ms' for n, v in clean.items())} | blocked "
                  f"{' '.join(f'{n}={v:.1f}s' for n, v in blocked.items())} | tau {taus}")
    print(f"utilization: plain={results['plain']:.3f} streaming={results['streaming']:.3f}")


if __name__ == "__main__":
    app.run(main)
