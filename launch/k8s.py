"""Renders (and applies) the Kubernetes manifests of a run from its config and a cluster description.

  python launch/k8s.py --config=experiments/configs/two_islands.py --cluster=cluster.yaml \
      --workdir=/runs/two_islands --dry_run

prints the manifests as one multi-document YAML; without `--dry_run` it writes them to WORKDIR/launch/k8s.yaml
and runs `kubectl apply -f` on that file (`--kubectl=CMD` names another command or a wrapper). Only the roles
with `scheduler: k8s` in the description (island_jax/cluster.py) are rendered; the file's header names the
roles placed elsewhere, which their own launcher starts. All `k8s` roles of one description are taken to be in
one Kubernetes cluster, the one `kubectl` talks to (each in its own `namespace`, default "default").

What is rendered, names prefixed `ij-RUN` (RUN: the workdir's last folder, in lowercase letters, digits, '-'),
every object labelled `app.kubernetes.io/name: island-jax`, `app.kubernetes.io/instance: RUN` and
`app.kubernetes.io/component: coordinator|island` (islands also `island-jax/island: NAME`):

* The coordinator: a StatefulSet of 1 replica (`ij-RUN-coordinator`) listening on `0.0.0.0:PORT` (PORT from
  `coordinator.addresses`), its workdir on a PersistentVolumeClaim from `volumeClaimTemplates` (`storage`,
  default 10Gi; `storage_class`, default the cluster's); a Service `ij-RUN-coordinator` for the gRPC port (type
  `service_type`: ClusterIP by default, LoadBalancer or NodePort when islands outside the cluster dial it); and
  the headless Service `ij-RUN-coordinator-pods` the StatefulSet names. Islands in the cluster dial the Service
  (`ij-RUN-coordinator.NAMESPACE.svc.cluster.local:PORT`) and check the coordinator's certificate for the host of
  `coordinator.addresses` (`comm.tls.server_name`); islands elsewhere dial that address, which must lead to the
  Service (its load balancer's address, a NodePort, an ingress).
* A coordinator of K shards (`coordinator.shards`, K `addresses`): an Indexed Job `ij-RUN-coordinator` of K
  pods instead (completions = parallelism = K, `backoffLimit: 0`, `restartPolicy: Never`, as an island's, so
  the shards fail and restart together), shard `--shard=$(JOB_COMPLETION_INDEX)`, every pod listening on PORT
  (of `addresses[0]`), in the subdomain of the headless Service `ij-RUN-coordinator-pods`, so that every shard
  finds shard 0's `jax.distributed` service at
  `ij-RUN-coordinator-0.ij-RUN-coordinator-pods.NAMESPACE.svc.cluster.local:SHARD_PORT` (`--shard_service`,
  `coordinator.shard_port`); one Service `ij-RUN-coordinator-k` per shard (type `service_type`, the port of
  `addresses[k]`, selecting the pod by its `batch.kubernetes.io/job-completion-index` label: Kubernetes 1.28
  or later), which islands in the cluster dial, one name checked for all (`server_name`, or the addresses' one
  host); and one ReadWriteMany claim `ij-RUN-coordinator-workdir` (shard k writes inside shard 0's folder).
* Each island: an Indexed Job (`ij-RUN-island-NAME`, completions = parallelism = `nodes`, one process per
  pod with `--process_id=$(JOB_COMPLETION_INDEX)`), its pods in the subdomain of a headless Service of the
  same name, so that an island of several processes finds its process 0 at
  `ij-RUN-island-NAME-0.ij-RUN-island-NAME.NAMESPACE.svc.cluster.local:ISLAND_PORT` (`--island_coordinator`, for
  `jax.distributed`); `resource` (default nvidia.com/gpu for GPUs, google.com/tpu for TPUs) x
  `devices_per_node` in its container's limits, nothing for CPU islands; its workdir on a PersistentVolumeClaim
  `ij-RUN-island-NAME-workdir` (ReadWriteMany when it has several pods: orbax writes every process's shards into
  one folder, so the storage class must offer shared volumes). `backoffLimit: 0` and `restartPolicy: Never`: when
  one pod fails, the Job fails and its other pods are stopped; the processes of an island restart together by
  deleting the Job and applying the file again, resuming from the checkpoints on the claim.

Probes. The kubelet's built-in gRPC probe speaks plaintext only, but the coordinator serves TLS (and mutual TLS
when the islands have client certificates), so the probes are `exec` probes running `python -m
island_jax.health` in the coordinator's container, with the run's CA and client certificate from the mounted
Secret, against 127.0.0.1:PORT (island_jax/health.py): a startup probe that allows 15 minutes (the coordinator
builds and restores its state before it serves), then readiness every 10 s and liveness every 30 s (restart
after 2 minutes without an answer).

Credentials. A coordinator on Kubernetes listens beyond loopback, so it needs TLS and tokens
(`coordinator.cert_file`, `key_file`, `tokens_file` and `tls.ca_file`; `security.check_exposure`). Its files and
the islands' are mounted from Secrets at fixed paths, and the commands name those paths; no secret value is in
any manifest. The description's credential paths name the files on the machine that runs kubectl; the header
of the rendered file lists the `kubectl create secret generic` commands that upload them (`secret_commands`):

  ij-RUN-tls                      ca.pem, client.pem, client.key       at /etc/island-jax/tls      (every role)
  ij-RUN-coordinator-credentials  server.pem, server.key, tokens.json  at /etc/island-jax/coordinator
  ij-RUN-token-NAME               token                                at /etc/island-jax/token   (island NAME)

Errors are `cluster_lib.ClusterError`s naming the field and the fix (the command exits with the message).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from typing import Any

from island_jax import cluster as cluster_lib
from island_jax import hardware as hardware_lib
from island_jax import k8s_objects as objects
from island_jax.k8s_objects import Names, names

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
DEFAULT_NAMESPACE = "default"

TLS_DIR = "/etc/island-jax/tls"
COORDINATOR_DIR = "/etc/island-jax/coordinator"
TOKEN_DIR = "/etc/island-jax/token"
TLS_FILES = {"ca_file": "ca.pem", "client_cert_file": "client.pem", "client_key_file": "client.key"}
COORDINATOR_FILES = {"cert_file": "server.pem", "key_file": "server.key", "tokens_file": "tokens.json"}
TOKEN_FILE = "token"

# The coordinator's probes, seconds. The health check itself gives up after HEALTH_TIMEOUT_SECONDS, within the
# probe's own timeout (an interpreter starting and importing grpc).
PROBE_TIMEOUT_SECONDS = 10
HEALTH_TIMEOUT_SECONDS = 5
STARTUP_PROBE = {"periodSeconds": 10, "failureThreshold": 90}  # up to 15 minutes to start serving
READINESS_PROBE = {"periodSeconds": 10, "failureThreshold": 3}
LIVENESS_PROBE = {"periodSeconds": 30, "failureThreshold": 4}  # restarted after 2 minutes without an answer

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def _namespace(p: cluster_lib.Placement, field: str) -> str:
    ns = str(p.get("namespace", DEFAULT_NAMESPACE) or DEFAULT_NAMESPACE)
    if not (_LABEL.fullmatch(ns) and len(ns) <= 63):
        raise cluster_lib.ClusterError(f"{field}.namespace is {ns!r}; give a Kubernetes namespace name (lowercase "
                                       "letters, digits and '-', at most 63)")
    return ns


def _field(p: cluster_lib.Placement) -> str:
    return "coordinator" if p.role == "coordinator" else f"islands.{p.role}"


def _check_placement(config, cluster: cluster_lib.Cluster, p: cluster_lib.Placement) -> None:
    """The k8s fields of one role, and the credentials a role on Kubernetes needs."""
    field = _field(p)
    _namespace(p, field)
    storage = str(p.get("storage", objects.DEFAULT_STORAGE))
    if not _QUANTITY.fullmatch(storage):
        raise cluster_lib.ClusterError(f"{field}.storage is {storage!r}; give a size such as 10Gi or 500Gi")
    selector = p.get("node_selector", {}) or {}
    if not isinstance(selector, dict) or not all(isinstance(k, str) for k in selector):
        raise cluster_lib.ClusterError(f"{field}.node_selector is {selector!r}; give a mapping of node labels to "
                                       "values")
    if p.role == "coordinator":
        if p.get("resource"):
            raise cluster_lib.ClusterError("coordinator.resource is set, but the coordinator uses no accelerator; "
                                           "remove it")
        kind = p.get("service_type", "ClusterIP")
        if kind not in SERVICE_TYPES:
            raise cluster_lib.ClusterError(f"coordinator.service_type is {kind!r}; use one of "
                                           f"{', '.join(SERVICE_TYPES)}")
        return
    if p.get("service_type"):
        raise cluster_lib.ClusterError(f"{field}.service_type is set, but only the coordinator has a Service "
                                       "islands dial; remove it")
    if config.islands[p.role].hardware == "cpu" and p.get("resource"):
        raise cluster_lib.ClusterError(f"{field}.resource is set, but islands.{p.role}.hardware is cpu; remove it "
                                       "(CPU islands request no devices)")


def _device_resource(config, p: cluster_lib.Placement) -> str:
    """The extended resource island `p` asks for devices as ("" for CPU islands)."""
    hardware = config.islands[p.role].hardware
    if hardware == "cpu":
        return ""
    return str(p.get("resource") or ("google.com/tpu" if hardware_lib.kind(hardware) == "tpu" else "nvidia.com/gpu"))


def _credentials(cluster: cluster_lib.Cluster, role: str) -> dict[str, str]:
    """The mount paths `role_command` puts in the commands, for the credentials the description names."""
    paths = {k: f"{TLS_DIR}/{f}" if cluster.tls.get(k) else "" for k, f in TLS_FILES.items()}
    paths.update({k: f"{COORDINATOR_DIR}/{f}" if cluster.coordinator.get(k) else ""
                  for k, f in COORDINATOR_FILES.items()})
    island = cluster.islands.get(role)
    paths["token_file"] = f"{TOKEN_DIR}/{TOKEN_FILE}" if island is not None and island.token_file else ""
    return paths


def _k8s_argv(command: cluster_lib.Command) -> list[str]:
    """The command's argument list for a container: literal `$(` escaped as `$$(` (Kubernetes would expand it),
    the expansions (`$(JOB_COMPLETION_INDEX)`) left for Kubernetes."""
    argv = command.argv()
    literal = len(command.args)
    return [a.replace("$(", "$$(") if i < literal else a for i, a in enumerate(argv)]


def health_command(cluster: cluster_lib.Cluster) -> list[str]:
    """The coordinator's probe: `python -m island_jax.health` against 127.0.0.1:PORT with the mounted CA and
    client certificate, checking the certificate for the host of `coordinator.addresses`."""
    command = [cluster.python, "-m", "island_jax.health", f"--address=127.0.0.1:{cluster.port}"]
    command += [f"--{k}={TLS_DIR}/{f}" for k, f in TLS_FILES.items() if cluster.tls.get(k)]
    return command + [f"--server_name={cluster.server_name or cluster.host}", f"--timeout_seconds={HEALTH_TIMEOUT_SECONDS}"]


def _coordinator(cluster: cluster_lib.Cluster, config_args: list[str], workdir: str, n: Names) -> list[dict]:
    p = cluster.coordinator
    ns, labels = _namespace(p, "coordinator"), objects.role_labels(n, "coordinator")
    port, shards = cluster.port, cluster.shards
    sharded = {}
    if shards > 1:  # every shard's pod listens on PORT; shard k's Service maps its own port there
        pod0 = f"{n.coordinator}-0.{n.coordinator_pods}.{ns}.svc.cluster.local"
        sharded = {"shard": "$(JOB_COMPLETION_INDEX)", "shard_service": f"{pod0}:{cluster.shard_port}"}
    command = cluster_lib.role_command(cluster, "coordinator", config_args, workdir, [f"0.0.0.0:{port}"] * shards,
                                       credentials=_credentials(cluster, "coordinator"), **sharded)
    mounts = [{"name": "workdir", "mountPath": workdir}]
    volumes = [{"name": "workdir", "persistentVolumeClaim": {"claimName": n.coordinator_claim}}] if sharded else []
    if cluster.tls:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(objects.secret_volume("tls", n.tls_secret))
    mounts.append({"name": "credentials", "mountPath": COORDINATOR_DIR, "readOnly": True})
    volumes.append(objects.secret_volume("credentials", n.coordinator_secret))
    ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
    if sharded:
        ports.append({"name": "jax", "containerPort": cluster.shard_port, "protocol": "TCP"})
    container = objects.container("coordinator", str(p.get("image")), cluster, _k8s_argv(command), dict(p.env),
                                  ports, mounts)
    for key, timing in (("startupProbe", STARTUP_PROBE), ("readinessProbe", READINESS_PROBE),
                        ("livenessProbe", LIVENESS_PROBE)):
        container[key] = {"exec": {"command": health_command(cluster)}, "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
                          **timing}
    if sharded:
        kind = str(p.get("service_type", "ClusterIP"))
        return [*(objects.shard_service(n, ns, labels, k, cluster.ports[k], kind) for k in range(shards)),
                objects.pods_service(n.coordinator_pods, ns, labels, [("grpc", port), ("jax", cluster.shard_port)]),
                objects.claim(n.coordinator_claim, ns, labels, p, True),
                objects.indexed_job(n.coordinator, ns, labels, p, shards, n.coordinator_pods, container, volumes)]
    grpc_port = {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": objects.metadata(n.coordinator, ns, labels),
               "spec": {"type": p.get("service_type", "ClusterIP"), "selector": dict(labels), "ports": [grpc_port]}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": objects.metadata(n.coordinator_pods, ns, labels),
                "spec": {"clusterIP": "None", "selector": dict(labels), "ports": [grpc_port]}}
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": objects.metadata(n.coordinator, ns, labels),
        "spec": {
            "serviceName": n.coordinator_pods, "replicas": 1, "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": {
                **objects.pod_extras(p), "terminationGracePeriodSeconds": objects.TERMINATION_GRACE_SECONDS,
                "containers": [container], "volumes": volumes}},
            "volumeClaimTemplates": [{"metadata": {"name": "workdir", "labels": dict(labels)},
                                      "spec": objects.claim_spec(p, "ReadWriteOnce")}],
        },
    }
    return [service, headless, statefulset]


def coordinator_dial(cluster: cluster_lib.Cluster, n: Names) -> tuple[str, str]:
    """(HOST:PORT that islands on Kubernetes dial, the name they check its certificate for: "" for the host
    dialled). The Service's cluster DNS name when the coordinator is on Kubernetes too, else the address; with
    coordinator shards, every shard's, comma-separated, shard 0 first.

    Raises:
      cluster_lib.ClusterError: shards on Kubernetes with TLS, addresses of different hosts and no
        `coordinator.server_name` (islands in the cluster check one name for every shard's Service).
    """
    if cluster.coordinator.scheduler != "k8s":
        return ",".join(cluster.addresses), cluster.server_name
    ns = _namespace(cluster.coordinator, "coordinator")
    hosts = sorted({a.rsplit(":", 1)[0].strip("[]") for a in cluster.addresses})
    if cluster.tls.get("ca_file") and not cluster.server_name and len(hosts) > 1:
        raise cluster_lib.ClusterError(
            f"coordinator.server_name is missing: islands in the cluster dial each shard's Service and check one "
            f"name for all {cluster.shards} shards, but coordinator.addresses has hosts {', '.join(hosts)}; give "
            "the name every shard's certificate holds")
    server_name = (cluster.server_name or cluster.host) if cluster.tls.get("ca_file") else ""
    if cluster.shards == 1:
        return f"{n.coordinator}.{ns}.svc.cluster.local:{cluster.port}", server_name
    return ",".join(f"{n.coordinator_shard(k)}.{ns}.svc.cluster.local:{port}"
                    for k, port in enumerate(cluster.ports)), server_name


def _island(config, cluster: cluster_lib.Cluster, name: str, config_args: list[str], workdir: str,
            n: Names) -> list[dict]:
    p = cluster.islands[name]
    ns, labels, job = _namespace(p, f"islands.{name}"), objects.role_labels(n, name), n.island(name)
    dial, server_name = coordinator_dial(cluster, n)
    several = p.nodes > 1
    command = cluster_lib.role_command(
        cluster, name, config_args, workdir, dial,
        process_id="$(JOB_COMPLETION_INDEX)" if several else None,
        island_coordinator=f"{job}-0.{job}.{ns}.svc.cluster.local:{cluster.island_port}" if several else None,
        credentials=_credentials(cluster, name), server_name=server_name)
    argv = _k8s_argv(command)
    mounts = [{"name": "workdir", "mountPath": workdir}, {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "workdir", "persistentVolumeClaim": {"claimName": n.island_claim(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # the container runtime's 64 MiB is too small for NCCL
    ]
    if cluster.tls:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(objects.secret_volume("tls", n.tls_secret))
    if p.token_file:
        mounts.append({"name": "token", "mountPath": TOKEN_DIR, "readOnly": True})
        volumes.append(objects.secret_volume("token", n.token_secret(name)))
    ports = [{"name": "jax", "containerPort": cluster.island_port, "protocol": "TCP"}]
    container = objects.container("island", str(p.get("image")), cluster, argv, dict(p.env), ports, mounts)
    resource = _device_resource(config, p)
    if resource:
        container["resources"] = {"limits": {resource: p.devices_per_node}}
    service = objects.pods_service(job, ns, labels, [("jax", cluster.island_port)])
    claim = objects.claim(n.island_claim(name), ns, labels, p, several)
    return [service, claim, objects.indexed_job(job, ns, labels, p, p.nodes, job, container, volumes)]


def _k8s_roles(cluster: cluster_lib.Cluster) -> list[cluster_lib.Placement]:
    return [p for p in cluster.placements() if p.scheduler == "k8s"]


def _absolute_workdir(cluster: cluster_lib.Cluster, workdir: str) -> str:
    repo = cluster.repo
    if not os.path.isabs(repo) and repo not in (".", "./"):
        raise cluster_lib.ClusterError(f"repo is {repo!r}; on Kubernetes give the checkout's absolute path in the "
                                       "image, or '.' for the image's working directory")
    path = cluster_lib.shared_path(workdir, repo)
    if not os.path.isabs(path):
        raise cluster_lib.ClusterError(f"--workdir={workdir}: give an absolute path; each pod mounts its role's "
                                       "volume there")
    return os.path.normpath(path)


def render(config, cluster: cluster_lib.Cluster, config_args: list[str], workdir: str) -> list[dict]:
    """The Kubernetes manifests of every role placed on Kubernetes, as dicts (one per object).

    Order: the coordinator's gRPC Service, its headless Service and its StatefulSet (when the coordinator is on
    Kubernetes); then per island on Kubernetes, in the config's order, its headless Service, its
    PersistentVolumeClaim and its Job.

    Args:
      config: the run's config (checked with `cluster`).
      cluster: the description (`cluster_lib.load`).
      config_args: `--config=FILE` and the overrides, the same for every role (`cluster_lib.config_args`).
      workdir: the run's folder inside the pods (absolute, or relative to an absolute `repo`); its last folder
        names the run.

    Raises:
      cluster_lib.ClusterError: no role has `scheduler: k8s`; a role on Kubernetes without `image`, or with a
        wrong namespace, storage size, node selector, service type or resource; a coordinator on Kubernetes
        without TLS and tokens, or an island on Kubernetes without the CA or token the coordinator needs; names
        that do not fit Kubernetes (`names`); a relative repo or workdir.
    """
    roles = _k8s_roles(cluster)
    if not roles:
        raise cluster_lib.ClusterError("no role of the cluster description has scheduler: k8s; nothing to render")
    for p in roles:
        _check_placement(config, cluster, p)
    workdir = _absolute_workdir(cluster, workdir)
    n = names(cluster, workdir)
    docs = []
    if cluster.coordinator.scheduler == "k8s":
        docs += _coordinator(cluster, list(config_args), workdir, n)
    for name, p in cluster.islands.items():
        if p.scheduler == "k8s":
            docs += _island(config, cluster, name, list(config_args), workdir, n)
    return docs


def secret_commands(cluster: cluster_lib.Cluster, workdir: str, kubectl: str = "kubectl") -> list[str]:
    """The `kubectl create secret generic` commands that upload the credential files the description names into
    the Secrets the manifests mount, one per Secret and namespace, as shell lines (the files' paths, never their
    contents). Raises what `names` raises."""
    n = names(cluster, workdir)
    roles = _k8s_roles(cluster)
    wanted: list[tuple[str, str, dict[str, str]]] = []  # (secret, namespace, {key: local path})
    tls = {f: cluster.tls[k] for k, f in TLS_FILES.items() if cluster.tls.get(k)}
    if tls:
        for ns in dict.fromkeys(_namespace(p, _field(p)) for p in roles):
            wanted.append((n.tls_secret, ns, tls))
    if cluster.coordinator.scheduler == "k8s":
        files = {f: str(cluster.coordinator.get(k)) for k, f in COORDINATOR_FILES.items() if cluster.coordinator.get(k)}
        wanted.append((n.coordinator_secret, _namespace(cluster.coordinator, "coordinator"), files))
    for name, p in cluster.islands.items():
        if p.scheduler == "k8s" and p.token_file:
            wanted.append((n.token_secret(name), _namespace(p, f"islands.{name}"), {TOKEN_FILE: p.token_file}))
    return [" ".join([kubectl, "create", "secret", "generic", secret, f"--namespace={ns}",
                      *(shlex.quote(f"--from-file={key}={path}") for key, path in files.items())])
            for secret, ns, files in wanted]


def header(cluster: cluster_lib.Cluster, workdir: str, kubectl: str = "kubectl") -> str:
    """The comment block the rendered file starts with: what is here and what is elsewhere, the Secrets to
    create first, the probes, how islands reach the coordinator, and how an island restarts. Raises what `names`
    raises."""
    workdir = _absolute_workdir(cluster, workdir)
    n = names(cluster, workdir)
    here = [p.role if p.role == "coordinator" else f"island {p.role}" for p in _k8s_roles(cluster)]
    elsewhere = [f"{p.role if p.role == 'coordinator' else 'island ' + p.role} ({p.scheduler})"
                 for p in cluster.placements() if p.scheduler != "k8s"]
    lines = [f"island_jax run {n.run}: Kubernetes manifests rendered by launch/k8s.py (workdir {workdir} in each pod)",
             f"Here: {', '.join(here)}.",
             "Elsewhere (started by their own launcher): " + (", ".join(elsewhere) if elsewhere else "none") + ".",
             "",
             "Create the Secrets first (this file holds no secret value, only their names); these upload the files",
             "the cluster description names:"]
    lines += [f"  {c}" for c in secret_commands(cluster, workdir, kubectl)]
    if cluster.coordinator.scheduler == "k8s":
        dial, server_name = coordinator_dial(cluster, n)
        lines += [
            "",
            "Probes: the kubelet's gRPC probe speaks plaintext only, and the coordinator serves TLS (mutual TLS with",
            "client certificates), so its probes exec `python -m island_jax.health` in its container with the run's",
            "CA and client certificate (island_jax/health.py).",
            "",
            f"Islands in this cluster dial {dial}" + (";" if not server_name else ","),
            *([f"checking the coordinator's certificate for {server_name} (comm.tls.server_name);"] if server_name
              else []),
        ]
        kind = cluster.coordinator.get('service_type', 'ClusterIP')
        if cluster.shards == 1:
            lines.append(f"islands elsewhere dial {cluster.addresses[0]}, which must lead to Service {n.coordinator} "
                         f"(type {kind}).")
        else:
            ns = _namespace(cluster.coordinator, "coordinator")
            lines += [f"islands elsewhere dial {','.join(cluster.addresses)}: shard k's address must lead to Service",
                      f"{n.coordinator}-k (type {kind}), which selects the pod of index k (Kubernetes 1.28 or later).",
                      "",
                      f"The coordinator's {cluster.shards} shards are one Indexed Job, which fails as a whole when "
                      "one pod fails",
                      "(backoffLimit 0): to restart the coordinator (every shard together), delete its Job and apply "
                      "this file",
                      "again; it resumes from the checkpoints on its claim:",
                      f"  {kubectl} delete job --namespace={ns} {n.coordinator}"]
    islands = {name: p for name, p in cluster.islands.items() if p.scheduler == "k8s"}
    if islands:
        lines += ["", "An island's Job fails as a whole when one of its pods fails (backoffLimit 0): to restart the",
                  "island (all its processes together), delete its Job and apply this file again; it resumes from",
                  "the checkpoints on its claim:"]
        lines += [f"  {kubectl} delete job --namespace={_namespace(p, f'islands.{name}')} {n.island(name)}"
                  for name, p in islands.items()]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def render_yaml(config, cluster: cluster_lib.Cluster, config_args: list[str], workdir: str,
                kubectl: str = "kubectl") -> str:
    """`header` and then `render`'s manifests as one multi-document YAML (what `--dry_run` prints and
    WORKDIR/launch/k8s.yaml holds). Raises what `render` raises."""
    import yaml

    class _Dumper(yaml.SafeDumper):  # every object written out in full, without YAML anchors and aliases
        def ignore_aliases(self, data):
            return True

    docs = render(config, cluster, config_args, workdir)
    return header(cluster, workdir, kubectl) + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=4096)


# The command line's flags (`cluster_lib.define_flags`), defined only when this file runs as a script.
_FLAGS: dict[str, Any] = {}


def main(argv):
    del argv
    config, workdir, kubectl = _FLAGS["config"].value, _FLAGS["workdir"].value, _FLAGS["kubectl"].value
    try:
        cluster = cluster_lib.load(_FLAGS["cluster"].value, config)
        config_args = cluster_lib.config_args(sys.argv[1:])
        text = render_yaml(config, cluster, config_args, workdir, kubectl)
    except cluster_lib.ClusterError as e:
        sys.exit(str(e))
    if _FLAGS["dry_run"].value:
        print(text, end="")
        return
    path = os.path.join(workdir, "launch", "k8s.yaml")
    try:
        cluster_lib.write_launch_file(workdir, "k8s.yaml", text)
    except OSError as e:
        sys.exit(f"cannot write {path} ({e}); run with --dry_run > FILE and `{kubectl} apply -f FILE` instead")
    done = subprocess.run([*shlex.split(kubectl), "apply", "-f", path])
    if done.returncode:
        sys.exit(f"{kubectl} apply -f {path} failed ({done.returncode}); see its output above")
    print(f"[k8s] applied {path}", flush=True)


if __name__ == "__main__":
    from absl import app

    from island_jax.cli import parse_flags

    _FLAGS.update(cluster_lib.define_flags(
        "kubectl", "The kubectl command (its path, or a wrapper).",
        "The run's folder inside the pods (each role's volume is mounted there); its last folder names the run.",
        "Print the manifests; write and apply nothing."))
    app.run(main, flags_parser=parse_flags)
