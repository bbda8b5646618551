"""launch/k8s.py: the manifests rendered from a cluster description (no Kubernetes needed), checked against the
Kubernetes 1.30 API schemas; and island_jax/health.py, the coordinator's probe, against the real gRPC server."""

import os
import re
import socket
import subprocess
import sys

import kubernetes_validate
import numpy as np
import pytest
import yaml
from launchers import changed, launcher

from island_jax import cluster as cluster_lib
from island_jax import health
from island_jax.comm import security
from island_jax.comm.grpc_server import serve
from island_jax.comm.options import SERVICE_NAME
from island_jax.config import default_config, island
from island_jax.coordinator import Coordinator
from island_jax.experiment import apply_override, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
k8s = launcher("k8s")

KUBERNETES = "1.30.0"  # the API version the manifests are validated against (kubernetes-validate's schemas)
WORKDIR = "/runs/two_islands"
# two_islands on GPUs: island a on 2 nodes x 4 GPUs, island b on 1 node x 8 GPUs
OVERRIDES = {
    "islands.a.num_processes": 2, "islands.a.num_devices": 8, "islands.a.mesh.data": 4, "islands.a.mesh.expert": 2,
    "islands.a.hardware": "h100",
    "islands.b.num_devices": 8, "islands.b.mesh.data": 4, "islands.b.hardware": "h100", "islands.b.batch_size": 8,
}
CONFIG_ARGS = ["--config=experiments/configs/two_islands.py", *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]
IMAGE = "ghcr.io/example/island-jax:0.1.0"
PROBE = ["python3", "-m", "island_jax.health", "--address=127.0.0.1:50051", "--ca_file=/etc/island-jax/tls/ca.pem",
         "--client_cert_file=/etc/island-jax/tls/client.pem", "--client_key_file=/etc/island-jax/tls/client.key",
         "--server_name=coord.example.org", "--timeout_seconds=5"]


def gpu_config():
    config = load_config("experiments/configs/two_islands.py")
    for key, value in OVERRIDES.items():
        apply_override(config, key, value)
    return config


@pytest.fixture
def made(tmp_path):
    """The run's real credentials (CA, certificates, keys, a random token per island) in tmp_path/secrets."""
    return security.make_run_credentials(str(tmp_path / "secrets"), ["a", "b"], ["coord.example.org"])


def description(tmp_path, made, **changes):
    """A cluster description with every role on Kubernetes, written to tmp_path/cluster.yaml; `changes` set
    (or, with None, remove) dotted fields. Returns the file's path."""
    raw = {
        "coordinator": {"scheduler": "k8s", "addresses": ["coord.example.org:50051"], "namespace": "training",
                        "image": IMAGE, "cert_file": made["cert_file"], "key_file": made["key_file"],
                        "tokens_file": made["tokens_file"]},
        "islands": {
            "a": {"scheduler": "k8s", "nodes": 2, "devices_per_node": 4, "namespace": "training", "image": IMAGE,
                  "resource": "nvidia.com/gpu", "token_file": made["token_files"]["a"], "storage_class": "shared"},
            "b": {"scheduler": "k8s", "nodes": 1, "devices_per_node": 8, "namespace": "training", "image": IMAGE,
                  "resource": "nvidia.com/gpu", "token_file": made["token_files"]["b"]},
        },
        "tls": {k: made[k] for k in ("ca_file", "client_cert_file", "client_key_file")},
        "repo": "/opt/island_jax",
    }
    changed(raw, changes)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def rendered(tmp_path, made, **changes):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made, **changes), config)
    return k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)


def by_kind(docs, kind, name):
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers(docs):
    """{coordinator or island name: its container}."""
    found = {}
    for d in docs:
        if d["kind"] in ("StatefulSet", "Job"):
            labels = d["metadata"]["labels"]
            found[labels.get("island-jax/island", "coordinator")] = d["spec"]["template"]["spec"]["containers"][0]
    return found


def test_the_manifests_of_every_role_with_their_kinds_names_and_labels(tmp_path, made):
    docs = rendered(tmp_path, made)
    assert [(d["apiVersion"], d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs] == [
        ("v1", "Service", "training", "ij-two-islands-coordinator"),
        ("v1", "Service", "training", "ij-two-islands-coordinator-pods"),
        ("apps/v1", "StatefulSet", "training", "ij-two-islands-coordinator"),
        ("v1", "Service", "training", "ij-two-islands-island-a"),
        ("v1", "PersistentVolumeClaim", "training", "ij-two-islands-island-a-workdir"),
        ("batch/v1", "Job", "training", "ij-two-islands-island-a"),
        ("v1", "Service", "training", "ij-two-islands-island-b"),
        ("v1", "PersistentVolumeClaim", "training", "ij-two-islands-island-b-workdir"),
        ("batch/v1", "Job", "training", "ij-two-islands-island-b"),
    ]
    for d in docs:
        labels = d["metadata"]["labels"]
        component = "coordinator" if "coordinator" in d["metadata"]["name"] else "island"
        assert {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                                       "app.kubernetes.io/component")} == {
            "app.kubernetes.io/name": "island-jax", "app.kubernetes.io/instance": "two-islands",
            "app.kubernetes.io/component": component}
        if component == "island":
            assert labels["island-jax/island"] == d["metadata"]["name"].split("-")[4]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 52


def test_the_rendered_yaml_parses_back_and_every_document_is_valid_kubernetes(tmp_path, made):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made), config)
    text = k8s.render_yaml(config, cluster, CONFIG_ARGS, WORKDIR)
    docs = list(yaml.safe_load_all(text))
    assert docs == k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)
    assert "&id" not in text and "*id" not in text  # every object written out, no YAML aliases
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == "1.30"
    broken = dict(docs[-1], spec={**docs[-1]["spec"], "completionsMode": "Indexed"})  # the validator does check
    with pytest.raises(kubernetes_validate.ValidationError, match="completionsMode"):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    head = text[:text.index("apiVersion:")]
    assert all(line.startswith("#") for line in head.splitlines())
    assert "# Elsewhere (started by their own launcher): none." in head
    assert "kubelet's gRPC probe speaks plaintext only" in head


def test_the_coordinator_is_a_statefulset_with_its_services_claim_and_exec_probes(tmp_path, made):
    docs = rendered(tmp_path, made)
    service = by_kind(docs, "Service", "ij-two-islands-coordinator")
    headless = by_kind(docs, "Service", "ij-two-islands-coordinator-pods")
    sts = by_kind(docs, "StatefulSet", "ij-two-islands-coordinator")
    pod = sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"] == {"type": "ClusterIP", "selector": labels,
                               "ports": [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"}]}
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == labels
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == "ij-two-islands-coordinator-pods"
    assert sts["spec"]["selector"] == {"matchLabels": labels}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "workdir"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    (c,) = pod["containers"]
    assert c["image"] == IMAGE and c["workingDir"] == "/opt/island_jax" and c["command"] == ["python3"]
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"}]
    args = c["args"]
    assert args[:2] == ["-u", "experiments/train.py"]
    assert args[args.index(f"--workdir={WORKDIR}"):] == [
        f"--workdir={WORKDIR}", "--coordinator=0.0.0.0:50051", "--role=coordinator",
        "--config.comm.tls.ca_file=/etc/island-jax/tls/ca.pem",
        "--config.comm.tls.cert_file=/etc/island-jax/coordinator/server.pem",
        "--config.comm.tls.key_file=/etc/island-jax/coordinator/server.key",
        "--config.comm.tls.require_client_cert=True",
        "--config.comm.auth.tokens_file=/etc/island-jax/coordinator/tokens.json"]
    assert c["startupProbe"] == {"exec": {"command": PROBE}, "timeoutSeconds": 10, "periodSeconds": 10,
                                 "failureThreshold": 90}
    assert c["readinessProbe"] == {"exec": {"command": PROBE}, "timeoutSeconds": 10, "periodSeconds": 10,
                                   "failureThreshold": 3}
    assert c["livenessProbe"] == {"exec": {"command": PROBE}, "timeoutSeconds": 10, "periodSeconds": 30,
                                  "failureThreshold": 4}
    assert c["volumeMounts"] == [
        {"name": "workdir", "mountPath": WORKDIR},
        {"name": "tls", "mountPath": "/etc/island-jax/tls", "readOnly": True},
        {"name": "credentials", "mountPath": "/etc/island-jax/coordinator", "readOnly": True}]
    assert pod["volumes"] == [{"name": "tls", "secret": {"secretName": "ij-two-islands-tls"}},
                              {"name": "credentials",
                               "secret": {"secretName": "ij-two-islands-coordinator-credentials"}}]


def test_a_load_balancer_and_a_storage_class_for_the_coordinator(tmp_path, made):
    docs = rendered(tmp_path, made, **{"coordinator.service_type": "LoadBalancer", "coordinator.storage": "200Gi",
                                       "coordinator.storage_class": "premium-rwo"})
    assert by_kind(docs, "Service", "ij-two-islands-coordinator")["spec"]["type"] == "LoadBalancer"
    (claim,) = by_kind(docs, "StatefulSet", "ij-two-islands-coordinator")["spec"]["volumeClaimTemplates"]
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "200Gi"}},
                             "storageClassName": "premium-rwo"}


def test_each_island_is_an_indexed_job_whose_pods_find_process_0_through_a_headless_service(tmp_path, made):
    docs = rendered(tmp_path, made)
    job = by_kind(docs, "Job", "ij-two-islands-island-a")
    service = by_kind(docs, "Service", "ij-two-islands-island-a")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert {k: spec[k] for k in ("completionMode", "completions", "parallelism", "backoffLimit")} == {
        "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0}
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True,
                               "selector": job["spec"]["template"]["metadata"]["labels"],
                               "ports": [{"name": "jax", "port": 8476, "targetPort": "jax", "protocol": "TCP"}]}
    (c,) = pod["containers"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert c["ports"] == [{"name": "jax", "containerPort": 8476, "protocol": "TCP"}]
    args = c["args"]
    assert args[args.index(f"--workdir={WORKDIR}"):] == [
        f"--workdir={WORKDIR}", "--coordinator=ij-two-islands-coordinator.training.svc.cluster.local:50051",
        "--role=island", "--island=a", "--config.comm.tls.ca_file=/etc/island-jax/tls/ca.pem",
        "--config.comm.tls.client_cert_file=/etc/island-jax/tls/client.pem",
        "--config.comm.tls.client_key_file=/etc/island-jax/tls/client.key",
        "--config.comm.tls.server_name=coord.example.org",
        "--config.comm.auth.token_file=/etc/island-jax/token/token",
        "--island_coordinator=ij-two-islands-island-a-0.ij-two-islands-island-a.training.svc.cluster.local:8476",
        "--process_id=$(JOB_COMPLETION_INDEX)"]
    assert by_kind(docs, "PersistentVolumeClaim", "ij-two-islands-island-a-workdir")["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}, "storageClassName": "shared"}
    assert pod["volumes"] == [
        {"name": "workdir", "persistentVolumeClaim": {"claimName": "ij-two-islands-island-a-workdir"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "tls", "secret": {"secretName": "ij-two-islands-tls"}},
        {"name": "token", "secret": {"secretName": "ij-two-islands-token-a"}}]
    assert [m["mountPath"] for m in c["volumeMounts"]] == [WORKDIR, "/dev/shm", "/etc/island-jax/tls",
                                                           "/etc/island-jax/token"]
    # island b: one process, so neither --process_id nor --island_coordinator, and a volume of its own
    b = by_kind(docs, "Job", "ij-two-islands-island-b")
    assert (b["spec"]["completions"], b["spec"]["parallelism"]) == (1, 1)
    (cb,) = b["spec"]["template"]["spec"]["containers"]
    assert cb["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert not [a for a in cb["args"] if a.startswith(("--process_id", "--island_coordinator"))]
    assert "--config.comm.auth.token_file=/etc/island-jax/token/token" in cb["args"]
    assert by_kind(docs, "PersistentVolumeClaim", "ij-two-islands-island-b-workdir")["spec"]["accessModes"] == [
        "ReadWriteOnce"]


def test_every_role_gets_the_same_config_and_overrides(tmp_path, made):
    found = containers(rendered(tmp_path, made))
    assert list(found) == ["coordinator", "a", "b"]
    for role, c in found.items():
        assert c["command"] + c["args"][:2] == ["python3", "-u", "experiments/train.py"], role
        assert [a for a in c["args"] if a.startswith(("--config=", "--config.islands."))] == CONFIG_ARGS, role
        assert f"--workdir={WORKDIR}" in c["args"]
        assert c["env"] == [{"name": "PYTHONUNBUFFERED", "value": "1"}]


def test_a_literal_dollar_parenthesis_is_escaped_for_kubernetes(tmp_path, made):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made), config)
    docs = k8s.render(config, cluster, [*CONFIG_ARGS, "--config.data.files=/data/$(ls)"], WORKDIR)
    for c in containers(docs).values():
        assert "--config.data.files=/data/$$(ls)" in c["args"]


def test_no_secret_value_is_in_the_manifests_only_secret_names(tmp_path, made):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made), config)
    text = k8s.render_yaml(config, cluster, CONFIG_ARGS, WORKDIR)
    for island_name, path in made["token_files"].items():
        token = open(path, encoding="utf-8").read().strip()
        assert len(token) >= 40 and token not in text, island_name
    for key in ("ca_file", "cert_file", "key_file", "client_cert_file", "client_key_file", "tokens_file"):
        body = open(made[key], encoding="utf-8").read()
        assert all(line not in text for line in body.splitlines() if len(line) > 20), key
    assert "BEGIN" not in text and "sha256:" not in text
    docs = list(yaml.safe_load_all(text))
    assert not [d for d in docs if d["kind"] == "Secret"]
    referenced = {v["secret"]["secretName"] for d in docs if d["kind"] in ("StatefulSet", "Job")
                  for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert referenced == {"ij-two-islands-tls", "ij-two-islands-coordinator-credentials", "ij-two-islands-token-a",
                          "ij-two-islands-token-b"}
    folder = os.path.dirname(made["ca_file"])
    assert k8s.secret_commands(cluster, WORKDIR) == [
        f"kubectl create secret generic ij-two-islands-tls --namespace=training --from-file=ca.pem={folder}/ca.pem "
        f"--from-file=client.pem={folder}/client.pem --from-file=client.key={folder}/client.key",
        "kubectl create secret generic ij-two-islands-coordinator-credentials --namespace=training "
        f"--from-file=server.pem={folder}/server.pem --from-file=server.key={folder}/server.key "
        f"--from-file=tokens.json={folder}/tokens.json",
        f"kubectl create secret generic ij-two-islands-token-a --namespace=training --from-file=token={folder}/token_a",
        f"kubectl create secret generic ij-two-islands-token-b --namespace=training --from-file=token={folder}/token_b",
    ]
    for command in k8s.secret_commands(cluster, WORKDIR):
        assert f"#   {command}\n" in text


def test_islands_in_another_namespace_dial_the_coordinators_service_and_get_the_secrets_there(tmp_path, made):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made, **{"islands.b.namespace": "asia"}), config)
    docs = k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)
    assert by_kind(docs, "Job", "ij-two-islands-island-b")["metadata"]["namespace"] == "asia"
    assert "--coordinator=ij-two-islands-coordinator.training.svc.cluster.local:50051" in containers(docs)["b"]["args"]
    tls = [c for c in k8s.secret_commands(cluster, WORKDIR) if "ij-two-islands-tls " in c]
    assert [c.split()[5] for c in tls] == ["--namespace=training", "--namespace=asia"]


def test_with_the_coordinator_elsewhere_only_the_islands_render_and_they_dial_its_address(tmp_path, made):
    coordinator = {"scheduler": "slurm", "addresses": ["coord.example.org:50051"], "partition": "cpu",
                   "cert_file": "/secrets/server.pem", "key_file": "/secrets/server.key",
                   "tokens_file": "/secrets/tokens.json"}
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made, coordinator=coordinator), config)
    text = k8s.render_yaml(config, cluster, CONFIG_ARGS, WORKDIR)
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["Service", "PersistentVolumeClaim", "Job"] * 2
    for c in containers(docs).values():
        assert "--coordinator=coord.example.org:50051" in c["args"]
        assert not [a for a in c["args"] if a.startswith("--config.comm.tls.server_name")]
    assert "# Here: island a, island b.\n# Elsewhere (started by their own launcher): coordinator (slurm).\n" in text
    assert "coordinator-credentials" not in text  # the coordinator's files are its own launcher's business


def test_a_cpu_island_requests_no_devices(tmp_path, made):
    config = gpu_config()
    apply_override(config, "islands.b.hardware", "cpu")
    cluster = cluster_lib.load(description(tmp_path, made, **{"islands.b.resource": None}), config)
    docs = k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)
    assert "resources" not in containers(docs)["b"]
    # a GPU island without `resource` asks for nvidia.com/gpu
    cluster = cluster_lib.load(description(tmp_path, made, **{"islands.a.resource": None}), gpu_config())
    assert containers(k8s.render(gpu_config(), cluster, CONFIG_ARGS, WORKDIR))["a"]["resources"] == {
        "limits": {"nvidia.com/gpu": 4}}


@pytest.mark.parametrize("changes, message", [
    ({"islands.b.image": None}, r"islands\.b\.image is missing; give the container image"),
    ({"coordinator.image": None}, r"coordinator\.image is missing; give the container image"),
    ({"coordinator.tokens_file": None},
     r"coordinator\.cert_file, key_file and tokens_file are missing: a coordinator on a cluster listens on every "
     r"address of its node"),
    ({"tls.ca_file": None, "tls.client_cert_file": None, "tls.client_key_file": None},
     r"tls\.ca_file is missing: the coordinator serves TLS, and the islands need the CA that signed its certificate"),
    ({"coordinator.service_type": "External"},
     r"coordinator\.service_type is 'External'; use one of ClusterIP, NodePort, LoadBalancer"),
    ({"islands.a.service_type": "LoadBalancer"}, r"islands\.a\.service_type is set, but only the coordinator"),
    ({"islands.a.storage": "lots"}, r"islands\.a\.storage is 'lots'; give a size such as 10Gi"),
    ({"islands.a.namespace": "Training"}, r"islands\.a\.namespace is 'Training'; give a Kubernetes namespace"),
    ({"islands.b.token_file": None}, r"islands\.b\.token_file is missing: the coordinator checks tokens"),
    ({"coordinator.resource": "nvidia.com/gpu"}, r"coordinator\.resource is set, but the coordinator uses no"),
    ({"repo": "island_jax"}, r"repo is 'island_jax'; on Kubernetes give the checkout's absolute path"),
    ({"coordinator.scheduler": "slurm", "islands.a.scheduler": "slurm", "islands.b.scheduler": "slurm",
      "coordinator.namespace": None, "coordinator.image": None, "islands.a.namespace": None, "islands.a.image": None,
      "islands.a.resource": None, "islands.a.storage_class": None, "islands.b.namespace": None,
      "islands.b.image": None, "islands.b.resource": None},
     r"no role of the cluster description has scheduler: k8s"),
])
def test_a_description_that_cannot_run_on_kubernetes_is_refused_naming_the_field(tmp_path, made, changes, message):
    with pytest.raises(cluster_lib.ClusterError, match=message):
        rendered(tmp_path, made, **changes)


def test_names_that_do_not_fit_kubernetes_are_refused(tmp_path, made):
    config = gpu_config()
    cluster = cluster_lib.load(description(tmp_path, made), config)
    with pytest.raises(cluster_lib.ClusterError, match=r"more than 52 .* give a shorter --workdir folder name"):
        k8s.render(config, cluster, CONFIG_ARGS, "/runs/" + "x" * 40)
    with pytest.raises(cluster_lib.ClusterError, match=r"--workdir=/: its last folder names the run"):
        k8s.render(config, cluster, CONFIG_ARGS, "/")
    assert k8s.names(cluster, "/runs/My_Run.2").coordinator == "ij-my-run-2-coordinator"


@pytest.mark.slow  # starts the launcher's process twice
def test_the_command_prints_with_dry_run_and_otherwise_writes_and_applies(tmp_path, made):
    path = description(tmp_path, made)
    common = [sys.executable, os.path.join(ROOT, "launch", "k8s.py"), f"--cluster={path}", *CONFIG_ARGS]
    dry = subprocess.run([*common, f"--workdir={WORKDIR}", "--dry_run"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    config = gpu_config()
    assert list(yaml.safe_load_all(dry.stdout)) == k8s.render(config, cluster_lib.load(path, config), CONFIG_ARGS,
                                                              WORKDIR)
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/kubectl.args\n')
    kubectl.chmod(0o755)
    workdir = tmp_path / "run"
    done = subprocess.run([*common, f"--workdir={workdir}", f"--kubectl={kubectl}"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    written = workdir / "launch" / "k8s.yaml"
    assert (tmp_path / "kubectl.args").read_text().split() == ["apply", "-f", str(written)]
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(written.read_text())][0] == "ij-run-coordinator"
    bad = description(tmp_path, made, **{"coordinator.image": None})
    failed = subprocess.run([*common[:2], f"--cluster={bad}", *CONFIG_ARGS, f"--workdir={WORKDIR}", "--dry_run"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.strip() == (f"--cluster={bad}: coordinator.image is missing; give the container image with "
                                     "island_jax installed")


# -- island_jax/health.py: the coordinator's probe ------------------------------------------------------------------


@pytest.fixture
def tls_coordinator(tmp_path):
    """The coordinator's real gRPC server with mutual TLS and tokens on a free port: (port, credentials made)."""
    made = security.make_run_credentials(str(tmp_path / "secrets"), ["a", "b"], ["coord.example.org"])
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.comm.tls.update(cert_file=made["cert_file"], key_file=made["key_file"], ca_file=made["ca_file"],
                      require_client_cert=True)
    coordinator = Coordinator(c, {"w": np.zeros(16, np.float32)}, ["a", "b"])
    server, _, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes, tls=c.comm.tls,
                            tokens_file=made["tokens_file"])
    yield port, made
    server.stop(grace=0)


def _probe_args(port, made, **changes):
    """The probe's arguments as launch/k8s.py renders them (127.0.0.1, the certificate checked for the host of
    coordinator.addresses), with the run's files."""
    args = {"address": f"127.0.0.1:{port}", "ca_file": made["ca_file"], "client_cert_file": made["client_cert_file"],
            "client_key_file": made["client_key_file"], "server_name": "coord.example.org", "timeout_seconds": "5"}
    args.update(changes)
    return [f"--{k}={v}" for k, v in args.items() if v is not None]


def test_the_health_check_passes_against_the_coordinator_over_mutual_tls(tls_coordinator, capsys):
    port, made = tls_coordinator
    assert health.main(_probe_args(port, made)) == 0
    assert capsys.readouterr().out == f"127.0.0.1:{port}: SERVING\n"
    assert health.check(f"localhost:{port}", ca_file=made["ca_file"], client_cert_file=made["client_cert_file"],
                        client_key_file=made["client_key_file"], service=SERVICE_NAME) == "SERVING"
    assert health.main([*_probe_args(port, made), "--service=no.such.Service"]) == 1
    assert "the health service knows no service 'no.such.Service' (NOT_FOUND)" in capsys.readouterr().err


def test_the_health_check_fails_without_the_client_certificate_or_with_a_wrong_server_name(tls_coordinator, capsys):
    port, made = tls_coordinator
    assert health.main(_probe_args(port, made, client_cert_file=None, client_key_file=None)) == 1
    assert f"health check failed: 127.0.0.1:{port}: cannot connect" in capsys.readouterr().err
    assert health.main(_probe_args(port, made, server_name="elsewhere.example.org")) == 1
    assert "do the CA, client certificate and server name match its certificate?" in capsys.readouterr().err


def test_the_health_check_fails_against_a_closed_port_or_unreadable_files(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    assert health.main([f"--address=127.0.0.1:{port}", "--timeout_seconds=5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"health check failed: 127.0.0.1:{port}: cannot connect (") and "plaintext" in err
    assert health.main([f"--address=127.0.0.1:{port}", f"--ca_file={tmp_path}/missing.pem"]) == 1
    assert "cannot use the TLS files: comm.tls.ca_file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        health.main(["--address=127.0.0.1:1", "--timeout_seconds=0"])
    assert exit_.value.code == 2


def sharded(tmp_path, made, **changes):
    """The description with a coordinator of two shards (their Services on ports 50051 and 50052)."""
    config = gpu_config()
    apply_override(config, "coordinator.shards", 2)
    changes = {"coordinator.addresses": ["coord.example.org:50051", "coord.example.org:50052"], **changes}
    return config, cluster_lib.load(description(tmp_path, made, **changes), config)


def test_a_coordinator_of_two_shards_is_an_indexed_job_with_a_service_per_shard(tmp_path, made):
    config, cluster = sharded(tmp_path, made, **{"coordinator.service_type": "LoadBalancer"})
    docs = k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)
    assert [(d["kind"], d["metadata"]["name"]) for d in docs][:5] == [
        ("Service", "ij-two-islands-coordinator-0"), ("Service", "ij-two-islands-coordinator-1"),
        ("Service", "ij-two-islands-coordinator-pods"), ("PersistentVolumeClaim", "ij-two-islands-coordinator-workdir"),
        ("Job", "ij-two-islands-coordinator")]
    assert "StatefulSet" not in [d["kind"] for d in docs]
    job = by_kind(docs, "Job", "ij-two-islands-coordinator")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert {k: spec[k] for k in ("completionMode", "completions", "parallelism", "backoffLimit")} == {
        "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0}
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "ij-two-islands-coordinator-pods"
    (c,) = pod["containers"]
    assert c["args"][c["args"].index(f"--workdir={WORKDIR}"):] == [
        f"--workdir={WORKDIR}", "--coordinator=0.0.0.0:50051,0.0.0.0:50051", "--role=coordinator",
        "--config.comm.tls.ca_file=/etc/island-jax/tls/ca.pem",
        "--config.comm.tls.cert_file=/etc/island-jax/coordinator/server.pem",
        "--config.comm.tls.key_file=/etc/island-jax/coordinator/server.key",
        "--config.comm.tls.require_client_cert=True",
        "--config.comm.auth.tokens_file=/etc/island-jax/coordinator/tokens.json",
        "--shard_service=ij-two-islands-coordinator-0.ij-two-islands-coordinator-pods.training.svc.cluster.local:8477",
        "--shard=$(JOB_COMPLETION_INDEX)"]
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                          {"name": "jax", "containerPort": 8477, "protocol": "TCP"}]
    assert c["readinessProbe"]["exec"]["command"] == PROBE
    assert pod["volumes"][0] == {"name": "workdir",
                                 "persistentVolumeClaim": {"claimName": "ij-two-islands-coordinator-workdir"}}
    for k, port in ((0, 50051), (1, 50052)):
        assert by_kind(docs, "Service", f"ij-two-islands-coordinator-{k}")["spec"] == {
            "type": "LoadBalancer", "selector": {**labels, "batch.kubernetes.io/job-completion-index": str(k)},
            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}]}
    assert by_kind(docs, "Service", "ij-two-islands-coordinator-pods")["spec"] == {
        "clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
        "ports": [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"},
                  {"name": "jax", "port": 8477, "targetPort": "jax", "protocol": "TCP"}]}
    assert by_kind(docs, "PersistentVolumeClaim", "ij-two-islands-coordinator-workdir")["spec"]["accessModes"] == [
        "ReadWriteMany"]
    for name in ("a", "b"):  # every island dials every shard's Service, one name checked for all
        args = containers(docs)[name]["args"]
        assert ("--coordinator=ij-two-islands-coordinator-0.training.svc.cluster.local:50051,"
                "ij-two-islands-coordinator-1.training.svc.cluster.local:50052") in args
        assert "--config.comm.tls.server_name=coord.example.org" in args
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == "1.30"
    head = k8s.header(cluster, WORKDIR)
    assert "# The coordinator's 2 shards are one Indexed Job, which fails as a whole when one pod fails\n" in head
    assert "#   kubectl delete job --namespace=training ij-two-islands-coordinator\n" in head


def test_shards_on_kubernetes_with_hosts_that_differ_need_one_server_name(tmp_path, made):
    addresses = ["c0.example.org:50051", "c1.example.org:50051"]
    config, cluster = sharded(tmp_path, made, **{"coordinator.addresses": addresses})
    with pytest.raises(cluster_lib.ClusterError, match=r"coordinator\.server_name is missing: islands in the cluster "
                                                       r"dial each shard's Service and check one name for all 2 shards"):
        k8s.render(config, cluster, CONFIG_ARGS, WORKDIR)
    config, cluster = sharded(tmp_path, made, **{"coordinator.addresses": addresses,
                                                 "coordinator.server_name": "coordinator.island-jax"})
    args = containers(k8s.render(config, cluster, CONFIG_ARGS, WORKDIR))["a"]["args"]
    assert "--config.comm.tls.server_name=coordinator.island-jax" in args
