"""The coordinator's CPU seconds per round against the parameters and the contributors it merges.

  python benchmarks/merge.py [--params=16777216] [--islands=1,2,4] [--repeats=3] [--smoke]

One `Coordinator` in this process, fed through its Python methods
(no transport): every island of K contributes an int8 payload (block 256) of
a float32 pseudo-gradient of `--params` elements, and one island fetches the
update. That is the coordinator's whole round: verify and decode each
contribution chunk by chunk, the token-weighted mean, the Nesterov outer step,
the view's update and the update's encoding. Its CPU seconds
(`time.process_time`, every thread of the process) are timed after one
warm-up round, for each K side by side.

The planner (`island_jax/plan/compute.py`) models a round's coordinator CPU as
params x (fixed + per_island x K) nanoseconds. The last lines print the two
constants (ns per parameter) fitted to these rounds, when at least two K
were timed, and the ratio of the largest K's CPU to the smallest's. The
rounds are int8's; the planner applies the constants to every codec.

`--smoke` merges 65536 parameters from K = 1 and 2, one timed round each
(`--params=65536 --islands=1,2 --repeats=1`), in a few seconds: the same code
path and printout, figures that are not measurements.
"""

from __future__ import annotations

import statistics
import time

import _smoke
import numpy as np
from absl import app, flags

_PARAMS = flags.DEFINE_integer("params", 1 << 24, "Float32 parameters of the merged payload.")
_ISLANDS = flags.DEFINE_list("islands", ["1", "2", "4"], "Contributor counts K to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per K, after one warm-up round.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help


def cpu_seconds_per_round(params: int, islands: int, repeats: int) -> tuple[float, float]:
    """(median CPU seconds, median wall seconds) of a round merging `islands` int8 contributions."""
    from island_jax.config import default_config, fingerprint_fields, island
    from island_jax.coordinator import ContributionHeader, Coordinator
    from island_jax.outer import codec

    config = default_config()
    names = [f"i{k}" for k in range(islands)]
    for name in names:
        config.islands[name] = island(1, 1, 1, 1, 1)
    like = {"w": np.zeros(params, np.float32)}
    coordinator = Coordinator(config, like, names)
    for name in names:
        coordinator.join(name, fingerprint_fields(config), coordinator.checksum)
    rng = np.random.default_rng(0)
    payloads = [
        codec.encode({"w": (rng.standard_normal(params) * 1e-3).astype(np.float32)}, "int8", 256) for _ in names
    ]
    cpu, wall = [], []
    for r in range(repeats + 1):
        c0, w0 = time.process_time(), time.perf_counter()
        for name, payload in zip(names, payloads):
            coordinator.contribute(ContributionHeader(r, name, 1000, coordinator.checksum), payload)
        coordinator.fetch_update(r, names[0])
        if r:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def main(argv):
    del argv
    _smoke.sizes(params=1 << 16, islands=["1", "2"], repeats=1)
    params, counts = _PARAMS.value, [int(k) for k in _ISLANDS.value]
    print(f"merge: {params} float32 parameters, int8 block 256, {_REPEATS.value} timed rounds per K")
    measured = {}
    for k in counts:
        cpu, wall = cpu_seconds_per_round(params, k, _REPEATS.value)
        measured[k] = cpu
        print(f"K={k}: CPU {cpu:.3f} s/round, wall {wall:.3f} s/round, {cpu / params * 1e9:.2f} ns per parameter")
    if len(set(counts)) >= 2:
        ks = np.asarray(counts, np.float64)
        per_island, fixed = np.polyfit(ks, np.asarray([measured[k] for k in counts]) / params, 1)
        print(f"merge: fixed_ns_per_param={fixed * 1e9:.2f} per_island_ns_per_param={per_island * 1e9:.2f}")
    print(f"merge: ratio={measured[max(counts)] / measured[min(counts)]:.2f} (K={max(counts)} / K={min(counts)} CPU)")


if __name__ == "__main__":
    app.run(main)
