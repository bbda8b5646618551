"""launch/tpu_vm.py: the gcloud script of a run's TPU VM islands, read and run against a fake gcloud (no cloud)."""

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest
import yaml
from launchers import changed, launcher

from island_jax import cluster as cluster_lib
from island_jax.experiment import apply_override, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tpu_vm = launcher("tpu_vm")

# two_islands with island b on a v4-16 slice: 8 chips on 2 hosts, one process each
OVERRIDES = {
    "islands.b.num_devices": 8, "islands.b.mesh.data": 4, "islands.b.num_processes": 2,
    "islands.b.hardware": "tpu-v4", "islands.b.batch_size": 8,
}
CONFIG_ARGS = ["--config=experiments/configs/two_islands.py", *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]
WORKER0_IP = "10.164.0.3"
TLS = ["--config.comm.tls.ca_file=/secrets/ca.pem", "--config.comm.tls.client_cert_file=/secrets/client.pem",
       "--config.comm.tls.client_key_file=/secrets/client.key"]


def tpu_config(**more):
    config = load_config("experiments/configs/two_islands.py")
    for key, value in {**OVERRIDES, **more}.items():
        apply_override(config, key, value)
    return config


def description(**changes):
    """The coordinator on a CPU VM, island a on SLURM, island b on a two-worker TPU VM; `changes` as
    {"dotted.path": value} (None deletes)."""
    raw = {
        "coordinator": {"scheduler": "tpu_vm", "vm": "coord-vm", "zone": "us-central1-a", "project": "proj",
                        "addresses": ["10.128.0.5:50051"], "cert_file": "/secrets/server.pem",
                        "key_file": "/secrets/server.key", "tokens_file": "/secrets/tokens.json"},
        "islands": {
            "a": {"scheduler": "slurm", "nodes": 1, "devices_per_node": 4, "partition": "gpu",
                  "token_file": "/secrets/token_a"},
            "b": {"scheduler": "tpu_vm", "tpu": "island-b", "zone": "europe-west4-a", "project": "proj",
                  "accelerator_type": "v4-16", "token_file": "/secrets/token_b",
                  "env": {"NOTE": "it's \"quoted\" $HOME"}},
        },
        "tls": {"ca_file": "/secrets/ca.pem", "client_cert_file": "/secrets/client.pem",
                "client_key_file": "/secrets/client.key"},
        "repo": "/srv/island_jax",
        "island_port": 8477,
    }
    return changed(raw, changes)


def load(tmp_path, raw, config):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return cluster_lib.load(str(path), config)


def ssh_calls(lines):
    """[(the words of each `gcloud ... ssh` that starts a role, before --command), its remote command]."""
    found = []
    for line in lines:
        if " ssh " not in line or not line.endswith(" &"):
            continue
        words = shlex.split(line)
        words = words[:words.index("||")]
        assert words[-1].startswith("--command=")
        found.append((words[:-1], words[-1][len("--command="):]))
    return found


def python_argv(remote):
    """The interpreter's argv in a remote command: after `nohup [env VAR=V ...]`, up to the `<` redirection."""
    words = shlex.split(remote)
    start = words.index("nohup") + 1
    if words[start] == "env":
        start += 1
        while "=" in words[start] and not words[start].startswith("-"):
            start += 1
    return words[start:words.index("<", start)]


def expected_coordinator(workdir):
    return ["-u", "experiments/train.py", *CONFIG_ARGS, f"--workdir={workdir}", "--coordinator=0.0.0.0:50051",
            "--role=coordinator", TLS[0], "--config.comm.tls.cert_file=/secrets/server.pem",
            "--config.comm.tls.key_file=/secrets/server.key", "--config.comm.tls.require_client_cert=True",
            "--config.comm.auth.tokens_file=/secrets/tokens.json"]


def expected_worker(workdir, worker, ip):
    return ["-u", "experiments/train.py", *CONFIG_ARGS, f"--workdir={workdir}", "--coordinator=10.128.0.5:50051",
            "--role=island", "--island=b", *TLS, "--config.comm.auth.token_file=/secrets/token_b",
            f"--process_id={worker}", f"--island_coordinator={ip}:8477"]


def test_one_ssh_per_worker_with_its_process_id_and_worker_0s_address(tmp_path):
    config = tpu_config()
    lines = tpu_vm.render(config, load(tmp_path, description(), config), CONFIG_ARGS, "/shared/runs/tpu")
    assert lines[:3] == ["#!/bin/bash", "# island_jax: coordinator, b on Cloud VMs, rendered by launch/tpu_vm.py",
                         "# Not started here (their own launcher or job): a (slurm)"]
    describe = [line for line in lines if line.startswith("IJ_")]
    assert [line.split(" || ")[0] for line in describe] == [
        "IJ_WORKER0_b=$(gcloud compute tpus tpu-vm describe island-b --zone=europe-west4-a --project=proj "
        "--format='value(networkEndpoints[0].ipAddress)')"]
    calls = ssh_calls(lines)
    assert [words for words, _ in calls] == [
        ["gcloud", "compute", "ssh", "coord-vm", "--zone=us-central1-a", "--project=proj"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "island-b", "--zone=europe-west4-a", "--project=proj",
         "--worker=0"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "island-b", "--zone=europe-west4-a", "--project=proj",
         "--worker=1"],
    ]
    (_, coordinator), (_, worker0), (_, worker1) = calls
    assert python_argv(coordinator) == ["python3", *expected_coordinator("/shared/runs/tpu")]
    # The IP stays a shell expansion of this machine's until the script runs (shlex does not expand it).
    assert python_argv(worker0) == ["python3", *expected_worker("/shared/runs/tpu", 0, "${IJ_WORKER0_b}")]
    assert python_argv(worker1) == ["python3", *expected_worker("/shared/runs/tpu", 1, "${IJ_WORKER0_b}")]
    for remote, name in ((coordinator, "coordinator"), (worker0, "b-0"), (worker1, "b-1")):
        assert remote.startswith("cd /srv/island_jax && mkdir -p /shared/runs/tpu/launch && ")
        assert f">> /shared/runs/tpu/launch/{name}.log 2>&1 & echo $! > /shared/runs/tpu/launch/{name}.pid" \
            in remote
    assert "env NOTE='it'\"'\"'s \"quoted\" $HOME' python3 " in worker0  # the VM's shell sees the value literally
    subprocess.run(["bash", "-n"], input="\n".join(lines) + "\n", text=True, check=True)


def test_every_role_gets_the_same_config_and_overrides(tmp_path):
    config = tpu_config()
    lines = tpu_vm.render(config, load(tmp_path, description(), config), CONFIG_ARGS, "/shared/runs/tpu")
    for _, remote in ssh_calls(lines):
        argv = python_argv(remote)
        assert [a for a in argv if a.startswith(("--config=", "--config.islands."))] == CONFIG_ARGS


def test_single_host_islands_get_no_process_flags_and_no_lookup(tmp_path):
    config = tpu_config(**{"islands.a.hardware": "tpu-v6e"})
    raw = description(**{
        "coordinator": {"scheduler": "slurm", "addresses": ["coord.example.org:50051"], "insecure": True},
        "islands.a": {"scheduler": "tpu_vm", "tpu": "island-a", "zone": "us-east5-b", "accelerator_type": "v6e-4"}})
    lines = tpu_vm.render(config, load(tmp_path, raw, config), CONFIG_ARGS, "runs/tpu", gcloud="/opt/gc --quiet")
    assert lines[2] == "# Not started here (their own launcher or job): coordinator (slurm)"
    calls = ssh_calls(lines)
    assert [words[-1] for words, _ in calls] == ["--worker=0", "--worker=0", "--worker=1"]
    assert calls[0][0][:7] == ["/opt/gc", "--quiet", "compute", "tpus", "tpu-vm", "ssh", "island-a"]
    a = python_argv(calls[0][1])
    assert a[a.index("--role=island"):] == ["--role=island", "--island=a", *TLS]
    assert "--coordinator=coord.example.org:50051" in a and "--workdir=runs/tpu" in a
    assert "/srv/island_jax/runs/tpu/launch/a-0.log" in calls[0][1]  # a relative workdir is under the repo
    assert [line.split("=")[0] for line in lines if line.startswith("IJ_")] == ["IJ_WORKER0_b"]
    assert sum("--worker=all" in line for line in lines) == 2  # the pre-flight check of each TPU VM
    subprocess.run(["bash", "-n"], input="\n".join(lines) + "\n", text=True, check=True)


@pytest.mark.parametrize("changes, more, message", [
    ({"islands.b.accelerator_type": "v5litepod-16"}, {},
     r"islands\.b\.num_devices is 8 but islands\.b\.accelerator_type v5litepod-16 has 16 devices \(chips\); set "
     r"--config\.islands\.b\.num_devices=16"),
    ({"islands.b.accelerator_type": "v5litepod-8"}, {},
     r"islands\.b\.num_processes is 2 but islands\.b\.accelerator_type v5litepod-8 has 1 host\(s\), one process "
     r"each; set --config\.islands\.b\.num_processes=1"),
    ({"islands.b.accelerator_type": "v4-32"}, {"islands.b.num_devices": 16, "islands.b.mesh.data": 8,
                                               "islands.b.batch_size": 16},
     r"islands\.b\.num_processes is 2 but islands\.b\.accelerator_type v4-32 has 4 host\(s\)"),
    ({"islands.a.devices_per_node": 8}, {},
     r"islands\.a: 1 node\(s\) x devices_per_node 8 = 8 devices, but islands\.a\.num_devices is 4"),
    ({"islands.b.zone": None}, {}, r"islands\.b\.zone is missing"),
    ({"coordinator.addresses": ["auto:50051"]}, {}, r"coordinator\.addresses uses 'auto'"),
])
def test_a_description_that_cannot_launch_fails_before_rendering_naming_the_field(tmp_path, changes, more, message):
    config = tpu_config(**more)
    with pytest.raises(cluster_lib.ClusterError, match=message):
        cluster_lib.check(config, description(**changes))
    with pytest.raises(cluster_lib.ClusterError, match=r"--cluster=.*cluster\.yaml: " + message):
        load(tmp_path, description(**changes), config)


@pytest.mark.parametrize("changes, message", [
    ({"coordinator.vm": None}, r"coordinator\.vm is missing; give the coordinator's CPU VM name"),
    ({"coordinator.zone": None}, r"coordinator\.zone is missing"),
    ({"islands.b.env": {"TWO WORDS": "x"}}, r"islands\.b\.env is \{'TWO WORDS': 'x'\}; give a mapping of environment variable names"),
    ({"coordinator.scheduler": "slurm", "coordinator.vm": None, "coordinator.zone": None, "coordinator.project": None,
      "islands.b": {"scheduler": "slurm", "nodes": 2, "devices_per_node": 4, "token_file": "/secrets/token_b"}},
     r"islands\.b\.hardware is tpu-v4 but islands\.b\.scheduler is slurm; TPU slices are started with scheduler: "
     r"tpu_vm"),
])
def test_what_only_the_tpu_vm_launcher_needs_fails_naming_the_field(changes, message):
    config = tpu_config()
    with pytest.raises(cluster_lib.ClusterError, match=message):
        tpu_vm.render(config, cluster_lib.check(config, description(**changes)), CONFIG_ARGS, "/w")


def test_config_args_join_flags_given_as_two_items():
    assert cluster_lib.config_args([
        "--cluster=c.yaml", "--config", "experiments/configs/two_islands.py", "--config.islands.b.batch_size", "8",
        "--config.outer.rounds=3", "--config.eval.noenabled", "--dry_run", "--workdir=/w"]) == [
        "--config=experiments/configs/two_islands.py", "--config.islands.b.batch_size=8", "--config.outer.rounds=3",
        "--config.eval.noenabled"]


# ---- the rendered script, run against a fake gcloud that runs each remote command in a local shell

FAKE_GCLOUD = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if "describe" in args:
    answer = os.environ.get("FAKE_DESCRIBE", "{ip}")
    if answer == "FAIL":
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND")
    print(answer)
    sys.exit(0)
command = [a for a in args if a.startswith("--command=")][0][len("--command="):]
sys.exit(subprocess.run(["sh", "-c", command]).returncode)
"""

FAKE_PYTHON = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args == ["-P", "-c", "import island_jax"]:  # the pre-flight: island_jax installed, not found in the checkout
    sys.exit(1 if os.environ.get("FAKE_NO_PACKAGE") else 0)
flag = lambda name: next((a.split("=", 1)[1] for a in args if a.startswith(name + "=")), None)
name = "coordinator" if "--role=coordinator" in args else flag("--island") + "-" + (flag("--process_id") or "0")
with open(os.path.join(os.environ["FAKE_RECORDS"], name + ".json"), "w") as f:
    json.dump(dict(argv=args, pid=os.getpid(), cwd=os.getcwd(), note=os.environ.get("NOTE")), f)
print("output of", name)
sys.exit(3 if os.environ.get("FAKE_FAIL") == name else 0)
"""


def _executable(path, text):
    path.write_text(text.replace("{python}", sys.executable).replace("{ip}", WORKER0_IP))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake(tmp_path):
    """(a description whose python is a recording fake and whose repo is a local folder, the workdir, the
    environment with a fake gcloud first on PATH, the calls file, the records folder)."""
    bin_dir, records, repo = tmp_path / "bin", tmp_path / "records", tmp_path / "repo"
    for d in (bin_dir, records, repo):
        d.mkdir()
    _executable(bin_dir / "gcloud", FAKE_GCLOUD)
    python = _executable(bin_dir / "fake-python", FAKE_PYTHON)
    calls = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_CALLS=str(calls),
               FAKE_RECORDS=str(records))
    raw = description(python=python, repo=str(repo))
    return raw, str(tmp_path / "run"), env, calls, records


def run_script(tmp_path, raw, workdir, env):
    config = tpu_config()
    script = "\n".join(tpu_vm.render(config, load(tmp_path, raw, config), CONFIG_ARGS, workdir)) + "\n"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_the_script_runs_each_worker_with_worker_0s_ip_spliced_in(tmp_path, fake):
    raw, workdir, env, calls, records = fake
    done = run_script(tmp_path, raw, workdir, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "island_jax: every role started here has finished\n"
    calls = [json.loads(line) for line in calls.read_text().splitlines()]
    gcloud = [[a for a in call if not a.startswith("--command=")] for call in calls]
    describe = ["compute", "tpus", "tpu-vm", "describe", "island-b", "--zone=europe-west4-a", "--project=proj",
                "--format=value(networkEndpoints[0].ipAddress)"]
    preflight = [["compute", "ssh", "coord-vm", "--zone=us-central1-a", "--project=proj"],
                 ["compute", "tpus", "tpu-vm", "ssh", "island-b", "--zone=europe-west4-a", "--project=proj",
                  "--worker=all"]]
    roles = [["compute", "ssh", "coord-vm", "--zone=us-central1-a", "--project=proj"],
             *(["compute", "tpus", "tpu-vm", "ssh", "island-b", "--zone=europe-west4-a", "--project=proj",
                f"--worker={w}"] for w in (0, 1))]
    assert gcloud[:3] == [describe, *preflight]  # in this order, before any role starts
    assert sorted(gcloud[3:]) == sorted(roles)  # then all at once
    ran = {p.name[:-len(".json")]: json.loads(p.read_text()) for p in records.iterdir()}
    assert sorted(ran) == ["b-0", "b-1", "coordinator"]
    assert ran["coordinator"]["argv"] == expected_coordinator(workdir)
    for worker in (0, 1):
        record = ran[f"b-{worker}"]
        assert record["argv"] == expected_worker(workdir, worker, WORKER0_IP)
        assert record["cwd"] == raw["repo"]
        assert record["note"] == "it's \"quoted\" $HOME"
    for name, record in ran.items():
        with open(os.path.join(workdir, "launch", f"{name}.pid")) as f:
            assert int(f.read()) == record["pid"]  # $! expanded on the "VM", not here
        log = open(os.path.join(workdir, "launch", f"{name}.log")).read().splitlines()
        assert re.fullmatch(rf"---- island_jax {name} started \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ", log[0])
        assert log[1:] == [f"output of {name}"]
    # A second launch appends to the logs.
    assert run_script(tmp_path, raw, workdir, env).returncode == 0
    assert len(open(os.path.join(workdir, "launch", "b-1.log")).read().splitlines()) == 4


def test_a_failed_worker_is_named_and_its_status_is_the_scripts(tmp_path, fake):
    raw, workdir, env, calls, records = fake
    done = run_script(tmp_path, raw, workdir, dict(env, FAKE_FAIL="b-1"))
    assert done.returncode == 3
    assert f"island_jax: b/1 exited with status 3; its log is {workdir}/launch/b-1.log on its VM" in done.stderr
    assert "island_jax: a role failed (above)" in done.stderr
    assert sorted(p.name for p in records.iterdir()) == ["b-0.json", "b-1.json", "coordinator.json"]


@pytest.mark.parametrize("setting, message", [
    ({"FAKE_DESCRIBE": "FAIL"}, "island_jax: could not describe TPU VM island-b (islands.b.tpu) in zone "
                                "europe-west4-a; check the name, zone and project"),
    ({"FAKE_DESCRIBE": ""}, "island_jax: TPU VM island-b (islands.b.tpu) in zone europe-west4-a gave '' as the "
                            "internal IP of worker 0, not an IPv4 address; is it READY?"),
    ({"FAKE_DESCRIBE": "10.0.0.1; rm -rf ~"}, "gave '10.0.0.1; rm -rf ~' as the internal IP of worker 0"),
    ({"FAKE_NO_PACKAGE": "1"}, "with island_jax in"),
    ({"FAKE_NO_PACKAGE": "1"}, "the error is above. Every VM needs the checkout and island_jax installed from it: "
                               "cd {repo} && {python} -m pip install -e ."),
])
def test_a_failed_lookup_or_check_ends_the_script_before_any_role_starts(tmp_path, fake, setting, message):
    raw, workdir, env, calls, records = fake
    done = run_script(tmp_path, raw, workdir, dict(env, **setting))
    assert done.returncode == 1
    assert message.format(repo=raw["repo"], python=raw["python"]) in done.stderr
    assert list(records.iterdir()) == []
    if "FAKE_NO_PACKAGE" in setting:  # the first VM checked fails: nothing more is tried
        assert [c[:2] for c in map(json.loads, calls.read_text().splitlines())] == [["compute", "tpus"],
                                                                                   ["compute", "ssh"]]


@pytest.mark.slow  # starts the launcher
def test_the_launcher_prints_the_script_or_runs_it_with_the_gcloud_given(tmp_path, fake):
    raw, workdir, env, calls, records = fake
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    base = [sys.executable, "launch/tpu_vm.py", f"--cluster={path}", f"--workdir={workdir}", *CONFIG_ARGS]
    env = dict(env, JAX_PLATFORMS="cpu")
    done = subprocess.run([*base, "--dry_run"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    config = tpu_config()
    assert done.stdout == "\n".join(tpu_vm.render(config, cluster_lib.check(config, raw), CONFIG_ARGS, workdir)) + "\n"
    assert not calls.exists()
    env = dict(env, PATH=os.environ["PATH"], FAKE_FAIL="coordinator")  # the fake found by --gcloud, not on PATH
    done = subprocess.run([*base, f"--gcloud={tmp_path / 'bin' / 'gcloud'}"], cwd=ROOT, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 1
    assert "island_jax: coordinator exited with status 3" in done.stderr
    assert "[tpu_vm] the launch ended with status 3" in done.stderr
    path.write_text(yaml.safe_dump(description(**{"islands.b.accelerator_type": "v5litepod-16"})))
    done = subprocess.run([*base, "--dry_run"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "islands.b.num_devices is 8 but islands.b.accelerator_type v5litepod-16" \
        in done.stderr


def test_ssh_flags_reach_every_ssh_line_of_their_role(tmp_path):
    config = tpu_config()
    raw = description(**{"islands.b.ssh_flags": ["--internal-ip"], "coordinator.ssh_flags": ["--tunnel-through-iap"]})
    calls = ssh_calls(tpu_vm.render(config, load(tmp_path, raw, config), CONFIG_ARGS, "/srv/runs/tpu"))
    assert [words[5] if words[2] == "tpus" else words[3] for words, _ in calls] == ["coord-vm", "island-b", "island-b"]
    for words, _ in calls:
        assert ("--internal-ip" in words) == (words[2] == "tpus")
        assert ("--tunnel-through-iap" in words) == (words[2] != "tpus")


def expected_shard(workdir, k, listen, service):
    return ["-u", "experiments/train.py", *CONFIG_ARGS, "--config.coordinator.shards=2", f"--workdir={workdir}",
            f"--coordinator={listen}", "--role=coordinator", TLS[0], "--config.comm.tls.cert_file=/secrets/server.pem",
            "--config.comm.tls.key_file=/secrets/server.key", "--config.comm.tls.require_client_cert=True",
            "--config.comm.auth.tokens_file=/secrets/tokens.json", f"--shard={k}", f"--shard_service={service}"]


def test_two_shards_on_one_vm_are_two_sessions_there_at_their_own_ports(tmp_path):
    config = tpu_config(**{"coordinator.shards": 2})
    raw = description(**{"coordinator.addresses": ["10.128.0.5:50051", "10.128.0.5:50052"]})
    lines = tpu_vm.render(config, load(tmp_path, raw, config), [*CONFIG_ARGS, "--config.coordinator.shards=2"],
                          "/shared/runs/tpu")
    calls = ssh_calls(lines)
    assert [words[3] for words, _ in calls[:2]] == ["coord-vm", "coord-vm"]
    for k in (0, 1):
        remote = calls[k][1]
        assert python_argv(remote) == ["python3", *expected_shard("/shared/runs/tpu", k, "0.0.0.0:50051,0.0.0.0:50052",
                                                                 "localhost:8477")]
        assert f">> /shared/runs/tpu/launch/coordinator-{k}.log 2>&1" in remote
    for _, remote in calls[2:]:  # island b's workers dial both shards
        assert "--coordinator=10.128.0.5:50051,10.128.0.5:50052" in python_argv(remote)
    assert [line.split("=")[0] for line in lines if line.startswith("IJ_")] == ["IJ_WORKER0_b"]  # no VM looked up
    assert sum(" compute ssh coord-vm " in line and "import island_jax" in line for line in lines) == 1
    assert any(line.endswith("|| failed coordinator/1 $? /shared/runs/tpu/launch/coordinator-1.log &") for line in lines)
    subprocess.run(["bash", "-n"], input="\n".join(lines) + "\n", text=True, check=True)


def test_two_shards_on_two_vms_find_shard_0_at_its_internal_ip(tmp_path):
    config = tpu_config(**{"coordinator.shards": 2})
    raw = description(**{"coordinator.addresses": ["10.128.0.5:50051", "10.128.0.6:50051"],
                         "coordinator.vm": ["coord-0", "coord-1"], "coordinator.shard_port": 9000})
    lines = tpu_vm.render(config, load(tmp_path, raw, config), [*CONFIG_ARGS, "--config.coordinator.shards=2"],
                          "/shared/runs/tpu")
    lookup = [line for line in lines if line.startswith("IJ_SHARD0_IP=")]
    assert [line.split(" || ")[0] for line in lookup] == [
        "IJ_SHARD0_IP=$(gcloud compute instances describe coord-0 --zone=us-central1-a --project=proj "
        "--format='value(networkInterfaces[0].networkIP)')"]
    checks = [shlex.split(line)[3] for line in lines if " compute ssh " in line and "import island_jax" in line]
    assert checks == ["coord-0", "coord-1"]  # each VM checked before any role starts
    calls = ssh_calls(lines)
    assert [words[3] for words, _ in calls[:2]] == ["coord-0", "coord-1"]
    for k in (0, 1):  # the IP stays a shell expansion of this machine's until the script runs
        assert python_argv(calls[k][1]) == ["python3", *expected_shard(
            "/shared/runs/tpu", k, "0.0.0.0:50051,0.0.0.0:50051", "${IJ_SHARD0_IP}:9000")]
    assert "--coordinator=10.128.0.5:50051,10.128.0.6:50051" in python_argv(calls[2][1])
    subprocess.run(["bash", "-n"], input="\n".join(lines) + "\n", text=True, check=True)


@pytest.mark.parametrize("changes, message", [
    ({"coordinator.addresses": ["10.128.0.5:50051", "10.128.0.5:50051"]},
     r"coordinator\.addresses repeats port 50051, but the 2 shards share one host \(coordinator\.vm\)"),
    ({"coordinator.addresses": ["a:1", "b:1"], "coordinator.vm": ["v0", "v1", "v2"]},
     r"coordinator\.vm lists 3 VMs but coordinator\.shards is 2; give one VM \(every shard on it\) or 2, one per shard"),
    ({"coordinator.addresses": ["a:1", "b:1"], "coordinator.vm": ["v0", 7]},
     r"coordinator\.vm is \['v0', 7\]; give the CPU VM's name, or a list of names, one per coordinator shard"),
])
def test_shards_on_vms_that_cannot_hold_them_are_refused_naming_the_field(changes, message):
    with pytest.raises(cluster_lib.ClusterError, match=message):
        cluster_lib.check(tpu_config(**{"coordinator.shards": 2}), description(**changes))
