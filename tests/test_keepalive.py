"""gRPC keepalive matched on both sides: an island's channel (`client_options`) pings every KEEPALIVE_SECONDS
with no call open, and the coordinator's server (`server_options`) admits those pings, so a connection idle
between two calls is never dropped. The same client against a server at gRPC's defaults is sent GOAWAY
"too_many_pings" within the same idle time, which shows the check can fail.

Each case runs in a process of its own (this file run as a script), both at once, so that the C core's log,
the only place that names the GOAWAY's reason, can be read from the process's stderr.

Signals, taken from one idle gap between two health Check calls:
- the channel's connectivity, watched with `channel.subscribe`: a GOAWAY on an idle connection closes it and
  the channel goes READY -> IDLE (and reconnects only for the next call);
- the client's address as the server sees it (`context.peer()`): the same ip:port on both calls means the
  second call went over the same TCP connection;
- for the default server, the client's log line for a GOAWAY with debug data "too_many_pings".
"""

import json
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm.grpc_server import KEEPALIVE_SECONDS, _message_limits, client_options, server_options

pytestmark = pytest.mark.slow  # idles IDLE_SECONDS

CHUNK_BYTES = 1 << 20
# With gRPC's server defaults each ping without a call is a strike, and the third (max_ping_strikes = 2) earns
# a GOAWAY: 3 * KEEPALIVE_SECONDS after the last call. The gap runs a few seconds past that.
IDLE_SECONDS = 3 * KEEPALIVE_SECONDS + 5
SERVERS = {"matched": server_options(CHUNK_BYTES), "default": _message_limits(CHUNK_BYTES)}


class _Health(health.HealthServicer):
    """The health service, noting each caller's address (its TCP connection's client end)."""

    def __init__(self):
        super().__init__()
        self.peers = []

    def Check(self, request, context):
        self.peers.append(context.peer())
        return super().Check(request, context)


def _idle_between_calls(server_name: str) -> dict:
    """Two calls IDLE_SECONDS apart from a `client_options` channel to a server with SERVERS[server_name];
    the channel's states during the gap (seconds after the first call, state) and the peers the server saw."""
    servicer = _Health()
    server = grpc.server(futures.ThreadPoolExecutor(2), options=SERVERS[server_name])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=client_options(CHUNK_BYTES))
    states = []
    channel.subscribe(lambda state: states.append((time.monotonic(), state.name)), try_to_connect=True)
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
    deadline = time.monotonic() + 5  # the callbacks run on gRPC's thread: let READY be delivered first
    while (not states or states[-1][1] != "READY") and time.monotonic() < deadline:
        time.sleep(0.01)
    start, seen = time.monotonic(), len(states)
    time.sleep(IDLE_SECONDS)
    gap = [(round(at - start, 2), state) for at, state in states[seen:]]
    stub.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
    channel.close()
    server.stop(None)
    return {"before": states[seen - 1][1] if seen else None, "gap": gap, "peers": servicer.peers}


@pytest.fixture(scope="module")
def runs():
    """Both cases at once, each in a process of its own: server name -> (result, the process's stderr)."""
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}  # the GOAWAY's reason is logged at ERROR
    procs = {
        name: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for name in SERVERS
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=IDLE_SECONDS + 60)
        assert proc.returncode == 0, err
        results[name] = json.loads(out.splitlines()[-1]), err
    return results


def test_matched_server_keeps_an_idle_client_connected(runs):
    result, err = runs["matched"]
    assert result["before"] == "READY"
    assert result["gap"] == []  # READY throughout: no transition at all while idle
    assert result["peers"][0] == result["peers"][1]  # the second call on the same TCP connection
    assert "too_many_pings" not in err, err


def test_default_server_sends_too_many_pings(runs):
    result, err = runs["default"]
    assert result["before"] == "READY"
    assert result["gap"] and result["gap"][0][1] == "IDLE", result["gap"]  # the connection was closed
    dropped_at = result["gap"][0][0]
    assert 2 * KEEPALIVE_SECONDS < dropped_at < IDLE_SECONDS, dropped_at  # on the third ping
    assert result["peers"][0] != result["peers"][1]  # the second call needed a new connection
    assert 'debug data equal to "too_many_pings"' in err, err


if __name__ == "__main__":
    print(json.dumps(_idle_between_calls(sys.argv[1])))
