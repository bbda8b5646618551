"""Where each role of a run goes: a cluster description (a YAML file, `--cluster=FILE`), checked against the config.

The launchers in `launch/` render a run's job scripts or manifests from its config (with overrides), its workdir
and this description: per role, the scheduler that starts it and on what (every field: docs/launch.md).

    coordinator: {scheduler: slurm, addresses: ["login1:50051"], partition: cpu}   # slurm | tpu_vm | k8s | local
    islands:
      a: {scheduler: slurm, nodes: 2, devices_per_node: 4, partition: gpu, account: proj}
      b: {scheduler: tpu_vm, tpu: my-v5e, zone: us-west4-a, accelerator_type: v5litepod-16}
    python: python3                 # the interpreter on the nodes, with island_jax installed
    repo: /shared/island_jax        # the checkout on the nodes (commands run there)

One process per node: an island's `nodes` (x `devices_per_node`) must be its `num_processes` (`num_devices`), and
a TPU slice's `accelerator_type` must give both; else a `ClusterError` names the field. Credentials go by path only.

A coordinator of K shards (`coordinator.shards` of the config) has K `addresses`, shard 0 first: where shard k
listens (its port) and islands reach it. Its `nodes` is 1 (every shard on one host, each at its own port) or K
(shard k on host k; under tpu_vm a list of K `vm` names); shard 0's host runs the shards' `jax.distributed`
service at `coordinator.shard_port`. `role_command` writes a shard's `--shard`, `--shard_service` and the
`--coordinator` list, and every island gets the whole list; with K = 1 every command is as it was.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from typing import Any, Mapping, Sequence

from island_jax.hardware import tpu_slice

SCHEDULERS = ("slurm", "tpu_vm", "k8s", "local")

# Fields every role may have, then those of each scheduler; anything else is refused (a typo costs a queue wait).
_COMMON = {"scheduler", "nodes", "devices_per_node", "env", "token_file"}
_COORDINATOR = {"addresses", "cert_file", "key_file", "tokens_file", "server_name", "insecure", "shard_port"}
_FIELDS = {
    "slurm": {"partition", "account", "time", "cluster", "gres", "cpus_per_task", "qos", "exclusive", "mem",
              "extra_sbatch"},
    "tpu_vm": {"zone", "project", "ssh_flags"},  # and, by role, those of _TPU_VM
    "k8s": {"namespace", "image", "service_type", "storage", "storage_class", "resource", "node_selector"},
    "local": set(),
}
_TPU_VM = {"coordinator": {"vm"}, "island": {"tpu", "accelerator_type"}}  # a CPU VM; a TPU slice
_TOP = {"coordinator", "islands", "tls", "python", "repo", "island_port"}
_TLS = ("ca_file", "client_cert_file", "client_key_file")
SHARD_PORT = 8477  # default `coordinator.shard_port`: the shards' jax.distributed service, on shard 0's host


def coordinator_shards(config) -> int:
    """K, the processes the coordinator is cut into (`coordinator.shards`); 1 for a config recorded before the
    `coordinator` section existed."""
    return int(config.coordinator.shards) if "coordinator" in config else 1


class ClusterError(ValueError):
    """A cluster description that cannot launch the config: the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one role runs.

    Attributes:
      role: "coordinator" or the island's name.
      scheduler: one of `SCHEDULERS`.
      nodes: hosts (one process each); an island's `num_processes`.
      devices_per_node: accelerator (or virtual CPU) devices each process uses; 0 for the coordinator.
      fields: the scheduler's own fields as given (partition, zone, image, ...).
      env: environment variables set for the role's processes.
      token_file: an island's bearer-token file on its nodes ("" for none).
    """

    role: str
    scheduler: str
    nodes: int
    devices_per_node: int
    fields: Mapping[str, Any]
    env: Mapping[str, str]
    token_file: str = ""

    def get(self, key: str, default: Any = "") -> Any:
        return self.fields.get(key, default)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A checked cluster description (`load`).

    Attributes:
      coordinator: its placement; `addresses` (HOST:PORT, one per coordinator shard) in `coordinator.fields`;
        `nodes` 1 (every shard on one host) or the shards' count (one per host); under tpu_vm `vm` holds the
        list of those hosts' names.
      islands: {name: placement}, in the config's island order.
      tls: {ca_file, client_cert_file, client_key_file}: paths on the nodes, or {} for none.
      python: the interpreter on the nodes.
      repo: the checkout on the nodes, where commands run.
      island_port: the port of each multi-process island's `jax.distributed` coordinator, on its process 0's host.
    """

    coordinator: Placement
    islands: dict[str, Placement]
    tls: Mapping[str, str]
    python: str = "python3"
    repo: str = "."
    island_port: int = 8476

    @property
    def addresses(self) -> list[str]:
        """Where islands reach the coordinator: HOST:PORT, one per coordinator shard, shard 0 first."""
        return list(self.coordinator.get("addresses", []))

    @property
    def shards(self) -> int:
        """The coordinator's processes (`coordinator.shards` of the config): one per address."""
        return len(self.addresses)

    @property
    def ports(self) -> list[int]:
        """Each shard's port, where it listens (on every address of its host) and islands dial it."""
        return [int(a.rsplit(":", 1)[1]) for a in self.addresses]

    @property
    def listen(self) -> list[str]:
        """Where each shard listens: 0.0.0.0:PORT of its address (the `--coordinator` list of every shard)."""
        return [f"0.0.0.0:{p}" for p in self.ports]

    @property
    def shard_port(self) -> int:
        """The port of the shards' `jax.distributed` service on shard 0's host (`coordinator.shard_port`)."""
        return int(self.coordinator.get("shard_port", SHARD_PORT))

    @property
    def vms(self) -> list[str]:
        """The coordinator's CPU VMs under tpu_vm (`coordinator.vm`, one name or one per shard)."""
        vm = self.coordinator.get("vm", "")
        return list(vm) if isinstance(vm, list) else [vm]

    @property
    def host(self) -> str:
        """The host of shard 0's address, `addresses[0]` ("auto" when the coordinator's SLURM job resolves it; IPv6 unbracketed)."""
        return self.addresses[0].rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        """Shard 0's port (the coordinator's, with one shard): where it listens (on every address of its node)
        and islands dial it."""
        return int(self.addresses[0].rsplit(":", 1)[1])

    @property
    def server_name(self) -> str:
        """The name islands check the coordinator's certificate for: `coordinator.server_name`, or "" for the
        host they dial."""
        return str(self.coordinator.get("server_name", ""))

    def placements(self) -> list[Placement]:
        return [self.coordinator, *self.islands.values()]


def tpu_topology(accelerator_type: str) -> tuple[int, int]:
    """(JAX devices, hosts) of a Cloud TPU slice type (`hardware.tpu_slice`): "v4-16" -> (8, 2); "v5p-8" -> (4, 1);
    "v5litepod-16" -> (16, 4); "v6e-8" -> (8, 1).

    Raises:
      ClusterError: a type not of these generations, or a size that is not a whole number of chips.
    """
    try:
        tpu = tpu_slice(accelerator_type)
    except ValueError as e:
        raise ClusterError(str(e)) from None
    return tpu.devices, tpu.hosts


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ClusterError(message)


def _positive_int(value: Any, field: str) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"{field} is {value!r}; give a whole number of at least 1")
    return value


def _placement(role: str, raw: Any, field: str, defaults: Mapping[str, Any]) -> Placement:
    _require(isinstance(raw, dict), f"{field} is {raw!r}; give a mapping with at least `scheduler`")
    scheduler = raw.get("scheduler", defaults.get("scheduler"))
    _require(scheduler in SCHEDULERS, f"{field}.scheduler is {scheduler!r}; use one of {', '.join(SCHEDULERS)}")
    kind = "coordinator" if role == "coordinator" else "island"
    allowed = _COMMON | _FIELDS[scheduler] | (_COORDINATOR if kind == "coordinator" else set())
    if scheduler == "tpu_vm":  # the slice's type sets an island's hosts and devices
        allowed = (allowed - {"nodes", "devices_per_node"}) | _TPU_VM[kind]
    unknown = sorted(set(raw) - allowed)
    _require(not unknown, f"{field} has {', '.join(unknown)}, which scheduler {scheduler} does not take here; its "
                          f"fields are {', '.join(sorted(allowed))}")
    env = raw.get("env", {}) or {}
    _require(isinstance(env, dict) and all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                           for k in env),
             f"{field}.env is {env!r}; give a mapping of environment variable names ([A-Za-z_][A-Za-z0-9_]*) to values")
    flags_ = raw.get("ssh_flags", [])
    _require(isinstance(flags_, list) and all(isinstance(f, str) for f in flags_),
             f"{field}.ssh_flags is {flags_!r}; give a list of gcloud flags, e.g. [--internal-ip]")
    if scheduler == "tpu_vm" and kind == "coordinator":
        for key in ("vm", "zone"):
            _require(raw.get(key), f"{field}.{key} is missing; give the coordinator's CPU VM "
                                   f"{'name' if key == 'vm' else key}")
        vm = raw["vm"]
        _require(isinstance(vm, str) or (isinstance(vm, list) and all(isinstance(v, str) and v for v in vm)),
                 f"{field}.vm is {vm!r}; give the CPU VM's name, or a list of names, one per coordinator shard")
    for key in ("token_file", "cert_file", "key_file", "tokens_file"):
        _require(isinstance(raw.get(key, ""), str), f"{field}.{key} is {raw.get(key)!r}; give a path on the nodes")
    _require(all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in env.values()),
             f"{field}.env is {env!r}; give each variable a string or number")
    for key in ("partition", "account", "time", "qos", "gres", "mem", "cluster", "zone", "project", "tpu",
                "accelerator_type", "namespace", "image", "server_name"):
        _require(isinstance(raw.get(key, ""), str),
                 f"{field}.{key} is {raw.get(key)!r} ({type(raw.get(key)).__name__}); give a string"
                 + ("; quote a time such as \"24:00:00\" (YAML reads it as a number of seconds)" if key == "time"
                    else ""))
    extra = raw.get("extra_sbatch", [])
    _require(isinstance(extra, list) and all(isinstance(x, str) for x in extra),
             f"{field}.extra_sbatch is {extra!r}; give a list of sbatch options, e.g. [--constraint=h100]")
    for key in ("exclusive", "insecure"):
        _require(isinstance(raw.get(key, False), bool), f"{field}.{key} is {raw.get(key)!r}; give true or false")
    shard_port = raw.get("shard_port", SHARD_PORT)
    _require(isinstance(shard_port, int) and not isinstance(shard_port, bool) and 0 < shard_port < 65536,
             f"{field}.shard_port is {shard_port!r}; give a port from 1 to 65535")
    fields = {k: v for k, v in raw.items() if k not in _COMMON}
    per_node = raw.get("devices_per_node", 0)
    if per_node != 0:
        _positive_int(per_node, f"{field}.devices_per_node")
    return Placement(role, scheduler, _positive_int(raw.get("nodes", 1), f"{field}.nodes"), per_node, fields,
                     {k: str(v) for k, v in env.items()}, raw.get("token_file", ""))


def _check_island(config, name: str, p: Placement) -> Placement:
    """The island's hosts and devices against `islands.NAME` of the config; fills devices_per_node."""
    isl = config.islands[name]
    field = f"islands.{name}"
    if p.scheduler == "tpu_vm":
        _require(p.get("accelerator_type"), f"{field}.accelerator_type is missing; give the TPU slice's type "
                                            "(e.g. v5litepod-16), from which its hosts and chips follow")
        devices, hosts = tpu_topology(p.get("accelerator_type"))
        _require(isl.num_devices == devices,
                 f"islands.{name}.num_devices is {isl.num_devices} but {field}.accelerator_type "
                 f"{p.get('accelerator_type')} has {devices} devices (chips); set --config.islands.{name}.num_devices="
                 f"{devices} with a mesh of that size, or choose a slice of {isl.num_devices} chips")
        _require(isl.num_processes == hosts,
                 f"islands.{name}.num_processes is {isl.num_processes} but {field}.accelerator_type "
                 f"{p.get('accelerator_type')} has {hosts} host(s), one process each; set "
                 f"--config.islands.{name}.num_processes={hosts}")
        generation = "tpu-" + re.match(r"v\d+[a-z]*", p.get("accelerator_type")).group().replace("litepod", "e")
        _require(isl.hardware == generation,
                 f"islands.{name}.hardware is {isl.hardware!r} but {field}.accelerator_type {p.get('accelerator_type')} "
                 f"is a {generation} slice; set --config.islands.{name}.hardware={generation}")
        for key in ("tpu", "zone"):
            _require(p.get(key), f"{field}.{key} is missing; give the TPU VM's {'name' if key == 'tpu' else key}")
        return dataclasses.replace(p, nodes=hosts, devices_per_node=devices // hosts)
    from island_jax import hardware as hardware_lib

    _require(p.scheduler == "k8s" or hardware_lib.kind(isl.hardware) != "tpu",
             f"islands.{name}.hardware is {isl.hardware} but {field}.scheduler is {p.scheduler}; TPU slices are "
             "started with scheduler: tpu_vm (or k8s)")
    per_node = p.devices_per_node or isl.num_devices // max(1, p.nodes)
    _require(p.nodes == isl.num_processes,
             f"{field}.nodes is {p.nodes} but islands.{name}.num_processes is {isl.num_processes}; one process runs "
             f"per node, so set --config.islands.{name}.num_processes={p.nodes} or nodes: {isl.num_processes}")
    _require(per_node * p.nodes == isl.num_devices,
             f"{field}: {p.nodes} node(s) x devices_per_node {per_node} = {per_node * p.nodes} devices, but "
             f"islands.{name}.num_devices is {isl.num_devices}; set --config.islands.{name}.num_devices="
             f"{per_node * p.nodes} (and its mesh) or devices_per_node: {isl.num_devices // p.nodes}")
    dpp = isl.get("devices_per_process", 0)
    _require(not dpp or dpp == per_node,
             f"islands.{name}.devices_per_process is {dpp} but {field}.devices_per_node is {per_node}; make them equal")
    return dataclasses.replace(p, devices_per_node=per_node)


def check(config, raw: Mapping[str, Any]) -> Cluster:
    """A parsed description (`raw`, e.g. from YAML) checked against the run's `config`.

    Raises:
      ClusterError: naming the first wrong field: an unknown key or scheduler, an island missing from one side,
        hosts or devices that do not match the island's `num_processes`/`num_devices`, a TPU type whose chips or
        hosts do not, a missing coordinator address (or a number of them other than `coordinator.shards`), or a
        field its scheduler needs.
    """
    from island_jax import config as config_lib

    _require(isinstance(raw, dict), "the cluster description is not a mapping; see island_jax/cluster.py's docstring")
    unknown = sorted(set(raw) - _TOP)
    _require(not unknown, f"the cluster description has {', '.join(unknown)}; its sections are {', '.join(sorted(_TOP))}")
    try:
        config_lib.validate(config)
    except config_lib.ConfigError as e:
        raise ClusterError(str(e)) from None
    coordinator = _placement("coordinator", raw.get("coordinator"), "coordinator", {})
    addresses = coordinator.get("addresses", [])
    if isinstance(addresses, str):
        addresses = [addresses]
    _require(isinstance(addresses, list) and len(addresses) >= 1,
             "coordinator.addresses is missing; give [HOST:PORT] where islands reach the coordinator (HOST may be "
             "'auto' under slurm when the coordinator runs in the islands' job)")
    shards = coordinator_shards(config)
    _require(len(addresses) == shards,
             f"coordinator.addresses lists {len(addresses)} address{'es' if len(addresses) > 1 else ''} but "
             f"coordinator.shards is {shards}; give one HOST:PORT per coordinator shard, shard 0 first, or set "
             f"--config.coordinator.shards={len(addresses)}")
    for a in addresses:
        host, _, port = str(a).rpartition(":")
        _require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                 f"coordinator.addresses has {a!r}; give HOST:PORT with a port from 1 to 65535")
    coordinator = _check_shards(coordinator, [str(a) for a in addresses], shards)

    raw_islands = raw.get("islands") or {}
    _require(isinstance(raw_islands, dict), "islands is not a mapping of island names to placements")
    names = list(config.islands)
    missing = [n for n in names if n not in raw_islands]
    _require(not missing, f"islands.{missing[0] if missing else ''} is missing from the cluster description; place "
                          f"every island of the config ({', '.join(names)})")
    extra = [n for n in raw_islands if n not in config.islands]
    _require(not extra, f"islands.{extra[0] if extra else ''} is not an island of the config ({', '.join(names)})")
    islands = {n: _check_island(config, n, _placement(n, raw_islands[n], f"islands.{n}", {})) for n in names}
    for field, p in [("coordinator", coordinator), *((f"islands.{n}", q) for n, q in islands.items())]:
        _require(p.scheduler != "k8s" or p.get("image"),
                 f"{field}.image is missing; give the container image with island_jax installed")
    tls = raw.get("tls") or {}
    _require(isinstance(tls, dict) and set(tls) <= set(_TLS) and all(isinstance(v, str) for v in tls.values()),
             f"tls is {tls!r}; give paths for {', '.join(_TLS)}")
    for key in ("python", "repo"):
        _require(isinstance(raw.get(key, "x"), str) and raw.get(key, "x"), f"{key} is {raw.get(key)!r}; give a path")
    port = raw.get("island_port", 8476)
    _require(isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536,
             f"island_port is {port!r}; give a port from 1 to 65535")
    if coordinator.scheduler != "slurm" or any(i.scheduler != "slurm" for i in islands.values()):
        _require(not any(a.startswith("auto:") for a in addresses),
                 "coordinator.addresses uses 'auto', which only a coordinator in the islands' own SLURM job can "
                 "resolve; give the coordinator's reachable HOST:PORT")
    _check_credentials(coordinator, islands, tls, str(addresses[0]))
    return Cluster(coordinator, islands, dict(tls), raw.get("python", "python3"), raw.get("repo", "."), port)


def _check_shards(coordinator: Placement, addresses: list[str], shards: int) -> Placement:
    """The coordinator's hosts against `coordinator.shards` (K, as many as `addresses`): `nodes` 1 or K (under
    tpu_vm, one `vm` or K); every address `auto:PORT` or none; distinct ports on a shared host.
    Returns the placement with `addresses` as strings and `nodes` set."""
    nodes = coordinator.nodes
    if coordinator.scheduler == "tpu_vm":
        vm = coordinator.get("vm")
        nodes = len(vm) if isinstance(vm, list) else 1
        _require(nodes in (1, shards), f"coordinator.vm lists {nodes} VMs but coordinator.shards is {shards}; give "
                                       f"one VM (every shard on it) or {shards}, one per shard")
    elif shards == 1:
        _require(nodes == 1, f"coordinator.nodes is {nodes}; the coordinator is one process")
    else:
        _require(nodes in (1, shards), f"coordinator.nodes is {nodes} but coordinator.shards is {shards}; give 1 "
                                       f"(every shard on one host) or {shards} (one shard per host)")
    if shards > 1:
        auto = [a.startswith("auto:") for a in addresses]
        _require(all(auto) or not any(auto), f"coordinator.addresses mixes auto:PORT and HOST:PORT ({', '.join(addresses)}); "
                                             "give every shard's address the same way")
        ports = [a.rsplit(":", 1)[1] for a in addresses]
        repeated = next((p for p in ports if ports.count(p) > 1), None)
        _require(nodes > 1 or coordinator.scheduler == "k8s" or repeated is None,
                 f"coordinator.addresses repeats port {repeated}, but the {shards} shards share one host "
                 f"(coordinator.{'vm' if coordinator.scheduler == 'tpu_vm' else 'nodes'}); give each shard a port of "
                 "its own")
    return dataclasses.replace(coordinator, nodes=nodes, fields={**coordinator.fields, "addresses": addresses})


def _check_credentials(coordinator: Placement, islands: Mapping[str, Placement], tls: Mapping[str, str],
                       address: str) -> None:
    """A coordinator started by a cluster launcher listens on every address of its node, so it needs TLS and
    per-island tokens (`security.check_exposure`), or `insecure: true`; the files must come in usable sets."""
    pairs = [("coordinator.cert_file", coordinator.get("cert_file"), "coordinator.key_file", coordinator.get("key_file")),
             ("tls.client_cert_file", tls.get("client_cert_file"), "tls.client_key_file", tls.get("client_key_file"))]
    for a, a_set, b, b_set in pairs:
        _require(bool(a_set) == bool(b_set), f"{a if not a_set else b} is missing: {a} and {b} go together")
    if coordinator.get("cert_file"):
        _require(tls.get("ca_file"), "tls.ca_file is missing: the coordinator serves TLS, and the islands need the CA "
                                     "that signed its certificate")
    if tls.get("client_cert_file"):
        _require(tls.get("ca_file"), "tls.ca_file is missing: mutual TLS (tls.client_cert_file) needs the CA")
    if coordinator.get("tokens_file"):
        for name, p in islands.items():
            _require(p.token_file, f"islands.{name}.token_file is missing: the coordinator checks tokens "
                                   "(coordinator.tokens_file); give the island's token file")
    secured = bool(coordinator.get("cert_file")) and bool(coordinator.get("tokens_file"))
    if coordinator.scheduler != "local" and not secured:
        _require(coordinator.get("insecure", False),
                 "coordinator.cert_file, key_file and tokens_file are missing: a coordinator on a cluster listens on "
                 "every address of its node, which needs TLS and per-island tokens (docs/security.md; "
                 "security.make_run_credentials makes them); or set coordinator.insecure: true to listen in the clear")
    if address.startswith("auto:") and tls.get("ca_file"):
        _require(coordinator.get("server_name"),
                 "coordinator.server_name is missing: with addresses auto:PORT the islands dial whichever node the "
                 "coordinator gets, so give the name its certificate holds (islands check it for that name)")


def load(path: str, config) -> Cluster:
    """The cluster description in the YAML file `path`, checked against `config` (`check`).

    Raises:
      ClusterError: a missing or unreadable file, YAML that does not parse, or any error of `check`.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ClusterError(f"--cluster={path}: no such file; write the cluster description there "
                           "(docs/launch.md shows one)") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"--cluster={path} is not valid YAML: {e}") from None
    try:
        return check(config, raw)
    except ClusterError as e:
        raise ClusterError(f"--cluster={path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Command:
    """One process's command line, with the parts only its node knows left as shell expressions.

    `args` are literal; `expansions` are (flag, shell expression) pairs, e.g. ("--process_id", "$SLURM_PROCID"),
    which `shell` renders inside double quotes so that the node's shell expands them.
    """

    args: tuple[str, ...]
    expansions: tuple[tuple[str, str], ...] = ()

    def shell(self, substitute: Mapping[str, str] | None = None) -> str:
        """The command as one line of POSIX shell, each expansion `FLAG="EXPR"` for the node's shell, or
        `substitute[EXPR]` (quoted as a literal) where given."""
        substitute = substitute or {}
        return " ".join([*(shlex.quote(a) for a in self.args),
                         *(shlex.quote(f"{flag}={substitute[expr]}") if expr in substitute else f'{flag}="{expr}"'
                           for flag, expr in self.expansions)])

    def argv(self, substitute: Mapping[str, str] | None = None) -> list[str]:
        """The command as an argument list, each expansion written `FLAG=EXPR` (Kubernetes expands `$(VAR)`
        in container args itself), or `substitute[EXPR]` where given."""
        return [*self.args, *(f"{flag}={(substitute or {}).get(expr, expr)}" for flag, expr in self.expansions)]


def config_args(argv: Sequence[str]) -> list[str]:
    """The `--config` and `--config.a.b=v` items of a launcher's command line, which every role gets the same:
    each as one `--flag=value` item (`--config FILE` and `--config.a.b VALUE` joined), in their order."""
    found, k = [], 0
    while k < len(argv):
        arg = argv[k]
        k += 1
        if arg != "--config" and not arg.startswith(("--config=", "--config.")):
            continue
        if "=" not in arg and k < len(argv) and (arg == "--config" or not argv[k].startswith("-")):
            arg = f"{arg}={argv[k]}"
            k += 1
        found.append(arg)
    return found


def role_command(cluster: Cluster, role: str, config_args_: Sequence[str], workdir: str,
                 coordinator: str | Sequence[str], *, process_id: str | None = None,
                 island_coordinator: str | None = None, credentials: Mapping[str, str] | None = None,
                 server_name: str | None = None, shard: str | None = None,
                 shard_service: str | None = None) -> Command:
    """The `experiments/train.py` command of one process of `role` ("coordinator" or an island's name).

    Args:
      cluster: the description (interpreter, TLS paths, token files).
      role: "coordinator" or an island's name.
      config_args_: `config_args(...)`, the same for every role.
      workdir: the run's folder as the nodes see it.
      coordinator: HOST:PORT where the coordinator listens (its own command) or where islands reach it; may hold
        a shell expression such as `$IJ_COORDINATOR`. With coordinator shards, every shard's, shard 0 first (a
        list, or one comma-separated string), for the shards and the islands alike.
      process_id, island_coordinator: for a process of an island of several: shell expressions (or literals)
        of its index and of its process 0's HOST:PORT.
      credentials: paths to use instead of the description's (k8s mounts them elsewhere): keys of `tls` and
        `cert_file`, `key_file`, `tokens_file`, `token_file`.
      server_name: for an island, the name to check the coordinator's certificate for, instead of
        `cluster.server_name` ("" and no `server_name` field: the host dialled).
      shard, shard_service: for a shard of a coordinator of several: shell expressions (or literals) of its
        index (`--shard`) and of the HOST:PORT of the shards' `jax.distributed` service (`--shard_service`).

    Returns:
      A `Command`; literal parts in `args`, node-side expressions in `expansions`.
    """
    paths = {**cluster.tls, "cert_file": cluster.coordinator.get("cert_file"),
             "key_file": cluster.coordinator.get("key_file"), "tokens_file": cluster.coordinator.get("tokens_file"),
             "token_file": cluster.islands[role].token_file if role in cluster.islands else ""}
    paths.update(credentials or {})
    args = [cluster.python, "-u", "experiments/train.py", *config_args_, f"--workdir={workdir}"]
    tls = [f"--config.comm.tls.{k}={paths[k]}" for k in _TLS if paths.get(k)
           and (role != "coordinator" or k == "ca_file")]  # the client certificate is the islands'
    if role != "coordinator" and (server_name or cluster.server_name) and paths.get("ca_file"):
        tls.append(f"--config.comm.tls.server_name={server_name or cluster.server_name}")
    expansions = []
    coordinator = coordinator if isinstance(coordinator, str) else ",".join(coordinator)
    address = [("--coordinator", coordinator)] if "$" in coordinator else []
    if not address:
        args.append(f"--coordinator={coordinator}")
    if role == "coordinator":
        args += ["--role=coordinator", *tls, *(["--insecure"] if cluster.coordinator.get("insecure") else [])]
        if paths.get("cert_file"):
            args += [f"--config.comm.tls.cert_file={paths['cert_file']}", f"--config.comm.tls.key_file={paths['key_file']}",
                     *(["--config.comm.tls.require_client_cert=True"] if paths.get("client_cert_file") else [])]
        if paths.get("tokens_file"):
            args.append(f"--config.comm.auth.tokens_file={paths['tokens_file']}")
    else:
        args += ["--role=island", f"--island={role}", *tls]
        if paths.get("token_file"):
            args.append(f"--config.comm.auth.token_file={paths['token_file']}")
    expansions += address
    for flag, value in (("--shard", shard), ("--shard_service", shard_service), ("--process_id", process_id),
                        ("--island_coordinator", island_coordinator)):
        if value is None:
            continue
        if "$" in str(value):
            expansions.append((flag, str(value)))
        else:
            args.append(f"{flag}={value}")
    return Command(tuple(args), tuple(expansions))


def shared_path(path: str, repo: str) -> str:
    """`path` as the nodes see it: absolute paths as given, relative ones under the checkout `repo`."""
    return path if os.path.isabs(path) else os.path.join(repo, path)


def define_flags(tool: str, tool_help: str, workdir_help: str, dry_run_help: str) -> dict:
    """Defines the flags of a cluster launcher (launch/slurm.py, tpu_vm.py, k8s.py) and returns their holders:
    {"config", "cluster", "workdir", "dry_run", tool}. Launchers call it only when run as a script, so that tests
    can import several launchers, which share these flag names, into one process."""
    from absl import flags
    from ml_collections import config_flags

    held = dict(
        config=config_flags.DEFINE_config_file("config", None, "Path to an experiment config (a get_config() file).",
                                               lock_config=True),
        cluster=flags.DEFINE_string("cluster", None, "The cluster description, a YAML file (island_jax/cluster.py)."),
        workdir=flags.DEFINE_string("workdir", None, workdir_help),
        dry_run=flags.DEFINE_bool("dry_run", False, dry_run_help),
    )
    held[tool] = flags.DEFINE_string(tool, tool, tool_help)
    flags.mark_flags_as_required(["config", "cluster", "workdir"])
    return held


def check_workdir(workdir: str) -> None:
    """A cluster launch's workdir is the same path on every node (a shared filesystem), so it must be absolute.

    Raises:
      ClusterError: a relative `workdir`.
    """
    if not os.path.isabs(workdir):
        raise ClusterError(f"--workdir={workdir}: give an absolute path, the same on every node (a shared "
                           "filesystem), e.g. /shared/runs/NAME")


def summarize_command(cluster: Cluster, config_args_: Sequence[str], workdir: str) -> Command:
    """`launch/summarize.py`, which writes the run's summary.json once every role's folder is in `workdir`."""
    return Command((cluster.python, "-u", "launch/summarize.py", *config_args_, f"--workdir={workdir}"))


def from_flags(held: Mapping[str, Any], argv: Sequence[str]) -> tuple[Any, Cluster, list[str], str]:
    """A launcher's inputs from its flags (`define_flags`) and command line: (config, the checked description, the
    `--config` items every role gets, workdir).

    Raises:
      ClusterError: a relative workdir, or a description that cannot launch the config (`load`).
    """
    config, workdir = held["config"].value, held["workdir"].value
    check_workdir(workdir)
    return config, load(held["cluster"].value, config), config_args(argv), workdir


def write_launch_file(workdir: str, name: str, text: str) -> str:
    """Writes `text` to WORKDIR/launch/NAME (the folder made if needed) and returns its path: what a launcher
    renders is kept beside the run it started."""
    path = os.path.join(workdir, "launch", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
