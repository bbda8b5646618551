"""One island's exchange sent from P = 1 and from P = 2 processes: seconds per round and CPU seconds per process.

  python benchmarks/scale_out.py [--megabytes=128] [--rounds=4] [--connections=4] [--smoke]

A coordinator serves one island over gRPC on loopback (this process). The
island's exchange is run by P sender processes, each a `GrpcTransport` with
`part=p, parts=P`: per round, each encodes its share of the payload's chunks
(`codec.deal`, balanced by bytes: the shares of an island whose processes all
hold every leaf) from the same float32 pseudo-gradient, contributes it over
its own `--connections` channels and receives its share of the update, as the
processes of a multi-process island do (what the island passes over its
interconnect is not included). The
payload is float32 ("none" codec), so moving bytes dominates encoding. For P
= 1 and then P = 2: the exchange seconds of each round (from the round's start
to the last process holding its share of the update, median over rounds) and
each process's CPU seconds per round (`time.process_time`, every thread), with
the coordinator's beside them.
The last line is `scale_out: ratio=R` (P = 2 seconds / P = 1 seconds).

Every process of both runs shares this machine's cores with the coordinator,
so this shows the mechanism (each process moves its half, and its CPU seconds
halve) more than the speed-up of hosts with their own CPUs and network
interfaces; the printout says so.

`--smoke` exchanges 2 MiB over 2 connections per process for 2 rounds
(`--megabytes=2 --rounds=2 --connections=2`) in seconds: the same code path
and printout, figures that are not measurements.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import _children
import _smoke
from absl import app, flags

_MEGABYTES = flags.DEFINE_integer("megabytes", 128, "Payload size, MiB (float32).")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds exchanged in each run (the first one is not timed; at least 2).")
_CONNECTIONS = flags.DEFINE_integer("connections", 4, "comm.connections of each sender process.")
_ROLE = flags.DEFINE_string("role", "main", "main | sender (senders are started by main).")
_ADDRESS = flags.DEFINE_string("address", "", "sender: the coordinator's HOST:PORT.")
_PART = flags.DEFINE_integer("part", 0, "sender: its index among the island's processes.")
_PARTS = flags.DEFINE_integer("parts", 1, "sender: the island's process count.")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

SENDER_SECONDS = 900  # the longest wait for the senders' rounds, seconds


def _config():
    from island_jax.config import default_config, island

    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.comm.connections = _CONNECTIONS.value
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    return c


def _params(num_bytes: int) -> dict:
    import numpy as np

    return {"w": np.zeros(num_bytes // 4, np.float32)}


def sender() -> None:
    """One process of the island: its share of every round's contribution and update; a JSON line per round."""
    import numpy as np

    from island_jax.comm.grpc_client import GrpcTransport
    from island_jax.config import fingerprint_fields
    from island_jax.coordinator import ContributionHeader
    from island_jax.model.init import checksum
    from island_jax.outer import codec

    num_bytes = _MEGABYTES.value << 20
    config = _config()
    transport = GrpcTransport(_ADDRESS.value, config.comm.chunk_bytes, round_timeout=300.0,
                              connections=_CONNECTIONS.value, part=_PART.value, parts=_PARTS.value)
    params = _params(num_bytes)
    transport.join("a", fingerprint_fields(config), checksum(params), 0)  # process 0 joins; the others ask who
    plan = codec.chunk_plan(params, "none", config.codec.block_size, config.comm.chunk_bytes)
    share = codec.deal(plan, _PARTS.value)[_PART.value]  # as `shards.Ownership` deals chunks every process holds
    pseudo_gradient = [np.random.default_rng(0).standard_normal(num_bytes // 4, dtype=np.float32) * 1e-3]
    for r in range(_ROUNDS.value):
        cpu, start = time.process_time(), time.time()
        encoder = codec.ChunkEncoder(pseudo_gradient, "none", config.codec.block_size, share)
        transport.contribute(ContributionHeader(r, "a", 1, None, None, 0), encoder)
        transport.fetch_update(r, "a")
        print(json.dumps(dict(round=r, start=start, end=time.time(), cpu=time.process_time() - cpu,
                              payload=encoder.nbytes)), flush=True)
    transport.close()


def _wait(procs: list[subprocess.Popen], deadline: float, what: str, done) -> None:
    """Polls until `done()`; exits with an error as soon as a sender fails, or at `deadline` (time.monotonic)."""
    while True:
        finished = done()  # before the failures: a sender that exits in between is seen failed, not done
        failed = [q.returncode for q in procs if q.poll() not in (None, 0)]
        if failed:
            sys.exit(f"a sender process failed (status {failed[0]}) before {what}; its error is in the stderr above")
        if finished:
            return
        if time.monotonic() > deadline:
            sys.exit(f"{what} took more than {SENDER_SECONDS} s; the senders' stderr above tells where they are")
        time.sleep(0.05)


def _run(parts: int) -> dict:
    """The island exchanged from `parts` processes: per round, the seconds and each process's CPU seconds."""
    from island_jax.comm.grpc_server import serve
    from island_jax.coordinator import Coordinator
    from island_jax.mesh import without_forced_device_count

    num_bytes = _MEGABYTES.value << 20
    config = _config()
    coordinator = Coordinator(config, _params(num_bytes), ["a"])
    server, _, port = serve(coordinator, "localhost:0", config.comm.chunk_bytes)
    cpu = time.process_time()
    env = without_forced_device_count(os.environ) | {"JAX_PLATFORMS": "cpu"}

    def start(part: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, __file__, "--role=sender", f"--address=localhost:{port}", f"--part={part}",
             f"--parts={parts}", f"--megabytes={_MEGABYTES.value}", f"--rounds={_ROUNDS.value}",
             f"--connections={_CONNECTIONS.value}"], stdout=subprocess.PIPE, text=True, env=env,
        )

    deadline = time.monotonic() + SENDER_SECONDS
    procs = [start(0)]
    try:
        # Process 0 joins for the island; the others only open their connections, and contribute once it has
        # joined (a multi-process island's processes agree on process 0's join reply first): they start then.
        _wait(procs, deadline, "process 0's join", lambda: all("a" in f.joined for f in coordinator.fragments))
        procs += [start(part) for part in range(1, parts)]
        _wait(procs, deadline, "the senders' rounds", lambda: all(q.poll() is not None for q in procs))
        lines = [[json.loads(line) for line in q.stdout.read().splitlines()] for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    coordinator_cpu = (time.process_time() - cpu) / _ROUNDS.value  # every round, the first included
    server.stop(grace=1)
    timed = range(1, _ROUNDS.value)  # round 0 includes the connections' set-up
    seconds = [max(x[r]["end"] for x in lines) - min(x[r]["start"] for x in lines) for r in timed]
    return dict(
        seconds=statistics.median(seconds),
        cpu=[statistics.median(x[r]["cpu"] for r in timed) for x in lines],
        payload=[x[0]["payload"] for x in lines],
        coordinator_cpu=coordinator_cpu,
    )


def main(argv):
    del argv
    _smoke.sizes(megabytes=2, rounds=2, connections=2)
    if _ROUNDS.value < 2:
        sys.exit("--rounds must be at least 2: the first round is not timed")
    if _ROLE.value == "sender":
        sender()
        return
    _children.exit_on_thread_error()  # the coordinator's server thread failing ends the benchmark
    runs = {parts: _run(parts) for parts in (1, 2)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"scale_out: payload {_MEGABYTES.value} MiB float32, {_CONNECTIONS.value} connections per process, "
          f"{_ROUNDS.value - 1} timed rounds, loopback gRPC, {cores} CPU cores here")
    for parts, run in runs.items():
        shares = "/".join(f"{b / 2**20:.1f}" for b in run["payload"])
        cpu = ", ".join(f"{c:.2f}" for c in run["cpu"])
        print(f"P={parts}: exchange {run['seconds']:.2f} s/round; CPU per process {cpu} s/round; "
              f"payload per process {shares} MiB; coordinator CPU {run['coordinator_cpu']:.2f} s/round")
    print(f"scale_out: cpu_per_process_ratio={max(runs[2]['cpu']) / max(runs[1]['cpu']):.2f} "
          "(largest P=2 process / the P=1 process)")
    print("note: the coordinator and every sender share this machine's cores; with hosts of their own (their own "
          "CPUs and network interfaces) each process's half runs beside the other's instead of competing for "
          "the same cores, so this shows the mechanism more than the speed-up")
    print(f"scale_out: ratio={runs[2]['seconds'] / runs[1]['seconds']:.2f} (P=2 / P=1 exchange seconds per round)")


if __name__ == "__main__":
    app.run(main)
