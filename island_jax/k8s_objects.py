"""The Kubernetes objects of a run, as dicts: their names and labels, and the builders `launch/k8s.py` puts
together (Services, PersistentVolumeClaims, Indexed Jobs, containers).

Every object is named `ij-RUN-...` (RUN: the workdir's last folder as a DNS label, `Names`) and labelled
`app.kubernetes.io/name: island-jax`, `app.kubernetes.io/instance: RUN` and `app.kubernetes.io/component:
coordinator|island` (islands also `island-jax/island: NAME`). A role of several processes (an island of several
hosts, a coordinator of several shards) is an Indexed Job (`indexed_job`: completions = parallelism = the
processes, `backoffLimit: 0`, `restartPolicy: Never`, so its pods fail and start again together), its pods in the
subdomain of a headless Service (`pods_service`) so that each finds its process 0 by name. A coordinator shard's
Service (`shard_service`) selects its pod by the Job's index label (Kubernetes 1.28 and later).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from island_jax import cluster as cluster_lib

APP = "island-jax"
DEFAULT_STORAGE = "10Gi"
MAX_NAME = 52  # StatefulSet and Job names: their pods' names and hostnames add a suffix within 63 characters
SHARD_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # on an Indexed Job's pods (Kubernetes 1.28+)
TERMINATION_GRACE_SECONDS = 120  # a stopped role finishes the checkpoint it is writing (SIGTERM, then SIGKILL)


def dns_label(text: str) -> str:
    """`text` as a DNS label: lowercase, runs of anything but letters and digits as one '-', none at the ends
    ("two_islands" -> "two-islands"); "" when nothing is left."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclasses.dataclass(frozen=True)
class Names:
    """The names of a run's Kubernetes objects.

    Attributes:
      run: the run's name (a DNS label), from its workdir's last folder; the `app.kubernetes.io/instance` label.
      islands: {island name in the config: its DNS label}.
    """

    run: str
    islands: dict[str, str]

    @property
    def prefix(self) -> str:
        return f"ij-{self.run}"

    @property
    def coordinator(self) -> str:
        """The StatefulSet and the Service islands dial; with coordinator shards, their Job."""
        return f"{self.prefix}-coordinator"

    @property
    def coordinator_pods(self) -> str:
        """The StatefulSet's headless Service (its `serviceName`); with shards, the Job's pods' subdomain."""
        return f"{self.prefix}-coordinator-pods"

    def coordinator_shard(self, k: int) -> str:
        """With coordinator shards: the Service islands dial shard `k` at."""
        return f"{self.prefix}-coordinator-{k}"

    @property
    def coordinator_claim(self) -> str:
        """With coordinator shards: the volume every shard's pod mounts at the workdir."""
        return f"{self.coordinator}-workdir"

    def island(self, name: str) -> str:
        """Island `name`'s Job, and the headless Service its pods' subdomain is."""
        return f"{self.prefix}-island-{self.islands[name]}"

    def island_claim(self, name: str) -> str:
        return f"{self.island(name)}-workdir"

    @property
    def tls_secret(self) -> str:
        return f"{self.prefix}-tls"

    @property
    def coordinator_secret(self) -> str:
        return f"{self.prefix}-coordinator-credentials"

    def token_secret(self, name: str) -> str:
        return f"{self.prefix}-token-{self.islands[name]}"


def names(cluster: cluster_lib.Cluster, workdir: str) -> Names:
    """The object names of the run in `workdir` (its last folder names the run).

    Raises:
      cluster_lib.ClusterError: the workdir's last folder or an island name has no letter or digit, two islands
        map to one name, or a name is longer than `MAX_NAME` characters.
    """
    run = dns_label(os.path.basename(os.path.normpath(workdir)))
    if not run:
        raise cluster_lib.ClusterError(f"--workdir={workdir}: its last folder names the run's Kubernetes objects; "
                                       "give a folder whose name has letters or digits")
    islands: dict[str, str] = {}
    for name in cluster.islands:
        label = dns_label(name)
        if not label:
            raise cluster_lib.ClusterError(f"islands.{name}: the island's name has no letter or digit to name its "
                                           "Kubernetes objects; rename the island")
        other = next((n for n, lab in islands.items() if lab == label), None)
        if other is not None:
            raise cluster_lib.ClusterError(
                f"islands {other} and {name} both become {label!r} in Kubernetes names (lowercase letters, digits "
                "and '-'); rename one of them")
        islands[name] = label
    result = Names(run, islands)
    longest = [result.coordinator_pods] if cluster.coordinator.scheduler == "k8s" else []
    longest += [result.island(n) for n, p in cluster.islands.items() if p.scheduler == "k8s"]
    for name in longest:
        if len(name) > MAX_NAME:
            raise cluster_lib.ClusterError(
                f"the Kubernetes name {name} is {len(name)} characters, more than {MAX_NAME} (its pods' names and "
                "host names must stay within 63); give a shorter --workdir folder name or island name")
    return result


def role_labels(n: Names, role: str) -> dict[str, str]:
    """The labels of `role`'s objects ("coordinator" or an island's name); also its pods' selector."""
    labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": n.run,
              "app.kubernetes.io/component": "coordinator" if role == "coordinator" else "island"}
    if role != "coordinator":
        labels["island-jax/island"] = n.islands[role]
    return labels


def metadata(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """An object's `metadata`: its name, namespace and labels."""
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def secret_volume(volume: str, secret: str) -> dict[str, Any]:
    """A pod's volume `volume` of the Secret `secret`."""
    return {"name": volume, "secret": {"secretName": secret}}


def container(name: str, image: str, cluster: cluster_lib.Cluster, argv: list[str], env: dict[str, str],
              ports: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """A role's container: `argv` (interpreter first) in the checkout, unbuffered, with `env`, `ports`, `mounts`."""
    c: dict[str, Any] = {"name": name, "image": image}
    if os.path.isabs(cluster.repo):
        c["workingDir"] = cluster.repo
    c.update({
        "command": argv[:1], "args": argv[1:],
        "env": [{"name": k, "value": v} for k, v in {"PYTHONUNBUFFERED": "1", **env}.items()],
        "ports": ports, "volumeMounts": mounts,
    })
    return c


def pod_extras(p: cluster_lib.Placement) -> dict[str, Any]:
    """The pod spec's fields from the role's own (`node_selector`)."""
    selector = p.get("node_selector", {}) or {}
    return {"nodeSelector": {k: str(v) for k, v in selector.items()}} if selector else {}


def claim_spec(p: cluster_lib.Placement, access_mode: str) -> dict[str, Any]:
    """A PersistentVolumeClaim's spec: `storage` (default `DEFAULT_STORAGE`) of `storage_class`, if given."""
    spec: dict[str, Any] = {"accessModes": [access_mode],
                            "resources": {"requests": {"storage": str(p.get("storage", DEFAULT_STORAGE))}}}
    if p.get("storage_class"):
        spec["storageClassName"] = str(p.get("storage_class"))
    return spec


def shard_service(n: Names, namespace: str, labels: dict[str, str], k: int, port: int, kind: str) -> dict:
    """Shard `k`'s Service, which islands dial: `port` to its pod's gRPC port, selected by the index label the
    Job controller gives each pod (`batch.kubernetes.io/job-completion-index`, Kubernetes 1.28 and later)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(n.coordinator_shard(k), namespace, labels),
            "spec": {"type": kind, "selector": {**labels, SHARD_INDEX_LABEL: str(k)},
                     "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}]}}


def pods_service(name: str, namespace: str, labels: dict[str, str], ports: list[tuple[str, int]]) -> dict:
    """The headless Service whose subdomain an Indexed Job's pods are in: pod I of Job J is
    J-I.NAME.NAMESPACE.svc.cluster.local, resolvable before it is ready (`jax.distributed` starts first)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name, namespace, labels),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": dict(labels),
                     "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                               for port_name, port in ports]}}


def claim(name: str, namespace: str, labels: dict[str, str], p: cluster_lib.Placement, shared: bool) -> dict:
    """The role's workdir volume: ReadWriteMany when several pods write into it (`shared`)."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata(name, namespace, labels),
            "spec": claim_spec(p, "ReadWriteMany" if shared else "ReadWriteOnce")}


def indexed_job(name: str, namespace: str, labels: dict[str, str], p: cluster_lib.Placement, count: int,
                subdomain: str, main: dict[str, Any], volumes: list[dict[str, Any]]) -> dict:
    """`count` pods that run and fail as one: an Indexed Job (index in `JOB_COMPLETION_INDEX`), completions =
    parallelism = `count`, `backoffLimit: 0` and `restartPolicy: Never`, so that one failed pod fails the Job
    and its other pods are stopped; they start again together when the Job is applied again."""
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(name, namespace, labels),
        "spec": {
            "completionMode": "Indexed", "completions": count, "parallelism": count, "backoffLimit": 0,
            "template": {"metadata": {"labels": dict(labels)}, "spec": {
                **pod_extras(p), "subdomain": subdomain, "restartPolicy": "Never",
                "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                "containers": [main], "volumes": volumes}},
        },
    }
