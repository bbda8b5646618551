#!/usr/bin/env bash
# SLURM on this one machine, for trying launch/slurm.py for real (and for its test, tests/test_slurm_run.py):
# SLURM_NODES nodes (default 4), each a slurmd of its own on this host. Debian or Ubuntu, as root; no systemd
# needed (the daemons are started directly).
#
#   sudo launch/slurm_single_node.sh          # install (apt) and configure if absent, then start; idempotent
#   launch/slurm_single_node.sh status        # exit 0 when every node accepts jobs
#
# Why several nodes on one host: SLURM's backfill scheduler, the only one that starts heterogeneous jobs, places
# each component on a node of its own, so a run's roles (a coordinator and islands, each a component) need as
# many nodes. Each node declares SLURM_NODE_CPUS CPUs (default 16, whatever the machine has:
# SlurmdParameters=config_overrides) and the partition oversubscribes them. In a container slurmd cannot use cgroups, so processes are
# tracked by /proc (ProctrackType=proctrack/linuxproc) and no task plugin binds them (TaskPlugin=task/none).
# It writes /etc/slurm/slurm.conf and /etc/munge/munge.key only when they are absent, so a machine's own
# configuration is never overwritten.
set -euo pipefail

CPUS="${SLURM_NODE_CPUS:-16}"

NODES="${SLURM_NODES:-4}"
accepting() {  # every node of this machine's SLURM is up
  command -v sinfo >/dev/null 2>&1 &&
    [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" -ge "$NODES" ]
}

if [ "${1:-}" = "status" ]; then
  if accepting; then sinfo; exit 0; fi
  echo "slurm: fewer than ${NODES} nodes accept jobs here (run: sudo launch/slurm_single_node.sh)" >&2
  exit 1
fi

if accepting; then
  echo "slurm: already running"
  sinfo
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "slurm: installing and starting SLURM needs root; run: sudo $0" >&2
  exit 1
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

host="$(hostname -s)"
names=()
nodes_conf=""
for i in $(seq 0 $((NODES - 1))); do
  names+=("${host}-${i}")
  nodes_conf+="NodeName=${host}-${i} NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((17100 + i)) CPUs=${CPUS} State=UNKNOWN"$'\n'
done
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/munge /var/lib/munge /var/log/munge
if [ ! -f /etc/slurm/slurm.conf ]; then
  cat >/etc/slurm/slurm.conf <<EOF
# Written by island_jax's launch/slurm_single_node.sh: ${NODES} nodes on this one host (slurmd -N NAME each).
ClusterName=island-jax-local
SlurmctldHost=${host}
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SchedulerType=sched/backfill
# Heterogeneous jobs start only on a backfill pass (every 30 s by default); a pass every second starts them at once.
SchedulerParameters=bf_interval=1
JobCompType=jobcomp/none
${nodes_conf}
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:${CPUS}
EOF
fi
if [ ! -f /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0700 /etc/munge
chmod 0400 /etc/munge/munge.key

pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null || /usr/sbin/munged --force
pgrep -x slurmctld >/dev/null || slurmctld
for name in "${names[@]}"; do
  mkdir -p "/var/spool/slurmd/${name}"
  pgrep -f "slurmd -N ${name}\$" >/dev/null || slurmd -N "${name}"
done

# Wait for the node to come up (a condition, not a fixed sleep): at most 60 s.
for _ in $(seq 1 120); do
  if accepting; then
    sinfo
    exit 0
  fi
  pgrep -x slurmctld >/dev/null || slurmctld
  for name in "${names[@]}"; do scontrol update nodename="${name}" state=resume >/dev/null 2>&1 || true; done
  sleep 0.5
done
echo "slurm: ${NODES} nodes did not come up within 60 s; see /var/log/slurm/slurmctld.log and slurmd-*.log" >&2
exit 1
