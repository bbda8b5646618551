"""Renders (and runs) the gcloud commands that start a run's roles on Cloud TPU VMs and a CPU VM.

  python launch/tpu_vm.py --config=experiments/configs/two_islands.py --cluster=cluster.yaml \
      --workdir=/shared/runs/two_islands --dry_run

prints a bash script; without `--dry_run` it runs that script here (the machine with gcloud and its credentials)
and exits with its status. Only the roles placed with `scheduler: tpu_vm` in the description
(island_jax/cluster.py) are in it; its header names the roles left to another launcher.

What the script does, in order:

1. For each TPU island of several hosts, asks gcloud once for worker 0's internal IP address
   (`gcloud compute tpus tpu-vm describe NAME --format='value(networkEndpoints[0].ipAddress)'`): the island's
   `jax.distributed` coordinator listens there on `island_port`. A failed lookup, or an answer that is not an IPv4
   address, ends the script before any role starts.
2. Runs, one VM after the other, `cd REPO && PYTHON -P -c "import island_jax"` on the coordinator's VM and on
   every worker of each TPU VM (`--worker=all`): a VM that cannot be reached, or lacks the checkout, the
   interpreter or island_jax installed for it (`-P`: found in the checkout is not enough; the message names the
   fix, `PYTHON -m pip install -e .` in REPO), ends the script before any role starts (an island with some
   workers started would wait for the others until `distributed.initialization_timeout_seconds`). It also lets
   gcloud set up its ssh key for a TPU VM in one session rather than in one per worker at once.
3. Starts, all at once in the background, one `gcloud compute ssh VM` for the coordinator (a CPU VM, field `vm`)
   and one `gcloud compute tpus tpu-vm ssh NAME --worker=W` per worker of each TPU island (the TPU runtime needs
   every worker of a slice started together). Every worker runs `experiments/train.py` with the same
   `--config` and overrides as every other role; the workers of an island of several get `--process_id=W` and
   `--island_coordinator=<worker 0's IP>:<island_port>` explicitly. The IP is spliced into the single-quoted
   remote command as a double-quoted `"${VAR}"`, so this machine expands it and the VM sees the address itself.
4. Waits for every ssh session. A role that ends with a non-zero status is reported at once (with its log's path);
   the others are not stopped from here: the other workers of a failed island end on their own
   (`distributed.heartbeat_timeout_seconds`), and the coordinator's quorum deals with a dead island
   (docs/faults.md). The script exits with the status of the first failed role in start order.

On its VM each process runs under `nohup`, with its output appended to `WORKDIR/launch/ROLE-WORKER.log` and its pid
in `WORKDIR/launch/ROLE-WORKER.pid` (ROLE-WORKER: `coordinator`, or the island's name and the worker, `b-1`): a run
of days must not end when the launching laptop sleeps or its ssh sessions drop, and the log of a failed worker
stays on its VM for the next launch to append to. The script's header shows how to stop a role.

The coordinator listens on every address of its VM at the port of `coordinator.addresses`, and the islands dial
that address as given (a name or IP the TPU VMs can reach; docs/launch.md). TLS files and token files go by path
(`cluster.role_command` adds them as config overrides): no secret value is written into the script.

A coordinator of K shards (`coordinator.shards`, K `addresses`) runs on one CPU VM (`vm: NAME`: K processes
there, each at the port of its address, their `jax.distributed` service on `localhost:SHARD_PORT`) or on K
(`vm: [NAME, ...]`, shard k on VM k; step 1 also asks gcloud for VM 0's internal IP,
`gcloud compute instances describe`, where the service listens, so `coordinator.shard_port` must be open
between those VMs). Shard k is one more ssh session, `--shard=k` with the `--coordinator` list
`0.0.0.0:PORT_k,...` and `--shard_service`, logging to `coordinator-k.log`; every island dials the whole list.
The shards are one `jax.distributed` job: when one fails the others end on their own (heartbeat timeout), and
they are started again together, by running the script again.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import subprocess
import sys
from typing import Mapping

from absl import app

from island_jax import cluster as cluster_lib

_FLAGS: dict = {}  # the command line's flags (`cluster_lib.define_flags`), defined only when run as a script

DESCRIBE_FORMAT = "value(networkEndpoints[0].ipAddress)"
VM_FORMAT = "value(networkInterfaces[0].networkIP)"  # a CPU VM's internal IP (`gcloud compute instances describe`)
# Stands for worker 0's IP inside a remote command until the command is quoted for this machine's shell. Only
# characters shlex.quote leaves bare, so the remote quoting never wraps it.
_IP_MARK = "@IJ_WORKER0_IP@"
_SHARD0_MARK = "@IJ_SHARD0_IP@"  # the same for coordinator shard 0's VM, with shards on VMs of their own
_SHARD0_VARIABLE = "IJ_SHARD0_IP"


def _dq(text: str) -> str:
    """`text` made literal inside a double-quoted bash string."""
    return re.sub(r'([\\"$`])', r"\\\1", text)


def _single_quoted(text: str, splices: Mapping[str, str]) -> str:
    """`text` as one single-quoted bash word, with each mark of `splices` replaced by `"${VARIABLE}"`, which the
    local shell expands (the quote closes before it and opens again after it)."""
    word = "'" + text.replace("'", "'\"'\"'") + "'"
    for mark, variable in splices.items():
        word = word.replace(mark, f"'\"${{{variable}}}\"'")
    return word


def _fail(message: str, variable: str = "") -> str:
    """A call of the script's `fail` with `message`, literal but for `@VALUE@`, which becomes `${variable}`."""
    text = _dq(message)
    return f'fail "{text.replace("@VALUE@", "${" + variable + "}") if variable else text}"'


def _ip_variable(island: str) -> str:
    return "IJ_WORKER0_" + re.sub(r"[^A-Za-z0-9_]", "_", island)


def _where(p: cluster_lib.Placement) -> list[str]:
    return [f"--zone={p.get('zone')}", *([f"--project={p.get('project')}"] if p.get("project") else [])]


def _remote(cluster: cluster_lib.Cluster, p: cluster_lib.Placement, command: cluster_lib.Command, folder: str,
            name: str) -> tuple[str, str]:
    """(the remote shell line of one process, its log on the VM). The line starts the process under nohup, with
    its output appended to `folder/NAME.log` and its pid written to `folder/NAME.pid`, and waits for it, so that
    the ssh session ends with the process's status."""
    log, pid = posixpath.join(folder, f"{name}.log"), posixpath.join(folder, f"{name}.pid")
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in p.env.items())
    q = shlex.quote
    line = (f"cd {q(cluster.repo)} && mkdir -p {q(folder)} && "
            f"echo \"---- island_jax {name} started $(date -u +%Y-%m-%dT%H:%M:%SZ)\" >> {q(log)} && "
            f"{{ nohup {'env ' + env if env else ''}{command.shell()} < /dev/null >> {q(log)} 2>&1 & "
            f"echo $! > {q(pid)}; wait $!; }}")
    return line, log


def _ssh(gcloud: list[str], p: cluster_lib.Placement, worker: str | None, vm: str = "") -> list[str]:
    """The words of `gcloud ... ssh` to a coordinator's VM (`vm`, default `vm` of the placement; `worker` None)
    or to a worker of a TPU VM."""
    q = shlex.quote
    if p.role == "coordinator":
        return [*gcloud, "compute", "ssh", q(vm or p.get("vm")), *(q(w) for w in _where(p)),
                *(q(f) for f in p.get("ssh_flags", []))]
    return [*gcloud, "compute", "tpus", "tpu-vm", "ssh", q(p.get("tpu")), *(q(w) for w in _where(p)),
            *(q(f) for f in p.get("ssh_flags", [])), f"--worker={worker}"]


def _shards(cluster: cluster_lib.Cluster, p: cluster_lib.Placement, config_args: list[str], workdir: str,
            folder: str, gcloud: list[str], spread: bool) -> list[str]:
    """The lines that start each shard of a coordinator of several: one ssh session per shard, to its own VM
    (`spread`: shard 0's IP spliced in from `_SHARD0_VARIABLE`) or all to the one VM (service on localhost)."""
    q, vms = shlex.quote, cluster.vms
    service = f"{_SHARD0_MARK if spread else 'localhost'}:{cluster.shard_port}"
    lines = [f"# coordinator: {cluster.shards} shards on CPU VM{'s' if spread else ''} {', '.join(vms)}, listening "
             f"on {', '.join(cluster.listen)}; islands dial {','.join(cluster.addresses)}"]
    for k in range(cluster.shards):
        command = cluster_lib.role_command(cluster, "coordinator", config_args, workdir, cluster.listen,
                                           shard=str(k), shard_service=service)
        remote, log = _remote(cluster, p, command, folder, f"coordinator-{k}")
        if remote.count(_SHARD0_MARK) != (1 if spread else 0):
            raise cluster_lib.ClusterError(f"coordinator: a path or override holds {_SHARD0_MARK}, which this "
                                           "launcher writes for shard 0's address; rename it")
        splice = {_SHARD0_MARK: _SHARD0_VARIABLE} if spread else {}
        lines += [" ".join([*_ssh(gcloud, p, None, vms[k] if spread else vms[0]),
                            "--command=" + _single_quoted(remote, splice)])
                  + f" || failed coordinator/{k} $? {q(log)} &", "pids+=($!)"]
    return lines


def render(config, cluster: cluster_lib.Cluster, config_args: list[str], workdir: str, *,
           gcloud: str = "gcloud") -> list[str]:
    """The lines of the bash script that starts every role placed on `tpu_vm` (see the module's docstring).

    Args:
      config: the run's config (checked with `cluster`).
      cluster: the description (`cluster_lib.load`).
      config_args: `--config=FILE` and the overrides, the same for every role (`cluster_lib.config_args`).
      workdir: the run's folder as the VMs see it (a relative one is under `cluster.repo`); each process's log and
        pid file go to its `launch/` folder on the VM.
      gcloud: the gcloud command, split as a shell would.

    Returns:
      The script's lines, from `#!/bin/bash`; join them with newlines.

    Raises:
      cluster_lib.ClusterError: no role has scheduler tpu_vm; `coordinator.addresses` of the form `auto:PORT`;
        two islands whose names make the same shell variable (the description's own checks are `cluster_lib.check`'s).
    """
    del config  # checked by cluster_lib.check; every role takes the same config_args
    here = [p for p in cluster.placements() if p.scheduler == "tpu_vm"]
    if not here:
        raise cluster_lib.ClusterError("no role of the cluster description has scheduler: tpu_vm; nothing to render "
                                       "(launch/slurm.py and launch/k8s.py start the others)")
    port, address = cluster.port, ",".join(cluster.addresses)  # every shard's, shard 0 first
    variables = {p.role: _ip_variable(p.role) for p in here if p.role != "coordinator" and p.nodes > 1}
    if len(set(variables.values())) < len(variables):
        raise cluster_lib.ClusterError(f"islands {', '.join(variables)} make the same shell variable names; name "
                                       "the islands with letters, digits and _ only")
    gcloud_words = [shlex.quote(w) for w in shlex.split(gcloud)]
    q = shlex.quote
    folder = cluster_lib.shared_path(posixpath.join(workdir, "launch"), cluster.repo)
    others = [f"{p.role} ({p.scheduler})" for p in cluster.placements() if p.scheduler != "tpu_vm"]

    lines = ["#!/bin/bash", f"# island_jax: {', '.join(p.role for p in here)} on Cloud VMs, rendered by "
                            "launch/tpu_vm.py"]
    if others:
        lines.append(f"# Not started here (their own launcher or job): {', '.join(others)}")
    lines += [
        f"# Each process runs under nohup on its VM, appends its output to {folder}/ROLE-WORKER.log there and",
        "# writes its pid beside it (ROLE-WORKER.pid); it goes on when this script or its ssh session ends. To stop",
        "# one (SIGTERM: it finishes a checkpoint being written, then ends), e.g. worker W of island NAME:",
        "#   gcloud compute tpus tpu-vm ssh TPU --zone=ZONE --worker=W "
        f"--command='kill \"$(cat {folder}/NAME-W.pid)\"'",
        "",
        'fail() { echo "island_jax: $1" >&2; exit 1; }',
        'failed() { echo "island_jax: $1 exited with status $2; its log is $3 on its VM" >&2; return "$2"; }',
    ]

    for p in here:
        if p.role not in variables:
            continue
        tpu, var = p.get("tpu"), variables[p.role]
        where = f"TPU VM {tpu} (islands.{p.role}.tpu) in zone {p.get('zone')}"
        describe = [*gcloud_words, "compute", "tpus", "tpu-vm", "describe", q(tpu), *(q(w) for w in _where(p)),
                    f"--format={q(DESCRIBE_FORMAT)}"]
        lines += [
            "",
            f"# island {p.role}: worker 0's internal IP, where its jax.distributed coordinator listens "
            f"(port {cluster.island_port})",
            f"{var}=$({' '.join(describe)}) || "
            + _fail(f"could not describe {where}; check the name, zone and project (and gcloud auth list)"),
            f"[[ ${var} =~ ^[0-9]+(\\.[0-9]+){{3}}$ ]] || "
            + _fail(f"{where} gave '@VALUE@' as the internal IP of worker 0, not an IPv4 address; is it READY? "
                    f"(gcloud compute tpus tpu-vm describe {tpu})", var),
        ]

    shards, vms = cluster.shards, cluster.vms
    spread = cluster.coordinator.scheduler == "tpu_vm" and shards > 1 and len(vms) > 1  # a VM per shard
    if spread:
        p = cluster.coordinator
        where = f"CPU VM {vms[0]} (coordinator.vm[0]) in zone {p.get('zone')}"
        describe = [*gcloud_words, "compute", "instances", "describe", q(vms[0]), *(q(w) for w in _where(p)),
                    f"--format={q(VM_FORMAT)}"]
        lines += [
            "",
            f"# coordinator shard 0: its VM's internal IP, where the shards' jax.distributed service listens "
            f"(port {cluster.shard_port})",
            f"{_SHARD0_VARIABLE}=$({' '.join(describe)}) || "
            + _fail(f"could not describe {where}; check the name, zone and project (and gcloud auth list)"),
            f"[[ ${_SHARD0_VARIABLE} =~ ^[0-9]+(\\.[0-9]+){{3}}$ ]] || "
            + _fail(f"{where} gave '@VALUE@' as its internal IP, not an IPv4 address; is it RUNNING? "
                    f"(gcloud compute instances describe {vms[0]})", _SHARD0_VARIABLE),
        ]

    # Before any role starts: every VM answers, holds the checkout and the interpreter with island_jax installed
    # (`-P`: the working folder is not on the path, as it is not for experiments/train.py); and gcloud's one-time
    # ssh key set-up for a TPU VM happens in one session, not in one per worker at once.
    check = f'cd {q(cluster.repo)} && {q(cluster.python)} -P -c "import island_jax"'
    install = f"cd {cluster.repo} && {cluster.python} -m pip install -e ."
    lines += ["", "# Every VM reachable, with the checkout (repo) and python with island_jax installed, before any role "
                  "starts"]
    for p in here:
        for vm in (dict.fromkeys(vms) if p.role == "coordinator" else [""]):
            what = (f"CPU VM {vm} (coordinator.vm)" if p.role == "coordinator"
                    else f"every worker of TPU VM {p.get('tpu')} (islands.{p.role}.tpu)")
            words = [*_ssh(gcloud_words, p, "all", vm), "--command=" + _single_quoted(check, {})]
            lines.append(" ".join(words) + " || " + _fail(
                f"could not run {cluster.python} with island_jax in {cluster.repo} (python, repo) on {what}; the "
                f"error is above. Every VM needs the checkout and island_jax installed from it: {install}"))

    lines += ["", "pids=()"]
    for p in here:
        if p.role == "coordinator" and shards > 1:
            lines += _shards(cluster, p, config_args, workdir, folder, gcloud_words, spread)
            continue
        if p.role == "coordinator":
            command = cluster_lib.role_command(cluster, "coordinator", config_args, workdir, f"0.0.0.0:{port}")
            remote, log = _remote(cluster, p, command, folder, "coordinator")
            lines += [f"# coordinator: CPU VM {p.get('vm')}, listening on 0.0.0.0:{port}; islands dial {address}",
                      " ".join([*_ssh(gcloud_words, p, None), "--command=" + _single_quoted(remote, {})])
                      + f" || failed coordinator $? {q(log)} &", "pids+=($!)"]
            continue
        several = p.nodes > 1
        lines.append(f"# island {p.role}: TPU VM {p.get('tpu')} ({p.get('accelerator_type')}: "
                     f"{p.nodes * p.devices_per_node} devices on {p.nodes} host(s)), every worker started together")
        for worker in range(p.nodes):
            command = cluster_lib.role_command(
                cluster, p.role, config_args, workdir, address,
                process_id=str(worker) if several else None,
                island_coordinator=f"{_IP_MARK}:{cluster.island_port}" if several else None)
            remote, log = _remote(cluster, p, command, folder, f"{p.role}-{worker}")
            if remote.count(_IP_MARK) != (1 if several else 0):
                raise cluster_lib.ClusterError(f"islands.{p.role}: a path or override holds {_IP_MARK}, which "
                                               "this launcher writes for worker 0's address; rename it")
            splice = {_IP_MARK: variables[p.role]} if several else {}
            lines += [" ".join([*_ssh(gcloud_words, p, str(worker)), "--command=" + _single_quoted(remote, splice)])
                      + f" || failed {p.role}/{worker} $? {q(log)} &", "pids+=($!)"]

    lines += [
        "",
        "# Each session ends with its process; the script's status is the first failed one's (in this order).",
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }; done',
        'if [ "$status" -ne 0 ]; then',
        '  echo "island_jax: a role failed (above); start its processes again to resume it from its checkpoints" >&2',
        '  exit "$status"',
        "fi",
        'echo "island_jax: every role started here has finished"',
        "# With every role's folder on one filesystem, the run's summary.json:",
        "#   " + cluster_lib.summarize_command(cluster, config_args, workdir).shell(),
    ]
    return lines


def main(argv):
    del argv
    try:
        config, cluster, config_args, workdir = cluster_lib.from_flags(_FLAGS, sys.argv[1:])
        lines = render(config, cluster, config_args, workdir, gcloud=_FLAGS["gcloud"].value)
    except cluster_lib.ClusterError as e:
        sys.exit(str(e))
    script = "\n".join(lines) + "\n"
    if _FLAGS["dry_run"].value:
        print(script, end="")
        return
    try:
        done = subprocess.run(["bash", "-c", script, "tpu_vm.sh"])
    except FileNotFoundError:
        sys.exit("launch/tpu_vm.py runs its script with bash, which is not on PATH; print it with --dry_run and run "
                 "it with a bash")
    if done.returncode:
        sys.exit(f"[tpu_vm] the launch ended with status {done.returncode}; the first failure is named above")
    print("[tpu_vm] every role started here has finished", flush=True)


if __name__ == "__main__":
    from island_jax.cli import parse_flags

    _FLAGS.update(cluster_lib.define_flags(
        "gcloud", "The gcloud command (its path, or a wrapper with its arguments).", "The run's folder, as the VMs see it.",
        "Print the script; run nothing."))
    app.run(main, flags_parser=parse_flags)
