"""The coordinator's CPU seconds per round against the parameters and the contributors it merges.

  python benchmarks/merge.py [--params=16777216] [--islands=1,2,4] [--repeats=3] [--shards=1,2]
      [--shard_islands=2] [--chunk_bytes=1048576] [--smoke]

One `Coordinator` in this process, fed through its Python methods
(no transport): every island of K contributes an int8 payload (block 256) of
a float32 pseudo-gradient of `--params` elements, and one island fetches the
update. That is the coordinator's whole round: verify and decode each
contribution chunk by chunk, the token-weighted mean, the Nesterov outer step,
the view's update and the update's encoding. Its CPU seconds
(`time.process_time`, every thread of the process) are timed after one
warm-up round, for each K side by side.

The planner (`island_jax/plan/compute.py`) models a round's coordinator CPU as
params x (fixed + per_island x K) nanoseconds. The script prints the two
constants (ns per parameter) fitted to these rounds, when at least two K
were timed, and the ratio of the largest K's CPU to the smallest's
(`merge: ratio=R`). The rounds are int8's; the planner applies the
constants to every codec.

Then the same round for a coordinator cut into S shards by chunk range
(`coordinator.shards`, `--shards`, default 1 and 2) with `--shard_islands`
contributors: S `Coordinator`s of this process over one `shards.LocalBus`,
each given every island's payload (it takes the chunks it owns), polled
until each merged, its own checksum part computed and the update fetched
from each. The shards run one after another on this thread, and each shard's
CPU seconds are those of its own calls (`time.process_time`, which also
counts XLA's threads; a call returns once its chunks are merged). Printed per
shard: CPU and wall seconds per round and the ratio to one shard's CPU; the
last line is `merge_shards: ratio=R (largest shard of S / 1 shard CPU)` for
the largest S.

What two cores can show: each shard's share of a round's CPU (about 1 / S of
one shard's, plus what every shard does whatever its range: agreeing on the
round, its share of the checksum, the bus). What they cannot: the wall-clock
gain of S shards on S hosts. Here the shards take turns on the same two
cores (in a multi-process run on one machine they would compete for them),
so the round's wall time is the sum of theirs; on hosts of their own it
would be about the largest shard's, which is an inference, not a measurement
of this machine.

`--smoke` merges 262144 parameters from K = 1 and 2, one timed round each
(`--params=262144 --islands=1,2 --repeats=1 --chunk_bytes=65536`: 4 chunks
of one 65536-element piece each, so that each shard owns 2), and with 1 and
2 shards, in a few seconds: the same code path and printout, figures that
are not measurements.
"""

from __future__ import annotations

import os
import statistics
import time

import _smoke
import numpy as np
from absl import app, flags

_PARAMS = flags.DEFINE_integer("params", 1 << 24, "Float32 parameters of the merged payload.")
_ISLANDS = flags.DEFINE_list("islands", ["1", "2", "4"], "Contributor counts K to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per K, after one warm-up round.")
_SHARDS = flags.DEFINE_list("shards", ["1", "2"], "Coordinator shard counts S to time (coordinator.shards), "
                            "side by side; the first should be 1.")
_SHARD_ISLANDS = flags.DEFINE_integer("shard_islands", 2, "Contributors K of the rounds timed shard by shard.")
_CHUNK_BYTES = flags.DEFINE_integer("chunk_bytes", 1 << 20, "comm.chunk_bytes: the payload's chunks, which the "
                                    "shards split by range.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help


def _setup(params: int, islands: int, shards: int = 1) -> tuple[list, list[str], list[bytes]]:
    """(the coordinator's `shards` parts, every island joined; the islands' names; their int8 payloads)."""
    from island_jax.config import default_config, fingerprint_fields, island
    from island_jax.coordinator import Coordinator
    from island_jax.coordinator.shards import LocalBus, Shard
    from island_jax.outer import codec

    config = default_config()
    config.coordinator.shards = shards
    config.comm.chunk_bytes = _CHUNK_BYTES.value
    names = [f"i{k}" for k in range(islands)]
    for name in names:
        config.islands[name] = island(1, 1, 1, 1, 1)
    like = {"w": np.zeros(params, np.float32)}
    bus = LocalBus()
    made = [Coordinator(config, like, names, shard=Shard(k, shards, bus) if shards > 1 else None)
            for k in range(shards)]
    for c in made:  # the leader admits; the others only learn of the island
        for name in names:
            c.join(name, fingerprint_fields(config), made[0].checksum)
    rng = np.random.default_rng(0)
    payloads = [
        codec.encode({"w": (rng.standard_normal(params) * 1e-3).astype(np.float32)}, "int8", 256) for _ in names
    ]
    return made, names, payloads


def cpu_seconds_per_round(params: int, islands: int, repeats: int) -> tuple[float, float]:
    """(median CPU seconds, median wall seconds) of a round merging `islands` int8 contributions."""
    from island_jax.coordinator import ContributionHeader

    (coordinator,), names, payloads = _setup(params, islands)
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


def cpu_seconds_per_shard(params: int, islands: int, shards: int, repeats: int) -> tuple[list[float], list[float]]:
    """([median CPU seconds], [median wall seconds]) per shard of a round of a coordinator of `shards` shards
    merging `islands` int8 contributions: each shard's own calls (contribute, poll, fetch), the shards one after
    another on this thread."""
    from island_jax.coordinator import ContributionHeader

    made, names, payloads = _setup(params, islands, shards)
    cpu, wall = [[] for _ in made], [[] for _ in made]
    for r in range(repeats + 1):
        spent = [[0.0, 0.0] for _ in made]

        def timed(k: int, fn) -> None:
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            spent[k][0] += time.process_time() - c0
            spent[k][1] += time.perf_counter() - w0

        for k, c in enumerate(made):
            timed(k, lambda c=c: [c.contribute(ContributionHeader(r, name, 1000, c.checksum), payload)
                                  for name, payload in zip(names, payloads)])
        while any(c.round <= r for c in made):  # the leader closes the round; the others follow its set
            for k, c in enumerate(made):
                if c.round <= r:
                    timed(k, c.poll)
        for k, c in enumerate(made):
            timed(k, lambda c=c: c.fetch_update(r, names[0]))
        timed(0, lambda: made[0].complete_record(made[0].fragments[0].history[-1], 0))  # the leader's statistics
        if r:
            for k in range(len(made)):
                cpu[k].append(spent[k][0])
                wall[k].append(spent[k][1])
    return [statistics.median(x) for x in cpu], [statistics.median(x) for x in wall]


def compare_shards(params: int, islands: int, counts: list[int], repeats: int) -> None:
    """Times a round of a coordinator of each shard count in `counts`, per shard, and prints the ratios to the
    first count's (1): each shard's CPU, all shards' together, and the largest shard's (the last line)."""
    print(f"merge_shards: {params} float32 parameters, {islands} contributors, {repeats} timed rounds per shard "
          f"count; the shards of a count take turns on this thread, {os.cpu_count()} CPUs")
    one = None
    for s in counts:
        cpu, wall = cpu_seconds_per_shard(params, islands, s, repeats)
        one = sum(cpu) if one is None else one
        shards = "; ".join(f"shard {k} CPU {c:.3f} s/round ({c / one:.2f} of 1 shard), wall {w:.3f} s/round"
                           for k, (c, w) in enumerate(zip(cpu, wall)))
        print(f"shards={s}: {shards}; all shards CPU {sum(cpu):.3f} s/round ({sum(cpu) / one:.2f} of 1 shard)")
        largest = max(cpu)
    print(f"merge_shards: on {os.cpu_count()} CPUs the shards share the cores (here one after another), so each "
          "shard's CPU seconds show its share of a round; the round's wall time here is the sum of the shards', "
          "and the speedup of shards on hosts of their own (about the largest shard's time) is not measured")
    print(f"merge_shards: ratio={largest / one:.2f} (largest shard of {counts[-1]} / 1 shard CPU)")


def main(argv):
    del argv
    _smoke.sizes(params=1 << 18, islands=["1", "2"], repeats=1, chunk_bytes=1 << 16)
    shard_counts = [int(s) for s in _SHARDS.value]
    if not shard_counts or shard_counts[0] != 1 or min(shard_counts) < 1:
        raise app.UsageError(f"--shards={','.join(_SHARDS.value)}: give shard counts starting with 1 (the baseline)")
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
    if len(shard_counts) >= 2:
        compare_shards(params, _SHARD_ISLANDS.value, shard_counts, _REPEATS.value)


if __name__ == "__main__":
    app.run(main)
