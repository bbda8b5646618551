#!/usr/bin/env bash
# A bandwidth-limited "WAN" between two network namespaces on this machine, so
# that a local multi-process run (launch/local.py) moves its exchange traffic
# through a link of a chosen rate instead of through unlimited loopback.
#
# Usage (as root, or with CAP_NET_ADMIN):
#   launch/wan_netns.sh up RATE              create the namespaces and shape the link to RATE
#   launch/wan_netns.sh down                 remove them (succeeds when they are already gone)
#   launch/wan_netns.sh run RATE -- CMD...   up RATE, run CMD, always down afterwards
#   launch/wan_netns.sh status               show the namespaces, their addresses and qdiscs
#
# RATE is in tc's syntax: 1gbit, 500mbit, 20mbit, 100mbps (bytes/s), ...
#
# Layout (PREFIX is $IJ_NETNS_PREFIX, default "ij"):
#
#   namespace PREFIX-coord                      namespace PREFIX-island
#   +-----------------------+    veth pair     +-----------------------+
#   | wan0  10.77.0.1/24    |<================>| wan0  10.77.0.2/24    |
#   | tbf: egress <= RATE   |                  | tbf: egress <= RATE   |
#   +-----------------------+                  +-----------------------+
#
# Both namespaces also have their loopback up. Run the coordinator in
# PREFIX-coord, listening on 10.77.0.1, and the islands that should sit behind
# the WAN in PREFIX-island, dialling 10.77.0.1; launch/local.py does this with
#   --netns_coordinator=ij-coord --netns_islands=b=ij-island
# An example, with island b behind a 1 Gbit/s link:
#   sudo launch/wan_netns.sh run 1gbit -- python launch/local.py --config=CONFIG --workdir=DIR \
#       --netns_coordinator=ij-coord --netns_islands=b=ij-island
#
# Why both ends are shaped: a tbf qdisc only shapes the packets a device
# *sends*. The qdisc on the island's end limits island -> coordinator (the
# islands' contributions), the one on the coordinator's end limits
# coordinator -> island (the averaged update), so each direction gets RATE,
# like a full-duplex link.
#
# Latency is NOT added here: the kernel's netem qdisc is not available on every
# machine (tbf is), so this link only limits bandwidth and its round-trip time is
# that of a veth pair (tens of microseconds). Add a WAN's delay with the
# in-process link emulator instead (config `comm.link.latency_ms`).
#
# tbf settings: the bucket (burst) holds ~2 ms of traffic at RATE, at least
# 64 KiB (one TSO/GSO segment, so large segments are not split) and at most
# 1 MiB; with it 1gbit measures ~0.95 Gbit/s of TCP payload (the rest is
# Ethernet/IP/TCP headers, which tbf counts). The queue may hold 100 ms of
# traffic at RATE before tbf drops, so TCP over the link sees few losses.
#
# `up` refuses to touch namespaces that already exist (they may be someone
# else's, or a previous run's with another rate): it stops with a message
# telling to run `down` first. `run` removes the namespaces on every way out:
# when CMD succeeds or fails, and on SIGINT/SIGTERM, which it forwards to CMD
# once (CMD runs in its own session so that a Ctrl-C reaches it only through
# this script), waiting for CMD to exit before removing the link. `run` exits
# with CMD's status. CMD runs in the root namespace; it places its own
# processes into the namespaces (`ip netns exec NS ...`).

set -euo pipefail

PREFIX="${IJ_NETNS_PREFIX:-ij}"
COORD_NS="${PREFIX}-coord"
ISLAND_NS="${PREFIX}-island"
COORD_ADDR="10.77.0.1/24"
ISLAND_ADDR="10.77.0.2/24"
DEV="wan0"
LATENCY="100ms"
PROG="${0##*/}"

die() {
  echo "$PROG: $*" >&2
  exit 1
}

usage() {
  sed -n '/^# Usage/,/^# RATE is/p' "$0" | sed 's/^# \{0,1\}//' >&2
}

check_tools() {
  command -v ip >/dev/null 2>&1 || die "'ip' was not found; install iproute2 (e.g. apt-get install iproute2)"
  command -v tc >/dev/null 2>&1 || die "'tc' was not found; install iproute2 (e.g. apt-get install iproute2)"
}

check_root() {
  [ "$(id -u)" -eq 0 ] || die "creating network namespaces and qdiscs needs root (CAP_NET_ADMIN); run it with sudo"
}

ns_exists() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF -- "$1"
}

# RATE in tc's syntax -> bits per second (an integer); fails on what it does not know.
rate_bits() {
  awk -v r="$1" 'BEGIN {
    r = tolower(r)
    if (!match(r, /^[0-9]+(\.[0-9]*)?/)) exit 1
    n = substr(r, 1, RLENGTH) + 0; u = substr(r, RLENGTH + 1)
    m[""] = 1; m["bit"] = 1; m["bps"] = 8
    split("k m g t", si, " "); split("ki mi gi ti", bin, " ")
    for (i = 1; i <= 4; i++) {
      m[si[i] "bit"] = 1000 ^ i; m[si[i] "bps"] = 8 * 1000 ^ i
      m[bin[i] "bit"] = 1024 ^ i; m[bin[i] "bps"] = 8 * 1024 ^ i
    }
    if (!(u in m) || n <= 0) exit 1
    printf "%.0f\n", n * m[u]
  }'
}

# The tbf bucket for RATE: ~2 ms of traffic, clamped to [64 KiB, 1 MiB].
burst_bytes() {
  local bits
  if ! bits="$(rate_bits "$1")"; then
    echo 65536  # tc will judge the rate itself
    return
  fi
  awk -v b="$bits" 'BEGIN { x = b / 8 * 0.002; if (x < 65536) x = 65536; if (x > 1048576) x = 1048576; printf "%.0f\n", x }'
}

cmd_down() {
  check_tools
  check_root
  local ns
  for ns in "$COORD_NS" "$ISLAND_NS"; do
    if ns_exists "$ns"; then
      ip netns del "$ns"
      echo "$PROG: removed namespace $ns"
    fi
  done
}

cmd_up() {
  local rate="${1:-}"
  [ -n "$rate" ] || { usage; die "up needs a RATE, e.g. '$PROG up 1gbit'"; }
  check_tools
  check_root
  local ns
  for ns in "$COORD_NS" "$ISLAND_NS"; do
    if ns_exists "$ns"; then
      die "namespace $ns already exists; run '$PROG down' first (with the same IJ_NETNS_PREFIX=$PREFIX)" \
          "to remove $COORD_NS and $ISLAND_NS, then 'up' again"
    fi
  done
  local burst
  burst="$(burst_bytes "$rate")"
  # From here on, a failure removes whatever was created.
  trap 'cmd_down >/dev/null 2>&1 || true' ERR
  ip netns add "$COORD_NS"
  ip netns add "$ISLAND_NS"
  ip link add "$DEV" netns "$COORD_NS" type veth peer name "$DEV" netns "$ISLAND_NS"
  ip -n "$COORD_NS" addr add "$COORD_ADDR" dev "$DEV"
  ip -n "$ISLAND_NS" addr add "$ISLAND_ADDR" dev "$DEV"
  local err
  for ns in "$COORD_NS" "$ISLAND_NS"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$DEV" up
    if ! err="$(tc -n "$ns" qdisc add dev "$DEV" root tbf rate "$rate" burst "$burst" latency "$LATENCY" 2>&1)"; then
      trap - ERR
      cmd_down >/dev/null 2>&1 || true
      printf '%s\n' "$PROG: tc refused the rate '$rate': ${err:-no message}" \
        "hint: give RATE in tc's syntax, a number with a unit such as 1gbit, 500mbit, 20mbit or 100mbps" \
        "(bytes/s); if the message is about tbf, the kernel lacks the sch_tbf module" >&2
      exit 1
    fi
  done
  trap - ERR
  local i
  for i in $(seq 50); do  # the veth's carrier comes up within milliseconds
    ip -n "$COORD_NS" -o link show dev "$DEV" | grep -q "state UP" &&
      ip -n "$ISLAND_NS" -o link show dev "$DEV" | grep -q "state UP" && break
    sleep 0.1
  done
  echo "$PROG: $COORD_NS ($DEV ${COORD_ADDR%/*}) <-> $ISLAND_NS ($DEV ${ISLAND_ADDR%/*})," \
       "each direction shaped to $rate (tbf burst $burst bytes, latency $LATENCY)"
}

cmd_status() {
  check_tools
  local ns found=0
  for ns in "$COORD_NS" "$ISLAND_NS"; do
    if ns_exists "$ns"; then
      found=1
      echo "namespace $ns:"
      ip -n "$ns" -brief addr show 2>/dev/null | sed 's/^/  /' || true
      tc -n "$ns" -s qdisc show dev "$DEV" 2>/dev/null | sed 's/^/  /' || true
    else
      echo "namespace $ns: absent"
    fi
  done
  [ "$found" -eq 1 ] || echo "(run '$PROG up RATE' to create them)"
}

cmd_run() {
  local rate="${1:-}"
  [ -n "$rate" ] || { usage; die "run needs a RATE, e.g. '$PROG run 1gbit -- COMMAND...'"; }
  shift
  [ "${1:-}" = "--" ] || { usage; die "run needs '--' before the command: '$PROG run $rate -- COMMAND...'"; }
  shift
  [ "$#" -gt 0 ] || die "run needs a command after '--'"
  local child="" stop=""
  # Signals sent to this script are forwarded to the command, once each; one
  # that comes before the command starts is remembered.
  trap 'stop=INT; [ -n "$child" ] && kill -s INT "$child" 2>/dev/null || true' INT
  trap 'stop=TERM; [ -n "$child" ] && kill -s TERM "$child" 2>/dev/null || true' TERM
  cmd_up "$rate"
  trap 'cmd_down' EXIT  # only now: namespaces that `up` refused to touch are not ours to remove
  case "$stop" in INT) exit 130 ;; TERM) exit 143 ;; esac
  # A background command would start with SIGINT ignored: restore it. Its own
  # session keeps a terminal's Ctrl-C from reaching it twice (directly and
  # forwarded).
  if command -v setsid >/dev/null 2>&1; then
    ( trap - INT QUIT; exec setsid "$@" ) &
  else
    ( trap - INT QUIT; exec "$@" ) &
  fi
  child=$!
  [ -z "$stop" ] || kill -s "$stop" "$child" 2>/dev/null || true
  local status
  while :; do
    set +e
    wait "$child"
    status=$?
    set -e
    kill -0 "$child" 2>/dev/null || break  # else `wait` was interrupted by a forwarded signal
  done
  set +e
  wait "$child"  # the saved status, in case the command ended while a signal was being forwarded
  status=$?
  set -e
  exit "$status"
}

main() {
  local sub="${1:-}"
  [ "$#" -gt 0 ] && shift
  case "$sub" in
    up) [ "$#" -le 1 ] || die "up takes one argument, the RATE"; cmd_up "$@" ;;
    down) [ "$#" -eq 0 ] || die "down takes no arguments"; cmd_down ;;
    run) cmd_run "$@" ;;
    status) cmd_status ;;
    -h | --help | help) usage 2>&1 ;;
    *) usage; die "unknown command '${sub}'; use up, down, run or status" ;;
  esac
}

main "$@"
