"""launch/wan_netns.sh: two network namespaces joined by a veth pair shaped with tbf on both ends.

Needs root and iproute2 (skipped otherwise). Every test uses its own namespace
prefix (IJ_NETNS_PREFIX=ijtest<pid>), so it never touches namespaces made by
someone else, and removes its namespaces whatever happens.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "wan_netns.sh")
PREFIX = f"ijtest{os.getpid()}"
COORD, ISLAND = f"{PREFIX}-coord", f"{PREFIX}-island"

pytestmark = [
    pytest.mark.slow,  # starts processes in network namespaces
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs the `ip` command (iproute2)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and qdiscs need root (CAP_NET_ADMIN)"),
]

RECEIVE = """
import socket, sys, time
server = socket.create_server(("10.77.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
first, total = None, 0
while chunk := conn.recv(1 << 20):
    first = first or time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - first, flush=True)
"""

SEND = """
import socket, sys
with socket.create_connection(("10.77.0.1", int(sys.argv[1]))) as s:
    s.sendall(b"x" * int(sys.argv[2]))
"""


def wan(*args, timeout=60):
    env = dict(os.environ, IJ_NETNS_PREFIX=PREFIX)
    return subprocess.run([SCRIPT, *args], check=False, capture_output=True, text=True, env=env, timeout=timeout)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def in_ns(ns, code, *args):
    return ["ip", "netns", "exec", ns, sys.executable, "-c", code, *args]


def test_up_shapes_both_directions_and_down_removes_everything():
    try:
        up = wan("up", "100mbit")
        assert up.returncode == 0, up.stderr
        assert {COORD, ISLAND} <= namespaces()
        for ns in (COORD, ISLAND):
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "wan0"], capture_output=True, text=True,
                                   check=True).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        again = wan("up", "100mbit")
        assert again.returncode == 1 and "already exists" in again.stderr and "down" in again.stderr

        size = 4 << 20  # island -> coordinator, through the island end's qdisc
        receiver = subprocess.Popen(in_ns(COORD, RECEIVE), stdout=subprocess.PIPE, text=True)
        try:
            port = receiver.stdout.readline().strip()
            subprocess.run(in_ns(ISLAND, SEND, port, str(size)), check=True, timeout=60)
            received, seconds = receiver.stdout.readline().split()
            assert receiver.wait(timeout=60) == 0
        finally:
            receiver.kill()
        assert int(received) == size
        ratio = size * 8 / float(seconds) / 100e6  # TCP payload; tbf also counts the headers (~4 %)
        assert 0.8 < ratio < 1.02, f"{ratio * 100:.1f} Mbit/s over a 100mbit link"
    finally:
        down = wan("down")
    assert down.returncode == 0, down.stderr
    assert not {COORD, ISLAND} & namespaces()
    assert wan("down").returncode == 0  # already gone


def test_run_always_removes_the_namespaces_and_returns_the_command_status():
    try:
        failed = wan("run", "100mbit", "--", "false")
        assert failed.returncode == 1, failed.stderr
        assert not {COORD, ISLAND} & namespaces()
        seen = wan("run", "100mbit", "--", "sh", "-c", f"ip netns list | grep -q '^{ISLAND}' && exit 3")
        assert seen.returncode == 3, seen.stderr  # the command ran while the namespaces existed
        assert not {COORD, ISLAND} & namespaces()
    finally:
        wan("down")


def test_a_bad_rate_fails_with_a_hint_and_leaves_nothing():
    try:
        bad = wan("up", "1gbbit")
        assert bad.returncode == 1
        assert "1gbbit" in bad.stderr and "hint" in bad.stderr
        assert not {COORD, ISLAND} & namespaces()
    finally:
        wan("down")
