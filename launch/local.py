"""Starts a multi-process run on this machine: the coordinator and the processes of every island.

  python launch/local.py --config=experiments/configs/two_islands.py --workdir=workdir/two_islands

Each role is `experiments/train.py --role=...` in its own process with its own
JAX runtime and virtual CPU devices, talking gRPC over localhost, exactly as a
cluster launch would. Their log lines are shown prefixed with the role
(`[coordinator]`, `[island a]`), and one progress line per round gathers the
islands' losses, bytes and the ETA. If any process fails, the others are
stopped and the launcher exits with that process's status; on success it
writes `WORKDIR/summary.json` from all roles. Overrides (`--config.a.b=v`, with
`=`; one written with a space is refused) go to every role. Running it again
with the same workdir resumes every role from its newest checkpoint, and
`--workdir` alone resumes it under the config it recorded (island_jax/cli.py);
the round lines of earlier starts are not printed again (`resumed_progress`).
A config that differs from the one the run started with (each role's
config.json) is refused before anything starts, naming every changed field,
unless `--allow_config_change` (passed to every role, which records the
change). So is a `--port` another process holds (`check_port`).

An island of several processes (`islands.NAME.num_processes`, e.g.
`--config.islands.a.num_processes=2`) is started as that many processes,
`[island a/0]`, `[island a/1]`, ..., each with `--process_id` and the
`--island_coordinator` of its process 0 on a free local port: one
`jax.distributed` job per island, its CPU collectives over gloo, as a
multi-host island on a cluster (docs/cluster.md). They fail and restart
together: when one of them fails, the others are stopped, and with restarts
left all of them start again (one restart of the island).

A coordinator of K shards (`coordinator.shards`, e.g. `--config.coordinator.shards=2`)
is started as K processes, `[coordinator/0]` ... `[coordinator/K-1]`, each with
`--shard=k`, the `--coordinator` list of every shard's address (shard k on port
`--port` + k, or on free ports without `--port`) and `--shard_service` on a free
port of localhost, where shard 0 runs their `jax.distributed` service; every
island dials the whole list. They fail and restart together, as one unit, like
the processes of an island. `--dial` then lists K addresses, shard 0 first;
`--tls` makes one set of credentials, valid for every shard's address;
`--cpus=coordinator=CPUS` keeps every shard to those CPUs, `coordinator/K=CPUS`
one shard; with namespaces every shard runs in the coordinator's. Shard 0 writes
WORKDIR/coordinator, as a coordinator of one process does.

`--restart=N` starts a role that exits with a non-zero status or a signal again
(island_jax/supervisor.py), up to N times per role, with the same command line,
environment and CPUs (it resumes from its own checkpoints); the progress line
then ends with `| restarts: island b 1`. A role that fails once more after its N restarts
stops the run as above; a role that exits with status 0 is done; Ctrl-C stops
everything. `--dial=HOST:PORT` is where islands reach the coordinator when
that is not where it listens (a proxy, a NAT); it needs `--port` and is
refused with the namespace flags below, which pick that address themselves.

Behind a bandwidth-limited link (Linux, as root): `launch/wan_netns.sh` makes two
network namespaces joined by a shaped veth pair, `ij-coord` (10.77.0.1) and
`ij-island` (10.77.0.2); the launcher can start each role inside one of them:

  sudo launch/wan_netns.sh run 1gbit -- python launch/local.py --config=... --workdir=... \
      --netns_coordinator=ij-coord --netns_islands=b=ij-island --tls

(beyond loopback the coordinator needs TLS and tokens, which `--tls` makes for
the run in WORKDIR/secrets, or `--insecure`).
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

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from island_jax.supervisor import Role, Supervisor

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiment config (a get_config() file) or to a run's recorded config.json; "
    "left out with the --workdir of a started run, that run's recorded config.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (one subfolder per role).")
_HOST = flags.DEFINE_string("host", "localhost", "Host the coordinator listens on.")
_PORT = flags.DEFINE_integer(
    "port", 0, "Port the coordinator listens on; 0 picks a free one. With coordinator.shards = K > 1, shard k "
    "listens on PORT + k."
)
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
    "share cores; roles not named may run on any CPU. With coordinator shards, `coordinator` keeps every shard to "
    "those CPUs together, `coordinator/K` shard K alone (one way or the other, not both)."
)
_DIAL = flags.DEFINE_string(
    "dial", "", "HOST:PORT where islands dial the coordinator when it differs from where it listens (a proxy, a "
    "NAT); needs --port; empty: the address it listens on. With coordinator.shards = K > 1, K of them, "
    "HOST:PORT,HOST:PORT,..., shard 0 first."
)
_RESTART = flags.DEFINE_integer(
    "restart", 0, "Start a role that exits abnormally again, up to this many times per role; once a role has used "
    "them up and fails again, stop every process. 0: stop every process at the first failure.", lower_bound=0
)
_STOP_GRACE = flags.DEFINE_float(
    "stop_grace_seconds", 60.0, "When the run is stopped (SIGTERM, Ctrl-C, a role failing), the seconds every role "
    "gets to finish the checkpoint it is writing and exit, before SIGKILL; raise it for states that take longer to "
    "write.", lower_bound=0.0,
)
_TLS = flags.DEFINE_bool(
    "tls", False, "Secure the exchange for this run: a throwaway CA, server and client certificates and a token per "
    "island, made in WORKDIR/secrets (0600), passed to every role as comm.tls and comm.auth overrides."
)
_INSECURE = flags.DEFINE_bool(
    "insecure", False, "Let the coordinator listen beyond loopback without TLS and tokens (passed to its role)."
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume the run in --workdir under a config that differs from the one it started "
    "with (passed to every role, which records the change); without it, that is refused before anything starts."
)
flags.mark_flags_as_required(["workdir"])

TRAIN = Path(__file__).resolve().parents[1] / "experiments" / "train.py"
LOOPBACK = ("localhost", "127.0.0.1", "[::1]", "::1")
WILDCARD = ("0.0.0.0", "::", "[::]")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(host: str, n: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct free ports on `host`, none in `avoid` (held together while they are picked)."""
    sockets = [socket.socket() for _ in range(n + len(avoid))]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [p for p in (s.getsockname()[1] for s in sockets) if p not in avoid][:n]
    finally:
        for s in sockets:
            s.close()


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

    A role "G" places every process of the group G ("coordinator": every coordinator shard), "G/K" one of
    them; a group is placed one way or the other.

    Raises:
      ValueError: a value that cannot be read, a role not in `roles`, a role
        given twice, a group placed both whole and by process, or a CPU not in
        `available` (this process's CPUs).
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
    both = [r for r in placed if r.rpartition("/")[0] in placed]
    if both:
        group = both[0].rpartition("/")[0]
        raise ValueError(f"--cpus: {group} and {both[0]} are both placed; give {group}=CPUS for all of its "
                         f"processes, or {group}/K=CPUS for each, not both")
    return placed


def check_dial(dial: str, port: int, namespaces: bool, shards: int = 1) -> str:
    """`--dial` as given, after checking it: HOST:PORT (an IPv6 host in brackets), one per coordinator shard
    (`shards`, comma-separated, shard 0 first), with `--port` set (whatever forwards DIAL to the coordinator needs
    the ports it listens on: PORT + k for shard k) and no `--netns_*` (with namespaces the launcher picks the
    address islands dial). An empty `dial` is returned as is.

    Raises:
      ValueError: a value that cannot be read, or a combination that cannot work.
    """
    if not dial:
        return dial
    for item in dial.split(","):
        host, sep, number = item.rpartition(":")
        if not sep or not host.strip("[]") or not number.isdigit() or not 0 < int(number) < 65536:
            raise ValueError(f"--dial: cannot read {item!r}; give HOST:PORT, e.g. --dial=proxy.example.org:50051")
    if len(dial.split(",")) != shards:
        raise ValueError(f"--dial lists {len(dial.split(','))} address(es) but coordinator.shards is {shards}: give "
                         "one HOST:PORT per coordinator shard, shard 0 first (comma-separated)")
    if namespaces:
        raise ValueError("--dial cannot be combined with --netns_coordinator/--netns_islands: with namespaces "
                         "islands dial the coordinator namespace's own address, which the launcher finds; drop "
                         "--dial, or drop the namespace flags")
    if not port:
        raise ValueError("--dial needs --port: whatever forwards the dialled address to the coordinator must know "
                         "the port it listens on")
    return dial


def _namespace_address(ns: str) -> str | None:
    """The first global IPv4 address in namespace `ns` (None if it has none)."""
    for line in _ip("-n", ns, "-o", "-4", "addr", "show", "scope", "global").splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def _free_port_in(ns: str, host: str) -> int:
    """A free port on `host` inside namespace `ns`."""
    return _free_ports_in(ns, host, 1)[0]


def _free_ports_in(ns: str, host: str, n: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct free ports on `host` inside namespace `ns`, none in `avoid`."""
    code = (f"import socket; s = [socket.socket() for _ in range({n + len(avoid)})]; [x.bind(({host!r}, 0)) for x "
            "in s]; print(*[x.getsockname()[1] for x in s])")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        sys.exit(f"cannot pick a free port on {host} in namespace {ns}: {out.stderr.strip()[-500:]}; pass --port")
    return [int(p) for p in out.stdout.split() if int(p) not in avoid][:n]


def check_port(host: str, port: int, shards: int = 1) -> None:
    """Refuses a `--port` that another process holds on `host` (or on a loopback address a server on `host`
    also binds: `cli.port_in_use`), before any role starts; port 0 (pick one) passes. With `shards` > 1 the
    ports PORT + k of shards k = 1 .. shards - 1 are checked too.

    Raises:
      ValueError: one line naming the address taken and `--port`.
    """
    from island_jax.cli import port_in_use

    for k in range(shards if port else 0):
        taken = port_in_use(host, port + k)
        if taken and k == 0:
            raise ValueError(f"--port={port}: the port is in use by another process (binding {taken} fails); pass "
                             "a free --port, or leave --port out to have a free one picked")
        if taken:
            raise ValueError(f"--port={port}: coordinator shard {k} listens on --port + {k} = {port + k}, which is in "
                             f"use by another process (binding {taken} fails); pass a --port followed by "
                             f"{shards - 1} free ports, or leave --port out to have free ones picked")


def config_arguments(argv: list[str]) -> list[str]:
    """The arguments of `argv` (after `cli.config_argv`: the config one absolute `--config=PATH`) that the
    launcher passes on to every role: `--config=PATH` and each `--config.a.b=v` override, in order.

    Raises:
      ValueError: an override written with a space (`--config.outer.rounds 2`), which would reach the roles
        without its value; one line saying how to write it.
    """
    for before, arg in zip(argv[1:], argv[2:]):
        if before.startswith("--config.") and "=" not in before and not arg.startswith("-"):
            raise ValueError(f"{before} {arg}: write a config override as one argument, {before}={arg} (the "
                             "launcher passes each --config.a.b=v on to every role)")
    return [a for a in argv[1:] if a.startswith("--config")]


def _addresses(coordinator_ns: str, island_ns: dict[str, str], shards: int = 1) -> tuple[list[str], list[str], str]:
    """Where each coordinator shard listens and where the islands dial it (HOST:PORT each, shard 0 first), and,
    with `shards` > 1, the HOST:PORT of the shards' `jax.distributed` service (localhost in the coordinator's
    namespace; "" with one shard); exits on a bad placement or on a `--port` in use."""
    namespaces = {coordinator_ns, *island_ns.values()} - {""}
    if not namespaces:
        try:
            check_port(_HOST.value, _PORT.value, shards)
        except ValueError as e:
            sys.exit(str(e))
        if shards == 1:
            address = f"{_HOST.value}:{_PORT.value or _free_port(_HOST.value)}"
            return [address], [_DIAL.value or address], ""
        ports = [_PORT.value + k for k in range(shards)] if _PORT.value else _free_ports(_HOST.value, shards)
        listen = [f"{_HOST.value}:{p}" for p in ports]
        service = f"localhost:{_free_ports('localhost', 1, tuple(ports))[0]}"
        return listen, _DIAL.value.split(",") if _DIAL.value else listen, service
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
    if shards == 1:
        port = _PORT.value or _free_port_in(coordinator_ns, listen.strip("[]"))
        return [f"{listen}:{port}"], [f"{dial}:{port}"], ""
    ports = [_PORT.value + k for k in range(shards)] if _PORT.value else _free_ports_in(
        coordinator_ns, listen.strip("[]"), shards)
    service = f"localhost:{_free_ports_in(coordinator_ns, '127.0.0.1', 1, tuple(ports))[0]}"
    return [f"{listen}:{p}" for p in ports], [f"{dial}:{p}" for p in ports], service


def _checked(config, workdir: str, names: list[str], left: list[str]):
    """Everything that can refuse the launch, before anything is created or started: the arguments passed on
    to the roles and those absl `left` (none may be), the config, a finished workdir, a config other than the
    one the run started with, `--netns_*`, `--dial` and `--cpus`. Returns (coordinator namespace, island
    namespaces, cpus)."""
    from island_jax import config as config_lib
    from island_jax.cli import config_argv
    from island_jax.workdir import check_resume, refuse_finished

    try:
        config_arguments(config_argv(sys.argv, from_workdir=True))
    except ValueError as e:
        sys.exit(str(e))
    if left[1:]:
        sys.exit(f"unexpected argument {left[1]!r}: the launcher takes flags only (--config=PATH, --workdir=DIR, "
                 "--config.a.b=v, ...)")
    try:
        config_lib.validate(config)
        refuse_finished(workdir, config.outer.rounds)
        check_resume(config, workdir, _ALLOW_CONFIG_CHANGE.value)
    except (config_lib.ConfigError, FileExistsError) as e:
        sys.exit(str(e))
    if not config.outer.enabled:
        sys.exit("outer.enabled is False: a run without the outer loop has no coordinator; "
                 "run it in one process with experiments/train.py")
    from island_jax.cluster import coordinator_shards

    shards = coordinator_shards(config)
    coordinator_ns, island_ns = _placement(names)
    try:
        check_dial(_DIAL.value.strip(), _PORT.value, bool(coordinator_ns or any(island_ns.values())), shards)
    except ValueError as e:
        sys.exit(str(e))
    cpus = {}
    if _CPUS.value:
        if not hasattr(os, "sched_setaffinity"):
            sys.exit("--cpus needs Linux (sched_setaffinity); leave it out on this system")
        shard_roles = [f"coordinator/{k}" for k in range(shards)] if shards > 1 else []
        try:
            cpus = parse_cpus(_CPUS.value, ["coordinator", *shard_roles, *names], os.sched_getaffinity(0))
        except ValueError as e:
            sys.exit(str(e))
    return coordinator_ns, island_ns, cpus


def _roles(workdir: str, names: list[str], coordinator_ns: str, island_ns: dict, cpus: dict) -> list[Role]:
    """The coordinator (or its shards) and every island (`experiments/train.py --role=...`), from the flags."""
    from island_jax.cluster import coordinator_shards

    listen, dial, shard_service = _addresses(coordinator_ns, island_ns, coordinator_shards(_CONFIG.value))
    if not _TLS.value:  # refused here, before any role starts, as the coordinator would refuse it
        from island_jax.comm.security import SecurityError, check_exposure

        comm = _CONFIG.value.comm
        try:
            for address in listen:
                check_exposure(address, comm.tls, comm.auth.tokens_file, _INSECURE.value)
        except SecurityError as e:
            sys.exit(f"{e}; with this launcher, --tls makes them for the run")
    from island_jax.cli import config_argv

    overrides = config_arguments(config_argv(sys.argv, from_workdir=True))  # the config and its overrides
    if _ALLOW_CONFIG_CHANGE.value:
        overrides.append("--allow_config_change")
    secure = _secure(workdir, names, [*listen, *dial]) if _TLS.value else {}  # one set, valid for every shard
    coordinator = ["--role=coordinator", *(["--insecure"] if _INSECURE.value else []), *secure.get("coordinator", [])]
    return plan_roles(_CONFIG.value, workdir, listen, dial, overrides, coordinator, secure,
                      shard_service=shard_service, coordinator_ns=coordinator_ns, island_ns=island_ns, cpus=cpus)


def _island_port(ns: str) -> int:
    """A free port for the `jax.distributed` coordinator of an island of several processes, in namespace `ns`."""
    return _free_port_in(ns, "127.0.0.1") if ns else _free_port("localhost")


def plan_roles(config, workdir: str, listen: list[str], dial: list[str], overrides: list[str],
               coordinator: list[str], secure: dict[str, list[str]], *, shard_service: str = "",
               coordinator_ns: str = "", island_ns: dict[str, str] | None = None,
               cpus: dict[str, set[int]] | None = None, env: dict[str, str] | None = None,
               island_port: Callable[[str], int] = _island_port) -> list[Role]:
    """The roles of a run on this machine, in start order: the coordinator, then every island's processes.

    With one coordinator shard (`listen` of one address) the role is "coordinator"; with K, the roles
    "coordinator/0" .. "coordinator/K-1", each with `--shard=k`, the whole `--coordinator` list and
    `--shard_service`, in the group "coordinator" (they stop and restart together, as one). An island of
    several processes is "island NAME/I", each with `--process_id` and `--island_coordinator` on a free port
    (`island_port(namespace)`), in the group "island NAME". Every island gets the whole `dial` list.

    Args:
      config: the run's config (`islands.NAME.num_processes`).
      workdir: the run's folder.
      listen, dial: HOST:PORT of each shard, shard 0 first: where it listens, where islands dial it.
      overrides: `--config=PATH`, the overrides and what every role gets the same.
      coordinator: the coordinator's own arguments (`--role=coordinator`, `--insecure`, its credentials).
      secure: {island: its credential arguments} (`_secure`; {} without `--tls`).
      shard_service: HOST:PORT of the shards' `jax.distributed` service (K > 1 only).
      coordinator_ns, island_ns: network namespaces ("" or absent: this one).
      cpus: {role: CPUs} from `--cpus`: "coordinator" keeps every shard, "coordinator/K" one shard.
      env: every role's environment (default: this one's, unbuffered).
    """
    island_ns, cpus = island_ns or {}, cpus or {}
    if env is None:  # each role sets glibc malloc itself (island_jax/allocator.py)
        env = dict(os.environ, PYTHONUNBUFFERED="1")

    def role(name: str, ns: str, address: list[str], *args: str, pin: str = "", group: str = "") -> Role:
        netns = ["ip", "netns", "exec", ns] if ns else []
        command = netns + [sys.executable, "-u", str(TRAIN), f"--workdir={workdir}",
                           f"--coordinator={','.join(address)}", *overrides, *args]
        pinned = cpus.get(name) or cpus.get(pin)
        return Role(name, command, env, frozenset(pinned) if pinned else None, ns, group)

    if len(listen) == 1:
        roles = [role("coordinator", coordinator_ns, listen, *coordinator)]
    else:  # one jax.distributed job of CPU processes: its service on shard 0, in the coordinator's namespace
        roles = [role(f"coordinator/{k}", coordinator_ns, listen, *coordinator, f"--shard={k}",
                      f"--shard_service={shard_service}", pin="coordinator", group="coordinator")
                 for k in range(len(listen))]
    for n in config.islands:
        args = ["--role=island", f"--island={n}", *secure.get(n, [])]
        processes, ns = config.islands[n].num_processes, island_ns.get(n, coordinator_ns)
        if processes == 1:
            roles.append(role(f"island {n}", ns, dial, *args, pin=n))
            continue
        # one jax.distributed job: its coordinator on process 0, in the island's namespace
        port = island_port(ns)
        roles += [
            role(f"island {n}/{i}", ns, dial, *args, f"--process_id={i}",
                 f"--island_coordinator=localhost:{port}", pin=n, group=f"island {n}")
            for i in range(processes)
        ]
    return roles


def _secure(workdir: str, names: list[str], addresses: list[str]) -> dict[str, list[str]]:
    """`--tls`: the run's certificates and tokens (`security.make_run_credentials`, in WORKDIR/secrets), as
    the config overrides of each role: {"coordinator": [...], island: [...]}."""
    from island_jax.comm import security

    hosts = sorted({a.rsplit(":", 1)[0].strip("[]") for a in addresses})
    made = security.make_run_credentials(os.path.join(os.path.abspath(workdir), "secrets"), names, hosts)
    tls = [f"--config.comm.tls.ca_file={made['ca_file']}",  # mutual TLS: every role has the client certificate
           f"--config.comm.tls.client_cert_file={made['client_cert_file']}",
           f"--config.comm.tls.client_key_file={made['client_key_file']}"]
    roles = {"coordinator": [*tls, f"--config.comm.tls.cert_file={made['cert_file']}",
                             "--config.comm.tls.require_client_cert=True",
                             f"--config.comm.tls.key_file={made['key_file']}",
                             f"--config.comm.auth.tokens_file={made['tokens_file']}"]}
    for n in names:
        roles[n] = [*tls, f"--config.comm.auth.token_file={made['token_files'][n]}"]
    return roles


def resumed_progress(workdir: str, names: list[str], rounds: int):
    """The run's `Progress`, past the rounds its islands logged before this start, and the line that says so.

    A resumed run's round lines were printed by the start that trained them; they are skipped, not printed
    again, and the ETA counts from this start's rounds. Returns (progress, line): line is None for a new run,
    else "resuming the run in WORKDIR: rounds A-B were logged by an earlier start; ...".
    """
    from island_jax.progress import Eta, Progress

    progress = Progress(workdir, names, rounds)
    replayed = progress.poll()
    if not replayed:
        return progress, None
    progress.eta = Eta(rounds)
    first, last = progress.next_round - len(replayed), progress.next_round - 1
    span = f"round {last} was" if first == last else f"rounds {first}-{last} were"
    return progress, (f"resuming the run in {workdir}: {span} logged by an earlier start; their lines are not "
                      "printed again (each island's metrics.jsonl holds them)")


def main(argv):
    from island_jax.workdir import RunFailed, check_finished, combine_summaries, done_line

    config, workdir = _CONFIG.value, _WORKDIR.value
    names = list(config.islands.keys())
    coordinator_ns, island_ns, cpus = _checked(config, workdir, names, argv)
    roles = _roles(workdir, names, coordinator_ns, island_ns, cpus)
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    progress, resuming = resumed_progress(workdir, names, config.outer.rounds)
    if resuming:
        print(f"[launch] {resuming}", flush=True)

    def stop(signum, frame):  # SIGTERM as Ctrl-C: every role is stopped and finishes its checkpoint in progress
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, stop)
    failed = Supervisor(roles, _RESTART.value, grace=_STOP_GRACE.value).run(progress.poll)
    if failed is not None:
        sys.exit(failed[1] if failed[1] > 0 else 1)
    summary = combine_summaries(config, workdir, time.perf_counter() - start)
    print(f"[launch] {done_line(config, workdir, summary)}", flush=True)
    try:
        check_finished(summary)
    except RunFailed as e:
        print(f"[launch] {e}", flush=True)  # the last line
        sys.exit(1)


if __name__ == "__main__":
    from island_jax.cli import parse_run_flags

    app.run(main, flags_parser=parse_run_flags)
