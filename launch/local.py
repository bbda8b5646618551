"""Starts a multi-process run on this machine: the coordinator and one process per island.

  python launch/local.py --config=experiments/configs/two_islands.py --workdir=workdir/two_islands

Each role is `experiments/train.py --role=...` in its own process with its own
JAX runtime and virtual CPU devices, talking gRPC over localhost, exactly as a
cluster launch would. Their log lines are shown prefixed with the role
(`[coordinator]`, `[island a]`), and one progress line per round gathers the
islands' losses, bytes and the ETA. If any process fails, the others are
stopped and the launcher exits with that process's status; on success it
writes `WORKDIR/summary.json` from all roles. Overrides (`--config.a.b=v`, with
`=`) go to every role. Running it again with the same workdir resumes every
role from its newest checkpoint.

Behind a bandwidth-limited link (Linux, as root): `launch/wan_netns.sh` makes two
network namespaces joined by a shaped veth pair, `ij-coord` (10.77.0.1) and
`ij-island` (10.77.0.2); the launcher can start each role inside one of them:

  sudo launch/wan_netns.sh run 1gbit -- python launch/local.py --config=... --workdir=... \
      --netns_coordinator=ij-coord --netns_islands=b=ij-island

`--netns_coordinator=NS` runs the coordinator in NS (`ip netns exec NS ...`);
`--netns_islands` lists `NAME=NS` pairs, or one bare `NS` for every island not
named, and an island it does not place runs in the coordinator's namespace (the
only other place from which it can reach the coordinator), so the example
above puts island b behind the link and island a next to the coordinator. With
namespaces, the coordinator listens on its namespace's own address (the first
global IPv4 address there, 10.77.0.1 with wan_netns.sh) unless `--host` says
otherwise, and every island dials that address: from the coordinator's
namespace it is local, from the island namespace it is across the link. A
`--host` of 0.0.0.0 (or ::) listens on every address and islands still dial the
namespace's address. With `--port=0` the free port is picked inside the
coordinator's namespace. Every namespace must exist before anything starts
(`launch/wan_netns.sh up RATE`); `ip netns exec` execs the role in place, so the
pids shown are the roles' own and they are stopped as without namespaces.
Without these flags nothing changes: every role runs in the launcher's namespace.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

# glibc malloc for the roles: serve buffers up to 32 MiB from the heap and keep freed memory, instead of
# mapping fresh pages for every large array and unmapping them again. Each inner step and exchange allocates
# arrays of megabytes; with the defaults the page faults cost about a tenth of the CPU here (measured on
# two_islands, 2 cores: step time 0.22 -> 0.185 s, system time 9.0 -> 6.6 s).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_TOP_PAD_": str(64 << 20)}

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (one subfolder per role).")
_HOST = flags.DEFINE_string("host", "localhost", "Host the coordinator listens on.")
_PORT = flags.DEFINE_integer("port", 0, "Port the coordinator listens on; 0 picks a free one.")
_NETNS_COORDINATOR = flags.DEFINE_string(
    "netns_coordinator", "", "Network namespace to run the coordinator in (`ip netns exec`); empty: this one."
)
_NETNS_ISLANDS = flags.DEFINE_string(
    "netns_islands", "", "Comma-separated NAME=NS: island NAME runs in namespace NS; a bare NS places every island "
    "not named; islands not placed run in the coordinator's namespace. Needs --netns_coordinator."
)
_CPUS = flags.DEFINE_multi_string(
    "cpus", [], "ROLE=CPUS, repeatable: run ROLE (`coordinator` or an island's name) on those CPUs only (Linux "
    "sched_setaffinity; CPUS as taskset writes them, e.g. 0 or 0,2-3), so that islands emulated on one machine do not "
    "share cores; roles not named may run on any CPU."
)
flags.mark_flags_as_required(["config", "workdir"])

TRAIN = Path(__file__).resolve().parents[1] / "experiments" / "train.py"
LOOPBACK = ("localhost", "127.0.0.1", "[::1]", "::1")
WILDCARD = ("0.0.0.0", "::", "[::]")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_WAN_UP = "create them with `sudo launch/wan_netns.sh up RATE` (or run under `launch/wan_netns.sh run RATE -- ...`)"


def _ip(*args: str) -> str:
    """Runs `ip ARGS` and returns its output; exits with its message if it fails."""
    try:
        out = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        sys.exit("network namespaces need the `ip` command: install iproute2")
    if out.returncode != 0:
        sys.exit(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out.stdout


def _placement(islands: list[str]) -> tuple[str, dict[str, str]]:
    """The coordinator's namespace and each island's from the flags ("": the launcher's own)."""
    coordinator, spec = _NETNS_COORDINATOR.value.strip(), _NETNS_ISLANDS.value.strip()
    if spec and not coordinator:
        sys.exit("--netns_islands needs --netns_coordinator: islands reach the coordinator over the link between "
                 "the namespaces (e.g. --netns_coordinator=ij-coord --netns_islands=b=ij-island)")
    named, every = {}, None
    for item in filter(None, (i.strip() for i in spec.split(","))):
        name, sep, ns = item.rpartition("=")
        if not ns or (sep and not name):
            sys.exit(f"--netns_islands: cannot read {item!r}; give NAME=NS pairs or one bare NS")
        if not sep:
            if every is not None:
                sys.exit(f"--netns_islands: more than one bare namespace ({every!r}, {ns!r})")
            every = ns
        elif name not in islands:
            sys.exit(f"--netns_islands: no island {name!r} in the config (islands: {', '.join(islands)})")
        elif name in named:
            sys.exit(f"--netns_islands: island {name!r} is placed twice")
        else:
            named[name] = ns
    return coordinator, {n: named.get(n, every or coordinator) for n in islands}


def parse_cpus(specs: list[str], roles: list[str], available: set[int]) -> dict[str, set[int]]:
    """{role: CPUs} from `--cpus` values ROLE=CPUS, CPUS a comma-separated list of CPU numbers and ranges.

    Raises:
      ValueError: a value that cannot be read, a role not in `roles`, a role
        given twice, or a CPU not in `available` (this process's CPUs).
    """
    placed: dict[str, set[int]] = {}
    for spec in specs:
        role, sep, cpus = spec.partition("=")
        role = role.strip()
        if not sep or not role or not cpus.strip():
            raise ValueError(f"--cpus: cannot read {spec!r}; give ROLE=CPUS, e.g. --cpus=a=0 --cpus=b=1-2")
        if role not in roles:
            raise ValueError(f"--cpus: no role {role!r} (roles: {', '.join(roles)})")
        if role in placed:
            raise ValueError(f"--cpus: role {role!r} is placed twice")
        chosen: set[int] = set()
        for part in cpus.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                raise ValueError(f"--cpus: cannot read CPUs {cpus!r} of {role!r}; write them as in 0,2-3")
            chosen.update(range(int(first), int(last if dash else first) + 1))
        missing = sorted(chosen - available)
        if not chosen or missing:
            raise ValueError(f"--cpus: CPUs {missing or cpus} of {role!r} are not available here; "
                             f"this process may use {sorted(available)}")
        placed[role] = chosen
    return placed


def _namespace_address(ns: str) -> str | None:
    """The first global IPv4 address in namespace `ns` (None if it has none)."""
    for line in _ip("-n", ns, "-o", "-4", "addr", "show", "scope", "global").splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def _free_port_in(ns: str, host: str) -> int:
    """A free port on `host` inside namespace `ns`."""
    code = f"import socket; s = socket.socket(); s.bind(({host!r}, 0)); print(s.getsockname()[1])"
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        sys.exit(f"cannot pick a free port on {host} in namespace {ns}: {out.stderr.strip()[-500:]}; pass --port")
    return int(out.stdout.split()[-1])


def _addresses(coordinator_ns: str, island_ns: dict[str, str]) -> tuple[str, str]:
    """Where the coordinator listens and where the islands dial it (HOST:PORT each); exits on a bad placement."""
    namespaces = {coordinator_ns, *island_ns.values()} - {""}
    if not namespaces:
        address = f"{_HOST.value}:{_PORT.value or _free_port(_HOST.value)}"
        return address, address
    if os.geteuid() != 0:
        sys.exit("running roles in network namespaces (`ip netns exec`) needs root (CAP_SYS_ADMIN); run with sudo")
    existing = {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
    missing = sorted(namespaces - existing)
    if missing:
        sys.exit(f"network namespace{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found; {_WAN_UP}")
    apart = any(ns != coordinator_ns for ns in island_ns.values())  # some island dials across namespaces
    own = _namespace_address(coordinator_ns)
    if own is None and apart and (not _HOST.present or _HOST.value in WILDCARD):
        sys.exit(f"namespace {coordinator_ns} has no global IPv4 address for islands in other namespaces to dial; "
                 f"pass --host, or {_WAN_UP}")
    listen = _HOST.value if _HOST.present or own is None else own
    dial = own if listen in WILDCARD and own is not None else listen
    if apart and dial in LOOPBACK:
        sys.exit(f"islands outside the coordinator's namespace cannot reach it at {dial}: drop --host (the "
                 "namespace's own address is used) or give an address of the coordinator's namespace")
    port = _PORT.value or _free_port_in(coordinator_ns, listen.strip("[]"))
    return f"{listen}:{port}", f"{dial}:{port}"


def _die_with_parent() -> None:
    """In the child: receive SIGTERM if the launcher dies, so no role outlives it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _start_role(cpus: set[int] | None) -> None:
    """In the child, before it runs the role: die with the launcher, and keep to `cpus` when given."""
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


def _forward(prefix: str, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{prefix}] {line}")
            sys.stdout.flush()


def _checked(config, workdir: str, names: list[str]):
    """Everything that can refuse the launch, before anything is created or started: the config, a
    finished workdir, `--netns_*` and `--cpus`. Returns (coordinator namespace, island namespaces, cpus)."""
    from island_jax import config as config_lib
    from island_jax.workdir import refuse_finished

    try:
        config_lib.validate(config)
        refuse_finished(workdir)
    except (config_lib.ConfigError, FileExistsError) as e:
        sys.exit(str(e))
    if not config.outer.enabled:
        sys.exit("outer.enabled is False: a run without the outer loop has no coordinator; "
                 "run it in one process with experiments/train.py")
    coordinator_ns, island_ns = _placement(names)
    cpus = {}
    if _CPUS.value:
        if not hasattr(os, "sched_setaffinity"):
            sys.exit("--cpus needs Linux (sched_setaffinity); leave it out on this system")
        try:
            cpus = parse_cpus(_CPUS.value, ["coordinator", *names], os.sched_getaffinity(0))
        except ValueError as e:
            sys.exit(str(e))
    return coordinator_ns, island_ns, cpus


def _start(workdir: str, names: list[str], coordinator_ns: str, island_ns: dict, cpus: dict) -> dict:
    """Starts the coordinator and every island (`experiments/train.py --role=...`); {role: Popen}."""
    listen, dial = _addresses(coordinator_ns, island_ns)
    overrides = [a for a in sys.argv[1:] if a.startswith("--config")]  # the config and its overrides

    def command(ns: str, address: str, *role: str) -> list[str]:
        netns = ["ip", "netns", "exec", ns] if ns else []
        return netns + [sys.executable, "-u", str(TRAIN), f"--workdir={workdir}", f"--coordinator={address}",
                        *overrides, *role]

    roles = [("coordinator", command(coordinator_ns, listen, "--role=coordinator"))] + [
        (f"island {n}", command(island_ns[n], dial, "--role=island", f"--island={n}")) for n in names
    ]
    where = {"coordinator": coordinator_ns} | {f"island {n}": island_ns[n] for n in names}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in MALLOC_ENV.items():  # an explicit setting of the caller wins
        env.setdefault(key, value)
    procs = {}
    for role, cmd in roles:  # every process first: preexec_fn is only safe before threads start
        pinned = cpus.get(role.removeprefix("island "))
        procs[role] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                       preexec_fn=functools.partial(_start_role, pinned))
        inside = f" in namespace {where[role]}" if where[role] else ""
        on = f" on CPUs {','.join(map(str, sorted(pinned)))}" if pinned else ""
        print(f"[launch] started {role} (pid {procs[role].pid}){inside}{on}", flush=True)
    return procs


def _supervise(procs: dict, progress, lock: threading.Lock) -> tuple[str, int] | None:
    """Prints the progress lines until every process ends; on the first failure (or Ctrl-C) stops the
    others. Returns (role, status) of that failure, or None."""
    failed, failures = None, []
    try:
        while failed is None and any(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
            for line in progress.poll():
                with lock:
                    print(f"[launch] {line}", flush=True)
            failures = [(r, p.returncode) for r, p in procs.items() if p.poll() not in (None, 0)]
            failed = failures[0] if failures else None
    except KeyboardInterrupt:
        failed = ("launch", 130)
    if failed is None:
        return None
    for role, code in failures if failed[0] != "launch" else [failed]:
        print(f"[launch] {role} exited with status {code}; stopping the other processes", flush=True)
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 10
    for p in procs.values():
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed


def main(argv):
    del argv
    from island_jax.progress import Progress
    from island_jax.workdir import combine_summaries

    config, workdir = _CONFIG.value, _WORKDIR.value
    names = list(config.islands.keys())
    coordinator_ns, island_ns, cpus = _checked(config, workdir, names)
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    procs = _start(workdir, names, coordinator_ns, island_ns, cpus)
    lock = threading.Lock()
    threads = [threading.Thread(target=_forward, args=(role, p.stdout, lock), daemon=True) for role, p in procs.items()]
    for t in threads:
        t.start()
    progress = Progress(workdir, names, config.outer.rounds)
    failed = _supervise(procs, progress, lock)
    for t in threads:
        t.join(timeout=5)
    if failed is not None:
        sys.exit(failed[1] if failed[1] > 0 else 1)
    for line in progress.poll():
        print(f"[launch] {line}", flush=True)
    summary = combine_summaries(config, workdir, time.perf_counter() - start)
    print(
        f"[launch] done in {summary['wall_seconds']:.1f} s: eval loss {summary['eval_loss_initial']:.4f} -> "
        f"{summary['eval_loss_final']:.4f} nats/byte; global parameters agree: {summary['checksums_agree']}; "
        f"summary in {os.path.join(workdir, 'summary.json')}",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
