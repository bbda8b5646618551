"""One outer sync across a kernel-shaped 1 Gbit/s link, against a gloo all-reduce over the same link.

  sudo python benchmarks/sync_vs_gloo.py [--rate=1gbit] [--repeats=5] [--params=33554432] [--smoke]

Needs root (network namespaces) and torch for the baseline only
(`pip install -e '.[bench]'`). Without torch it says so first, still times
ours, prints `one outer sync S s (median of N)` last and exits with status 1:
there is no ratio without the baseline. `launch/wan_netns.sh up RATE` builds two
namespaces joined by a veth pair shaped with tc tbf on both ends; they are
removed afterwards, also after a failure.

Ours: the coordinator in one namespace, one island in the other. The island
times one full outer sync of a 2^25-parameter (32M, `--params`) float32 pseudo-gradient:
int8 encode (block 256, chunk by chunk as the chunks are sent), transfer over `comm.connections` connections, the
coordinator's chunk-wise merge, Nesterov outer step and update encoding, the
update back, decode and apply. With `comm.pipeline` the update flows back
while the contribution is still arriving, so the two directions overlap.

Baseline: `torch.distributed` gloo float32 all_reduce of the same tensor
between one process in each namespace (a 2-rank ring moves 128 MiB each way,
about 1.07 s at 1 Gbit/s).

Both are timed after one warm-up; medians are compared. Beside the seconds,
each side's process CPU seconds per round (user + system, every thread): the
island's and the coordinator's, gloo's two ranks'. The two namespaces share the
machine's cores, so on a small machine a side that spends more CPU also waits
for the other's. Last line: `sync_vs_gloo: ratio=R` (ours / gloo seconds).

`--smoke` syncs 2^20 parameters once after the warm-up (`--params=1048576
--repeats=1`) across the same namespaces and link, in seconds: the same code
path and printout (including the missing-torch exit above), figures that are
not measurements.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import _children
import _smoke
from absl import app, flags

_RATE = flags.DEFINE_string("rate", "1gbit", "tc rate of the link, each way.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed syncs of each kind, after one warm-up.")
_PARAMS = flags.DEFINE_integer("params", 1 << 25, "Float32 parameters of the synced pseudo-gradient.")
_ROLE = flags.DEFINE_string("role", "main", "main | coordinator | island | gloo (the others are started by main).")
_RANK = flags.DEFINE_integer("rank", 0, "gloo rank.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator or gloo port (island and rank 1).")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "ijbench"
COORD_NS, ISLAND_NS = f"{PREFIX}-coord", f"{PREFIX}-island"
COORD_IP = "10.77.0.1"
GLOO_PORT = 29533
WAIT_SECONDS = 900  # the longest wait for a role's result (or the coordinator's port), seconds
BASELINE_NEEDS = "the gloo baseline needs torch: install it with pip install -e '.[bench]'"


def _config():
    from island_jax.config import default_config, island

    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.codec.kind, c.codec.block_size = "int8", 256
    return c


def _params():
    import numpy as np

    return {"w": np.zeros(_PARAMS.value, np.float32)}


def coordinator_role() -> None:
    from island_jax.comm.grpc_server import serve
    from island_jax.coordinator import Coordinator

    _children.exit_on_thread_error()  # the server thread failing ends this role; main then stops with an error
    c = _config()
    # inside two private network namespaces: the measurement is of the exchange itself, in the clear
    server, service, port = serve(Coordinator(c, _params(), ["a"]), f"{COORD_IP}:0", c.comm.chunk_bytes,
                                  insecure=True)
    print(f"PORT {port}", flush=True)
    service.session.wait_until_fetched(0, timeout=600)  # the warm-up round
    before = _children.cpu_seconds()
    service.session.wait_until_fetched(_REPEATS.value, timeout=600)
    print(f"CPU {(_children.cpu_seconds() - before) / _REPEATS.value}", flush=True)  # per timed round
    server.stop(1)


def island_role(port: int) -> None:
    import jax
    import numpy as np

    from island_jax.comm.grpc_client import GrpcTransport
    from island_jax.config import fingerprint_fields
    from island_jax.coordinator import ContributionHeader
    from island_jax.model.init import checksum
    from island_jax.outer import codec

    c = _config()
    params = _params()
    plan = codec.chunk_plan(params, "int8", 256, c.comm.chunk_bytes)
    t = GrpcTransport(
        f"{COORD_IP}:{port}", c.comm.chunk_bytes, 60, 600, c.comm.connections, pipeline=c.comm.pipeline
    )
    t.join("a", fingerprint_fields(c), checksum(params))
    pseudo_gradient = {"w": jax.device_put(np.random.default_rng(0).standard_normal(_PARAMS.value).astype(np.float32) * 0.01)}
    times, cpu = [], []
    for r in range(_REPEATS.value + 1):
        jax.block_until_ready(pseudo_gradient)
        cpu_start = _children.cpu_seconds()
        start = time.perf_counter()
        payload = codec.ChunkEncoder(pseudo_gradient, "int8", 256, plan)  # encodes as it is sent
        encoded = time.perf_counter()
        t.contribute(ContributionHeader(r, "a", 1000), payload)
        update = t.fetch_update(r, "a")
        received = time.perf_counter()
        params = codec.decode_and_apply(params, update, "int8", 256, out=params)  # in place: no fresh pages
        end = time.perf_counter()
        s = t.last_stats
        print(
            f"  round {r}{' (warm-up)' if r == 0 else ''}: {end - start:.3f} s = to host {encoded - start:.3f} + "
            f"encode and exchange {received - encoded:.3f} (sending {s.seconds_sending:.3f}, overlapped "
            f"{s.seconds_overlapped:.3f}) "
            f"+ decode and apply {end - received:.3f}; {s.bytes_sent / 1e6:.1f} MB up, {s.bytes_received / 1e6:.1f} MB down",
            flush=True,
        )
        if r:
            times.append(end - start)
            cpu.append(_children.cpu_seconds() - cpu_start)
    print(f"SECONDS {statistics.median(times)} CPU {statistics.median(cpu)}", flush=True)
    t.close()


def gloo_role(rank: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "wan0"  # the veth end in each namespace (launch/wan_netns.sh)
    dist.init_process_group("gloo", init_method=f"tcp://{COORD_IP}:{GLOO_PORT}", rank=rank, world_size=2)
    tensor = torch.randn(_PARAMS.value, dtype=torch.float32)
    times, cpu = [], []
    for r in range(_REPEATS.value + 1):
        dist.barrier()
        cpu_start = _children.cpu_seconds()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        seconds = time.perf_counter() - start
        if r:
            cpu.append(_children.cpu_seconds() - cpu_start)
        if rank == 0:
            print(f"  all_reduce {r}{' (warm-up)' if r == 0 else ''}: {seconds:.3f} s", flush=True)
        if r:
            times.append(seconds)
    print(f"SECONDS {statistics.median(times)} CPU {statistics.median(cpu)}", flush=True)
    dist.destroy_process_group()


def _in(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *args, f"--repeats={_REPEATS.value}",
            f"--params={_PARAMS.value}"]


def _seconds(proc: subprocess.Popen, echo: bool = True) -> tuple[float, float]:
    """The median seconds and CPU seconds a role prints (its `SECONDS S CPU C` line), echoing its other lines
    (with `echo`); after it exits with 0."""
    fields = _children.read_line(proc, "SECONDS ", WAIT_SECONDS).split()
    for line in proc.stdout:
        if echo:
            print(line, end="", flush=True)
    if proc.wait(timeout=60) != 0:
        raise RuntimeError(f"{proc.args} failed with status {proc.returncode}; its error is in the stderr above")
    return float(fields[1]), float(fields[3])


def _cpu(proc: subprocess.Popen) -> float:
    """The CPU seconds per round the coordinator role prints (its `CPU C` line) as it ends."""
    return float(_children.read_line(proc, "CPU ", WAIT_SECONDS).split()[1])


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def main_role() -> None:
    if os.geteuid() != 0:
        sys.exit("sync_vs_gloo needs root to build network namespaces (CAP_NET_ADMIN); run it with sudo")
    baseline = _has_torch()
    if not baseline:
        print(f"gloo: torch is not installed, so only ours runs and no ratio is printed; {BASELINE_NEEDS}", flush=True)
    env = dict(os.environ, IJ_NETNS_PREFIX=PREFIX)
    script = os.path.join(ROOT, "launch", "wan_netns.sh")
    subprocess.run([script, "down"], env=env, check=True, capture_output=True)
    subprocess.run([script, "up", _RATE.value], env=env, check=True)
    procs = []

    def start(*args: str, **kwargs) -> subprocess.Popen:
        procs.append(subprocess.Popen(*args, **kwargs))
        return procs[-1]

    try:
        print(f"ours: one island and the coordinator across a {_RATE.value} tbf link", flush=True)
        coordinator = start(_in(COORD_NS, "--role=coordinator"), stdout=subprocess.PIPE, text=True)
        port = int(_children.read_line(coordinator, "PORT ", WAIT_SECONDS).split()[1])
        island = start(_in(ISLAND_NS, "--role=island", f"--port={port}"), stdout=subprocess.PIPE, text=True)
        ours, island_cpu = _seconds(island)
        coordinator_cpu = _cpu(coordinator)
        coordinator.wait(timeout=60)
        ours_cpu = f"CPU s per round: island {island_cpu:.3f}, coordinator {coordinator_cpu:.3f}"
        if not baseline:
            print(f"one outer sync {ours:.3f} s (median of {_REPEATS.value}); {ours_cpu}", flush=True)
            sys.exit(f"sync_vs_gloo: no ratio: {BASELINE_NEEDS}, then run this again")
        print(f"gloo: float32 all_reduce of {_PARAMS.value} parameters across the same link", flush=True)
        rank1 = start(_in(ISLAND_NS, "--role=gloo", "--rank=1"), stdout=subprocess.PIPE, text=True)
        rank0 = start(_in(COORD_NS, "--role=gloo", "--rank=0"), stdout=subprocess.PIPE, text=True)
        gloo, rank0_cpu = _seconds(rank0)
        _, rank1_cpu = _seconds(rank1, echo=False)
        print(f"one outer sync {ours:.3f} s, gloo all_reduce {gloo:.3f} s (medians of {_REPEATS.value}); ours: "
              f"{ours_cpu}; gloo: CPU s per round: rank 0 {rank0_cpu:.3f}, rank 1 {rank1_cpu:.3f}")
        print(f"sync_vs_gloo: ratio={ours / gloo:.3f}")
    finally:
        for proc in procs:  # after a failure: no role outlives the namespaces
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        down = subprocess.run([script, "down"], env=env, check=False, capture_output=True, text=True)
        if down.returncode != 0:  # its output stays off stdout, whose last line is the result
            print(f"{down.stdout}{down.stderr}sync_vs_gloo: removing the namespaces failed (above); run "
                  f"IJ_NETNS_PREFIX={PREFIX} launch/wan_netns.sh down", file=sys.stderr)


def main(argv):
    del argv
    _smoke.sizes(params=1 << 20, repeats=1)
    if _ROLE.value in ("coordinator", "island"):
        from island_jax import allocator

        allocator.configure()  # as the island and coordinator roles allocate (experiments/train.py)
    if _ROLE.value == "coordinator":
        coordinator_role()
    elif _ROLE.value == "island":
        island_role(_PORT.value)
    elif _ROLE.value == "gloo":
        gloo_role(_RANK.value)
    else:
        main_role()


if __name__ == "__main__":
    app.run(main)
