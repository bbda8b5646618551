"""Renders (and submits) the SLURM batch scripts of a run from its config and a cluster description.

  python launch/slurm.py --config=experiments/configs/two_islands.py --cluster=cluster.yaml \
      --workdir=/shared/runs/two_islands --dry_run

prints the scripts; without `--dry_run` it writes them to WORKDIR/launch/ and submits them with `sbatch`.
Every role placed on SLURM (`scheduler: slurm` in the description, island_jax/cluster.py) becomes one component
of a heterogeneous job when the roles share a cluster (the same `cluster` field, or none), and a job of its own
otherwise (islands on different clusters: one job per cluster). Roles placed elsewhere (a TPU VM, Kubernetes)
are left to their own launcher, and the script says so.

In each job every task runs `experiments/train.py --role=...` with the same config and overrides, and every
process of an island of several gets `--process_id=$SLURM_PROCID` and `--island_coordinator` (its process 0's
host and `island_port`) explicitly, so that `jax.distributed` does not detect SLURM itself (which would bind
each process to the one GPU of its `SLURM_LOCALID`; island_jax/distributed.py). The coordinator listens on
every address of its node at the port of `coordinator.addresses`; islands in its job reach it by the node's
name (`auto:PORT`, resolved from the job's environment), others by the address given. TLS files and tokens go by
path; no secret is written into a script. The job ends when every role has; the first role to fail stops the
others and fails the job. A job that holds every role then writes the run's summary.json.

A coordinator of K shards (`coordinator.shards`; K `addresses`, shard 0 first) is one component of K tasks on
`nodes` 1 or K (one shard per node), started by one srun: task k is shard k (`--shard=$SLURM_PROCID`), every
shard gets the `--coordinator` list `0.0.0.0:PORT_k,...` and `--shard_service` on the component's first node at
`coordinator.shard_port` (their `jax.distributed` service), and the islands get every shard's address in
`$IJ_COORDINATOR` (`auto:PORT`: shard k on the component's node k, or on its one node). The shards stop
together: their srun has `--kill-on-bad-exit=1`, so one failed shard ends the others and the srun, which ends
the job as any role does; submitting the job again restarts every role from its checkpoints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from absl import app

from island_jax import cluster as cluster_lib
from island_jax import hardware as hardware_lib

_FLAGS: dict = {}  # the command line's flags (`cluster_lib.define_flags`), defined only when run as a script

def _tasks(p: cluster_lib.Placement, tasks: int) -> list[str]:
    """Nodes and tasks of one component: `tasks` spread evenly on its nodes (one per node but for the shards of
    a coordinator on one node)."""
    return [f"--nodes={p.nodes}", f"--ntasks={tasks}", f"--ntasks-per-node={tasks // p.nodes}"]


def _directives(p: cluster_lib.Placement, hardware: str, tasks: int) -> list[str]:
    """The #SBATCH lines of one component: nodes, `tasks` (one per node, or every coordinator shard on one
    node), and the scheduler fields given. An island's nodes are its own (`--exclusive`, all their memory:
    `--mem=0`) unless `exclusive: false`; GPUs are asked for as `--gres=gpu:devices_per_node` unless `gres` says
    otherwise."""
    lines = _tasks(p, tasks)
    if p.role != "coordinator" and p.get("exclusive", True):
        lines += ["--exclusive", f"--mem={p.get('mem') or 0}"]
    elif p.get("mem"):
        lines.append(f"--mem={p.get('mem')}")
    for key, flag in (("partition", "partition"), ("account", "account"), ("time", "time"), ("qos", "qos"),
                      ("cpus_per_task", "cpus-per-task")):
        if p.get(key):
            lines.append(f"--{flag}={p.get(key)}")
    gres = p.get("gres") or (f"gpu:{p.devices_per_node}" if hardware_lib.kind(hardware) == "gpu" else "")
    if gres:
        lines.append(f"--gres={gres}")
    return lines + [str(x) for x in (p.get("extra_sbatch") or [])]


def _no_address(name: str) -> str:
    """The line that stops the job when `${name}_HOST` came out empty."""
    return f'[ -n "${name}_HOST" ] || {{ echo "island_jax: no address for {name} in the node list" >&2; exit 1; }}'


def _env_name(role: str) -> str:
    return "IJ_ISLAND_" + re.sub(r"[^A-Za-z0-9]", "_", role).upper()


def _groups(cluster: cluster_lib.Cluster) -> dict[str, list[cluster_lib.Placement]]:
    """SLURM placements by cluster name ("" for the default one), the coordinator's group first."""
    groups: dict[str, list[cluster_lib.Placement]] = {}
    for p in cluster.placements():
        if p.scheduler == "slurm":
            groups.setdefault(str(p.get("cluster", "")), []).append(p)
    return groups


def render(config, cluster: cluster_lib.Cluster, config_args: list[str], workdir: str) -> dict[str, str]:
    """{script name: sbatch script} for every SLURM job of the run.

    Args:
      config: the run's config (checked with `cluster`).
      cluster: the description (`cluster_lib.load`).
      config_args: `--config=FILE` and the overrides, the same for every role (`cluster_lib.config_args`).
      workdir: the run's folder as the nodes see it.

    Raises:
      cluster_lib.ClusterError: `coordinator.addresses` is `auto:PORT` but an island is not in the
        coordinator's SLURM job, or no role is placed on SLURM.
    """
    groups = _groups(cluster)
    if not groups:
        raise cluster_lib.ClusterError("no role of the cluster description has scheduler: slurm; nothing to render")
    address = cluster.addresses[0]
    coordinator_group = next((g for g, ps in groups.items() if cluster.coordinator in ps), None)
    if cluster.host == "auto":
        away = [n for n, p in cluster.islands.items()
                if coordinator_group is None or p not in groups.get(coordinator_group, [])]
        if away:
            raise cluster_lib.ClusterError(
                f"coordinator.addresses is {address}, resolved inside the coordinator's SLURM job, but island "
                f"{away[0]} runs elsewhere; give the coordinator's reachable HOST:PORT")
    scripts = {}
    for group, placements in groups.items():
        name = f"slurm-{group or 'job'}.sbatch"
        scripts[name] = _script(config, cluster, config_args, workdir, placements, group)
    return scripts


def _script(config, cluster, config_args, workdir, placements, group) -> str:
    port, shards = cluster.port, cluster.shards
    tasks = lambda p: shards if p.role == "coordinator" else p.nodes  # noqa: E731
    others = [p.role for p in cluster.placements() if p not in placements]
    lines = ["#!/bin/bash", f"# island_jax: {', '.join(p.role for p in placements)}"
             + (f" on cluster {group}" if group else "") + ", rendered by launch/slurm.py"]
    if others:
        lines.append(f"# Not in this job (started by their own launcher or job): {', '.join(others)}")
    lines.append(f"#SBATCH --job-name=island_jax-{os.path.basename(os.path.normpath(workdir))}")
    lines.append(f"#SBATCH --output={cluster_lib.shared_path(os.path.join(workdir, 'launch', 'slurm-%j.out'), cluster.repo)}")
    if group:
        lines.append(f"#SBATCH --clusters={group}")
    for k, p in enumerate(placements):
        if k:
            lines.append("#SBATCH hetjob")
        hardware = "cpu" if p.role == "coordinator" else config.islands[p.role].hardware
        lines += [f"#SBATCH {d}" for d in _directives(p, hardware, tasks(p))]
    het = len(placements) > 1
    nodelist = (lambda k: f"$SLURM_JOB_NODELIST_HET_GROUP_{k}") if het else (lambda k: "$SLURM_JOB_NODELIST")
    first_host = lambda k: f'$(ij_first_address "{nodelist(k)}")'  # noqa: E731
    lines += [
        "", "set -uo pipefail",
        "# The address of a node list's first node: its NodeAddr (on most clusters, its name).",
        "ij_first_address() {",
        '  local node; node="$(scontrol show hostnames "$1" | head -n 1)"',
        '  scontrol show node "$node" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p"',
        "}"]
    coordinator_here = cluster.coordinator in placements
    spread = coordinator_here and shards > 1 and cluster.coordinator.nodes > 1 and cluster.host == "auto"
    if spread:  # shard k on node k of the coordinator's component
        lines += [
            "# The address of node $2 (from 0) of a node list.",
            "ij_node_address() {",
            '  local node; node="$(scontrol show hostnames "$1" | sed -n "$(($2 + 1))p")"',
            '  scontrol show node "$node" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p"',
            "}"]
    lines += [f"cd {shlex.quote(cluster.repo)}", "export PYTHONUNBUFFERED=1", "start=$SECONDS"]
    index = {p.role: k for k, p in enumerate(placements)}
    # Where the islands reach the coordinator, and where each island of several processes finds its process 0:
    # in the job's environment; a node list without an address stops the job before any role starts.
    found, hosts = [], []
    if cluster.host == "auto" and shards == 1:
        found.append(("IJ_COORDINATOR", first_host(index["coordinator"]), port))
    elif cluster.host == "auto":  # every shard's address, from the coordinator's node list
        each = (lambda k: f'$(ij_node_address "{nodelist(index["coordinator"])}" {k})') if spread else (
            lambda k: first_host(index["coordinator"]))
        hosts = [(f"IJ_COORDINATOR_{k}", each(k)) for k in range(shards if spread else 1)]
    else:
        lines.append(f"export IJ_COORDINATOR={shlex.quote(','.join(cluster.addresses))}")
    if coordinator_here and shards > 1:
        found.append(("IJ_SHARD_SERVICE", first_host(index["coordinator"]), cluster.shard_port))
    found += [(_env_name(p.role), first_host(index[p.role]), cluster.island_port)
              for p in placements if p.role != "coordinator" and p.nodes > 1]
    for name, expression in hosts:
        lines += [f'{name}_HOST="{expression}"', _no_address(name)]
    if hosts:
        lines.append('export IJ_COORDINATOR="' + ",".join(f"${hosts[k if spread else 0][0]}_HOST:{p}"
                                                          for k, p in enumerate(cluster.ports)) + '"')
    for name, expression, at in found:
        lines += [f'{name}_HOST="{expression}"', _no_address(name), f'export {name}="${name}_HOST:{at}"']
    dial = "$IJ_COORDINATOR"
    lines += ["", "pids=()"]
    for k, p in enumerate(placements):
        if p.role == "coordinator" and shards > 1:  # one task per shard, all in one step: they end together
            command = cluster_lib.role_command(cluster, "coordinator", config_args, workdir, cluster.listen,
                                               shard="$SLURM_PROCID", shard_service="$IJ_SHARD_SERVICE")
        elif p.role == "coordinator":
            command = cluster_lib.role_command(cluster, "coordinator", config_args, workdir, f"0.0.0.0:{port}")
        else:
            several = p.nodes > 1
            command = cluster_lib.role_command(
                cluster, p.role, config_args, workdir, dial,
                process_id="$SLURM_PROCID" if several else None,
                island_coordinator=f"${_env_name(p.role)}" if several else None)
        env = " ".join(f"{k_}={shlex.quote(v)}" for k_, v in p.env.items())
        inner = (f"env {env} " if env else "") + command.shell()
        together = ["--kill-on-bad-exit=1"] if p.role == "coordinator" and shards > 1 else []
        srun = ["srun", *([f"--het-group={k}"] if het else []), *_tasks(p, tasks(p)), *together, "--label", "bash",
                "-c", shlex.quote(inner)]
        lines += [f"# {p.role}", " ".join(srun) + " &", "pids+=($!)"]
    lines += [
        "",
        "# The job ends when every role has; the first role to fail stops the others. `wait -n` returns when any",
        "# role ends; then every role that has ended is waited for by its pid, which gives its own status.",
        'while [ "${#pids[@]}" -gt 0 ]; do',
        "  wait -n",
        "  alive=()",
        '  for pid in "${pids[@]}"; do',
        '    if kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); continue; fi',
        '    wait "$pid"; rc=$?',
        '    if [ "$rc" -ne 0 ]; then',
        '      echo "island_jax: a role exited with status $rc; stopping the others" >&2',
        '      for other in "${pids[@]}"; do kill "$other" 2>/dev/null; done',
        "      wait",
        "      exit $rc",
        "    fi",
        "  done",
        '  pids=("${alive[@]}")',
        "done",
    ]
    if len(placements) == len(cluster.placements()):  # every role ran here: the run's summary
        lines.append(cluster_lib.summarize_command(cluster, config_args, workdir).shell()
                     + ' --wall_seconds="$((SECONDS - start))"')
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    try:
        config, cluster, config_args, workdir = cluster_lib.from_flags(_FLAGS, sys.argv[1:])
        scripts = render(config, cluster, config_args, workdir)
    except cluster_lib.ClusterError as e:
        sys.exit(str(e))
    if _FLAGS["dry_run"].value:
        for name, text in scripts.items():
            print(f"# ---- {name}\n{text}")
        return
    for name, text in scripts.items():
        path = cluster_lib.write_launch_file(workdir, name, text)
        sbatch = _FLAGS["sbatch"].value
        done = subprocess.run([*shlex.split(sbatch), "--parsable", path], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{sbatch} {path} failed ({done.returncode}): {done.stderr.strip()}")
        print(f"[slurm] submitted {path}: job {done.stdout.strip()}", flush=True)


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    _FLAGS.update(cluster_lib.define_flags(
        "sbatch", "The sbatch command (its path, or a wrapper with its arguments, e.g. 'sbatch --wait').",
        "The run's folder, as the nodes see it (a shared filesystem).", "Print the scripts; write and submit nothing."))
    app.run(main, flags_parser=parse_flags)
