"""launch/slurm.py: the cluster description's checks, and the sbatch scripts rendered from it (no SLURM needed)."""

import os
import re
import shlex
import subprocess

import pytest
import yaml
from launchers import changed, launcher

from island_jax import cluster as cluster_lib
from island_jax.experiment import apply_override, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
slurm = launcher("slurm")

# two_islands on GPUs: island a on 2 nodes x 4 GPUs, island b on 1 node x 8 GPUs
OVERRIDES = {
    "islands.a.num_processes": 2, "islands.a.num_devices": 8, "islands.a.mesh.data": 4, "islands.a.hardware": "h100",
    "islands.b.num_devices": 8, "islands.b.mesh.data": 4, "islands.b.hardware": "h100", "islands.b.batch_size": 8,
}
CONFIG_ARGS = ["--config=experiments/configs/two_islands.py", *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def gpu_config():
    config = load_config("experiments/configs/two_islands.py")
    for key, value in OVERRIDES.items():
        apply_override(config, key, value)
    return config


def description(**changes):
    raw = {
        "coordinator": {"scheduler": "slurm", "addresses": ["auto:50051"], "partition": "cpu",
                        "server_name": "coordinator.island-jax",
                        "cert_file": "/secrets/server.pem", "key_file": "/secrets/server.key",
                        "tokens_file": "/secrets/tokens.json"},
        "islands": {
            "a": {"scheduler": "slurm", "nodes": 2, "devices_per_node": 4, "partition": "gpu", "account": "proj",
                  "token_file": "/secrets/token_a"},
            "b": {"scheduler": "slurm", "nodes": 1, "devices_per_node": 8, "partition": "gpu",
                  "token_file": "/secrets/token_b"},
        },
        "tls": {"ca_file": "/secrets/ca.pem", "client_cert_file": "/secrets/client.pem",
                "client_key_file": "/secrets/client.key"},
        "repo": "/shared/island_jax",
    }
    return changed(raw, changes)


def components(script: str) -> list[list[str]]:
    """The #SBATCH lines of each heterogeneous-job component."""
    parts = [[]]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            parts.append([])
        elif line.startswith("#SBATCH --") and not line.startswith(("#SBATCH --job-name", "#SBATCH --output")):
            parts[-1].append(line[len("#SBATCH "):])
    return parts


def srun_commands(script: str) -> dict[str, list[str]]:
    """{role: the argv of `experiments/train.py` its srun starts}."""
    found = {}
    for role, line in re.findall(r"^# (\S+)\n(srun .*) &$", script, flags=re.M):
        inner = shlex.split(line)[-1]  # bash -c '...'
        found[role] = shlex.split(inner)
    return found


def test_one_component_per_role_with_nodes_tasks_and_gpus():
    config = gpu_config()
    cluster = cluster_lib.check(config, description())
    (name, script), = slurm.render(config, cluster, CONFIG_ARGS, "/shared/runs/gpu").items()
    assert name == "slurm-job.sbatch"
    assert components(script) == [
        ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--partition=cpu"],
        ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--exclusive", "--mem=0", "--partition=gpu", "--account=proj",
         "--gres=gpu:4"],
        ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--exclusive", "--mem=0", "--partition=gpu",
         "--gres=gpu:8"],
    ]
    assert re.findall(r"^srun (--het-group=\d) --nodes=(\d) --ntasks=(\d)", script, flags=re.M) == [
        ("--het-group=0", "1", "1"), ("--het-group=1", "2", "2"), ("--het-group=2", "1", "1")]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_every_task_runs_train_py_with_the_same_config_and_overrides():
    config = gpu_config()
    script = slurm.render(config, cluster_lib.check(config, description()), CONFIG_ARGS, "/shared/runs/gpu")[
        "slurm-job.sbatch"]
    commands = srun_commands(script)
    assert list(commands) == ["coordinator", "a", "b"]
    for argv in commands.values():
        assert argv[:3] == ["python3", "-u", "experiments/train.py"]
        assert [a for a in argv if a.startswith("--config=") or re.match(r"--config\.islands\.", a)] == CONFIG_ARGS
        assert "--workdir=/shared/runs/gpu" in argv
    coordinator, a, b = commands["coordinator"], commands["a"], commands["b"]
    assert "--coordinator=0.0.0.0:50051" in coordinator and "--role=coordinator" in coordinator
    assert "--config.comm.auth.tokens_file=/secrets/tokens.json" in coordinator
    assert "--config.comm.tls.cert_file=/secrets/server.pem" in coordinator
    # island a, of two processes: index and island coordinator from the job, the run's coordinator by name
    assert a[a.index("--role=island"):] == [
        "--role=island", "--island=a", "--config.comm.tls.ca_file=/secrets/ca.pem",
        "--config.comm.tls.client_cert_file=/secrets/client.pem",
        "--config.comm.tls.client_key_file=/secrets/client.key",
        "--config.comm.tls.server_name=coordinator.island-jax", "--config.comm.auth.token_file=/secrets/token_a",
        "--coordinator=$IJ_COORDINATOR", "--process_id=$SLURM_PROCID", "--island_coordinator=$IJ_ISLAND_A"]
    assert b[b.index("--role=island"):][-2:] == ["--config.comm.auth.token_file=/secrets/token_b",
                                                 "--coordinator=$IJ_COORDINATOR"]
    lines = script.splitlines()
    found = lines.index('IJ_COORDINATOR_HOST="$(ij_first_address "$SLURM_JOB_NODELIST_HET_GROUP_0")"')
    assert lines[found + 1:found + 6] == [
        '[ -n "$IJ_COORDINATOR_HOST" ] || { echo "island_jax: no address for IJ_COORDINATOR in the node list" >&2; '
        'exit 1; }',
        'export IJ_COORDINATOR="$IJ_COORDINATOR_HOST:50051"',
        'IJ_ISLAND_A_HOST="$(ij_first_address "$SLURM_JOB_NODELIST_HET_GROUP_1")"',
        '[ -n "$IJ_ISLAND_A_HOST" ] || { echo "island_jax: no address for IJ_ISLAND_A in the node list" >&2; exit 1; }',
        'export IJ_ISLAND_A="$IJ_ISLAND_A_HOST:8476"']
    assert script.splitlines()[-1].startswith("python3 -u launch/summarize.py --config=experiments/configs/two_islands.py")


def test_islands_on_other_clusters_get_a_job_each_and_dial_the_given_address():
    config = gpu_config()
    raw = description(**{"coordinator.addresses": ["coord.example.org:50051"], "islands.b.cluster": "asia"})
    scripts = slurm.render(config, cluster_lib.check(config, raw), CONFIG_ARGS, "/shared/runs/gpu")
    assert list(scripts) == ["slurm-job.sbatch", "slurm-asia.sbatch"]
    home, asia = scripts["slurm-job.sbatch"], scripts["slurm-asia.sbatch"]
    assert [c[0] for c in components(home)] == ["--nodes=1", "--nodes=2"]
    assert components(asia) == [["--clusters=asia", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--exclusive",
                                 "--mem=0", "--partition=gpu", "--gres=gpu:8"]]
    assert "srun --nodes=1 --ntasks=1" in asia and "--het-group" not in asia
    for script, role in ((asia, "b"), (home, "a")):  # the address given reaches the islands through the job's env
        assert "export IJ_COORDINATOR=coord.example.org:50051" in script.splitlines()
        assert "--coordinator=$IJ_COORDINATOR" in srun_commands(script)[role]
    assert "summarize.py" not in home and "summarize.py" not in asia  # no job holds every role's folder
    for script in scripts.values():
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_auto_address_needs_every_island_in_the_coordinators_job():
    config = gpu_config()
    cluster = cluster_lib.check(config, description(**{"islands.b.cluster": "asia"}))
    with pytest.raises(cluster_lib.ClusterError, match=r"island b runs elsewhere; give the coordinator's reachable"):
        slurm.render(config, cluster, CONFIG_ARGS, "/w")


@pytest.mark.parametrize("changes, message", [
    ({"islands.a.devices_per_node": 8},
     r"islands\.a: 2 node\(s\) x devices_per_node 8 = 16 devices, but islands\.a\.num_devices is 8"),
    ({"islands.a.nodes": 1}, r"islands\.a\.nodes is 1 but islands\.a\.num_processes is 2"),
    ({"islands.b": {"scheduler": "tpu_vm", "tpu": "t", "zone": "z", "accelerator_type": "v5litepod-16"}},
     r"islands\.b\.num_devices is 8 but islands\.b\.accelerator_type v5litepod-16 has 16 devices"),
    ({"islands.b": {"scheduler": "tpu_vm", "tpu": "t", "zone": "z", "accelerator_type": "v4-16"}},
     r"islands\.b\.num_processes is 1 but islands\.b\.accelerator_type v4-16 has 2 host\(s\)"),
    ({"islands.b": {"scheduler": "tpu_vm", "tpu": "t", "zone": "z", "accelerator_type": "v5e-8x"}},
     r"accelerator_type is 'v5e-8x'; give a Cloud TPU type"),
    ({"islands.b.partiton": "gpu"}, r"islands\.b has partiton, which scheduler slurm does not take"),
    ({"islands.b": None}, r"islands\.b is missing from the cluster description"),
    ({"islands.c": {"scheduler": "slurm"}}, r"islands\.c is not an island of the config \(a, b\)"),
    ({"coordinator.scheduler": "pbs"}, r"coordinator\.scheduler is 'pbs'; use one of slurm, tpu_vm, k8s, local"),
    ({"coordinator.addresses": ["coordinator"]}, r"coordinator\.addresses has 'coordinator'; give HOST:PORT"),
    ({"coordinator.addresses": None}, r"coordinator\.addresses is missing"),
    ({"islands.b.scheduler": "k8s"}, r"islands\.b has partition, which scheduler k8s does not take"),
    ({"islands.a.time": 86400}, r"islands\.a\.time is 86400 \(int\); give a string; quote a time such as "
                                r"\"24:00:00\""),
    ({"islands.a.extra_sbatch": "--exclusive"}, r"islands\.a\.extra_sbatch is '--exclusive'; give a list"),
    ({"islands.a.devices_per_node": "four"}, r"islands\.a\.devices_per_node is 'four'; give a whole number"),
    ({"islands.a.exclusive": "no"}, r"islands\.a\.exclusive is 'no'; give true or false"),
    ({"coordinator.key_file": None}, r"coordinator\.key_file is missing: coordinator\.cert_file and "
                                     r"coordinator\.key_file go together"),
    ({"islands.b.token_file": None}, r"islands\.b\.token_file is missing: the coordinator checks tokens"),
    ({"coordinator.cert_file": None, "coordinator.key_file": None, "coordinator.tokens_file": None},
     r"coordinator\.cert_file, key_file and tokens_file are missing: a coordinator on a cluster listens on every "
     r"address of its node.*or set coordinator\.insecure: true"),
    ({"coordinator.server_name": None}, r"coordinator\.server_name is missing: with addresses auto:PORT the islands "
                                        r"dial whichever node the coordinator gets"),
    ({"islands.b": {"scheduler": "tpu_vm", "tpu": "t", "zone": "z", "accelerator_type": "v5e-8",
                    "token_file": "/secrets/token_b"}},
     r"islands\.b\.hardware is 'h100' but islands\.b\.accelerator_type v5e-8 is a tpu-v5e slice; set "
     r"--config\.islands\.b\.hardware=tpu-v5e"),
])
def test_a_description_that_cannot_launch_the_config_fails_naming_the_field(changes, message):
    with pytest.raises(cluster_lib.ClusterError, match=message):
        cluster_lib.check(gpu_config(), description(**changes))


def test_tpu_slice_types_count_tensorcores_on_v4_and_v5p_and_chips_on_v5e_and_v6e():
    assert [cluster_lib.tpu_topology(t) for t in ("v4-8", "v4-16", "v5p-32", "v5litepod-8", "v5litepod-16",
                                                   "v6e-4", "v6e-256")] == [
        (4, 1), (8, 2), (16, 4), (8, 1), (16, 4), (4, 1), (256, 64)]


def test_load_reads_yaml_and_names_the_file_in_errors(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(description()))
    cluster = cluster_lib.load(str(path), gpu_config())
    assert (cluster.addresses, cluster.islands["a"].nodes, cluster.islands["b"].devices_per_node) == (
        ["auto:50051"], 2, 8)
    path.write_text("coordinator: [unclosed")
    with pytest.raises(cluster_lib.ClusterError, match=rf"--cluster={re.escape(str(path))} is not valid YAML"):
        cluster_lib.load(str(path), gpu_config())
    with pytest.raises(cluster_lib.ClusterError, match=r"no such file; write the cluster description there"):
        cluster_lib.load(str(tmp_path / "absent.yaml"), gpu_config())


@pytest.mark.slow  # starts the launcher
def test_the_dry_run_prints_the_script_and_a_bad_description_exits_with_its_error(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(description()))
    base = ["python", "launch/slurm.py", f"--cluster={path}", "--workdir=/shared/runs/gpu", *CONFIG_ARGS]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([*base, "--dry_run"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# ---- slurm-job.sbatch\n#!/bin/bash\n")
    path.write_text(yaml.safe_dump(description(**{"islands.a.nodes": 3})))
    done = subprocess.run([*base, "--dry_run"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "islands.a.nodes is 3 but islands.a.num_processes is 2" in done.stderr


def test_two_clusters_island_a_under_slurm_and_island_b_on_a_tpu_vm_dial_one_coordinator():
    """docs/launch.md's mixed case: each launcher renders only its own roles, with the same config and overrides."""
    tpu_vm = launcher("tpu_vm")
    overrides = {**OVERRIDES, "islands.b.num_processes": 2, "islands.b.hardware": "tpu-v4"}
    config_args = ["--config=experiments/configs/two_islands.py", *(f"--config.{k}={v}" for k, v in overrides.items())]
    config = load_config("experiments/configs/two_islands.py")
    for key, value in overrides.items():
        apply_override(config, key, value)
    raw = description(**{
        "coordinator": {"scheduler": "tpu_vm", "vm": "coord-vm", "zone": "us-central1-a",
                        "addresses": ["coord.example.org:50051"], "cert_file": "/secrets/server.pem",
                        "key_file": "/secrets/server.key", "tokens_file": "/secrets/tokens.json"},
        "islands.b": {"scheduler": "tpu_vm", "tpu": "island-b", "zone": "europe-west4-a", "accelerator_type": "v4-16",
                      "token_file": "/secrets/token_b"}})
    cluster = cluster_lib.check(config, raw)
    (name, script), = slurm.render(config, cluster, config_args, "/shared/runs/x").items()
    assert name == "slurm-job.sbatch" and "hetjob" not in script
    assert "# Not in this job (started by their own launcher or job): coordinator, b" in script.splitlines()
    assert components(script) == [["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--exclusive", "--mem=0",
                                   "--partition=gpu", "--account=proj", "--gres=gpu:4"]]
    (a,) = srun_commands(script).values()
    assert "--coordinator=$IJ_COORDINATOR" in a and a[-2:] == [
        "--process_id=$SLURM_PROCID", "--island_coordinator=$IJ_ISLAND_A"]
    lines = tpu_vm.render(config, cluster, config_args, "/srv/runs/x")
    starts = [line for line in lines if "experiments/train.py" in line]
    assert len(starts) == 3  # the coordinator's VM and island b's two workers, nothing for island a
    for line in starts:
        assert all(f" {arg} " in line for arg in config_args), line
    assert sum("--coordinator=coord.example.org:50051" in line for line in starts) == 2
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("failing, status", [(None, 0), (2, 3)])
def test_the_job_ends_with_the_first_failed_roles_status_and_stops_the_others(tmp_path, failing, status):
    """The rendered script run with stand-ins for srun and scontrol: every role exits 0 (the job too, then
    summarize), or island b's exits 3 while the others would run on, which ends the job with 3 at once."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/bash\nif [ "$2" = hostnames ]; then echo n0; else '
                                   'echo "NodeName=n0 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=n0"; fi\n')
    # srun --het-group=K ...: component K's role; the failing one exits 3, the others run 0.2 s (or 60 s)
    long = 60 if failing is not None else 0.2
    (bin_ / "srun").write_text(
        f'#!/bin/bash\ngroup="${{1#--het-group=}}"\necho "started $group" >> {tmp_path}/started\n'
        f'if [ "$group" = "{failing}" ]; then sleep 0.2; exit 3; fi\nexec sleep {long}\n')
    (bin_ / "python3").write_text(f"#!/bin/bash\necho summarize >> {tmp_path}/started\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    config = gpu_config()
    script = slurm.render(config, cluster_lib.check(config, description(repo=str(tmp_path))), CONFIG_ARGS,
                          "/shared/runs/gpu")["slurm-job.sbatch"]
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST_HET_GROUP_0="n0",
               SLURM_JOB_NODELIST_HET_GROUP_1="n[0-1]")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=50)
    assert done.returncode == status, done.stderr
    started = (tmp_path / "started").read_text().split("\n")
    assert sorted(started[:3]) == ["started 0", "started 1", "started 2"]
    if failing is None:
        assert started[3:] == ["summarize", ""] and done.stderr == ""
    else:
        assert started[3:] == [""] and done.stderr == "island_jax: a role exited with status 3; stopping the others\n"


def test_an_insecure_coordinator_is_said_so_and_listens_without_credentials():
    config = gpu_config()
    raw = description(**{"coordinator.cert_file": None, "coordinator.key_file": None, "coordinator.tokens_file": None,
                         "coordinator.server_name": None, "coordinator.insecure": True, "tls": None,
                         "islands.a.token_file": None, "islands.b.token_file": None})
    script = slurm.render(config, cluster_lib.check(config, raw), CONFIG_ARGS, "/w")["slurm-job.sbatch"]
    commands = srun_commands(script)
    assert commands["coordinator"][-3:] == ["--coordinator=0.0.0.0:50051", "--role=coordinator", "--insecure"]
    assert commands["b"][-3:] == ["--role=island", "--island=b", "--coordinator=$IJ_COORDINATOR"]


def sharded_config(shards=2):
    config = gpu_config()
    apply_override(config, "coordinator.shards", shards)
    return config


SHARDED_ARGS = [*CONFIG_ARGS, "--config.coordinator.shards=2"]


def test_a_coordinator_of_two_shards_is_one_component_of_two_tasks_and_islands_dial_both():
    config = sharded_config()
    raw = description(**{"coordinator.addresses": ["auto:50051", "auto:50061"], "coordinator.nodes": 2})
    script = slurm.render(config, cluster_lib.check(config, raw), SHARDED_ARGS, "/shared/runs/gpu")["slurm-job.sbatch"]
    assert components(script)[0] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--partition=cpu"]
    assert re.findall(r"^srun (--het-group=\d) --nodes=(\d) --ntasks=(\d) --ntasks-per-node=(\d) (\S+)", script,
                      flags=re.M) == [("--het-group=0", "2", "2", "1", "--kill-on-bad-exit=1"),
                                      ("--het-group=1", "2", "2", "1", "--label"),
                                      ("--het-group=2", "1", "1", "1", "--label")]
    commands = srun_commands(script)
    coordinator, a, b = commands["coordinator"], commands["a"], commands["b"]
    assert "--coordinator=0.0.0.0:50051,0.0.0.0:50061" in coordinator
    assert coordinator[-2:] == ["--shard=$SLURM_PROCID", "--shard_service=$IJ_SHARD_SERVICE"]
    assert a[-3:] == ["--coordinator=$IJ_COORDINATOR", "--process_id=$SLURM_PROCID", "--island_coordinator=$IJ_ISLAND_A"]
    assert b[-1] == "--coordinator=$IJ_COORDINATOR"
    lines = script.splitlines()
    found = lines.index('IJ_COORDINATOR_0_HOST="$(ij_node_address "$SLURM_JOB_NODELIST_HET_GROUP_0" 0)"')
    assert lines[found + 2:found + 7] == [
        'IJ_COORDINATOR_1_HOST="$(ij_node_address "$SLURM_JOB_NODELIST_HET_GROUP_0" 1)"',
        '[ -n "$IJ_COORDINATOR_1_HOST" ] || { echo "island_jax: no address for IJ_COORDINATOR_1 in the node list" '
        '>&2; exit 1; }',
        'export IJ_COORDINATOR="$IJ_COORDINATOR_0_HOST:50051,$IJ_COORDINATOR_1_HOST:50061"',
        'IJ_SHARD_SERVICE_HOST="$(ij_first_address "$SLURM_JOB_NODELIST_HET_GROUP_0")"',
        '[ -n "$IJ_SHARD_SERVICE_HOST" ] || { echo "island_jax: no address for IJ_SHARD_SERVICE in the node list" '
        '>&2; exit 1; }']
    assert lines[found + 7] == 'export IJ_SHARD_SERVICE="$IJ_SHARD_SERVICE_HOST:8477"'
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_shards_on_one_node_share_it_at_their_own_ports():
    config = sharded_config()
    raw = description(**{"coordinator.addresses": ["coord.example.org:50051", "coord.example.org:50052"],
                         "coordinator.shard_port": 9000, "islands.b.cluster": "asia"})
    scripts = slurm.render(config, cluster_lib.check(config, raw), SHARDED_ARGS, "/shared/runs/gpu")
    home, asia = scripts["slurm-job.sbatch"], scripts["slurm-asia.sbatch"]
    assert components(home)[0] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--partition=cpu"]
    assert "srun --het-group=0 --nodes=1 --ntasks=2 --ntasks-per-node=2 --kill-on-bad-exit=1 --label" in home
    assert "export IJ_SHARD_SERVICE=\"$IJ_SHARD_SERVICE_HOST:9000\"" in home.splitlines()
    for script in (home, asia):  # the islands of both jobs dial every shard
        assert "export IJ_COORDINATOR=coord.example.org:50051,coord.example.org:50052" in script.splitlines()
    assert "IJ_SHARD_SERVICE" not in asia and "ij_node_address" not in home + asia
    coordinator = srun_commands(home)["coordinator"]
    assert "--coordinator=0.0.0.0:50051,0.0.0.0:50052" in coordinator
    assert coordinator[-2:] == ["--shard=$SLURM_PROCID", "--shard_service=$IJ_SHARD_SERVICE"]


@pytest.mark.parametrize("shards, changes, message", [
    (2, {}, r"coordinator\.addresses lists 1 address but coordinator\.shards is 2; give one HOST:PORT per coordinator "
            r"shard, shard 0 first, or set --config\.coordinator\.shards=1"),
    (1, {"coordinator.addresses": ["auto:50051", "auto:50052"]},
     r"coordinator\.addresses lists 2 addresses but coordinator\.shards is 1; give one HOST:PORT per coordinator "
     r"shard, shard 0 first, or set --config\.coordinator\.shards=2"),
    (2, {"coordinator.addresses": ["auto:50051", "auto:50052"], "coordinator.nodes": 3},
     r"coordinator\.nodes is 3 but coordinator\.shards is 2; give 1 \(every shard on one host\) or 2"),
    (2, {"coordinator.addresses": ["auto:50051", "auto:50051"]},
     r"coordinator\.addresses repeats port 50051, but the 2 shards share one host \(coordinator\.nodes\); give each "
     r"shard a port of its own"),
    (2, {"coordinator.addresses": ["auto:50051", "c:50052"]}, r"coordinator\.addresses mixes auto:PORT and HOST:PORT"),
    (2, {"coordinator.addresses": ["auto:50051", "auto:50052"], "coordinator.shard_port": "x"},
     r"coordinator\.shard_port is 'x'; give a port from 1 to 65535"),
])
def test_a_description_whose_addresses_do_not_fit_the_shards_is_refused(shards, changes, message):
    with pytest.raises(cluster_lib.ClusterError, match=message):
        cluster_lib.check(sharded_config(shards), description(**changes))


def test_role_command_of_a_shard_and_of_an_island_with_the_whole_list():
    config = sharded_config()
    raw = description(**{"coordinator.addresses": ["c0:50051", "c1:50051"], "coordinator.nodes": 2})
    cluster = cluster_lib.check(config, raw)
    assert (cluster.shards, cluster.ports, cluster.listen, cluster.shard_port) == (
        2, [50051, 50051], ["0.0.0.0:50051", "0.0.0.0:50051"], 8477)
    shard = cluster_lib.role_command(cluster, "coordinator", ["--config=c.py"], "/w", cluster.listen, shard="1",
                                     shard_service="c0:8477")
    assert shard.args[3:6] == ("--config=c.py", "--workdir=/w", "--coordinator=0.0.0.0:50051,0.0.0.0:50051")
    assert shard.args[-2:] == ("--shard=1", "--shard_service=c0:8477") and shard.expansions == ()
    island = cluster_lib.role_command(cluster, "b", ["--config=c.py"], "/w", cluster.addresses)
    assert "--coordinator=c0:50051,c1:50051" in island.args
    assert not [a for a in island.args if a.startswith("--shard")]
