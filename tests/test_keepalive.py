"""gRPC keepalive matched on both sides: an island's channel (`client_options`) pings every `keepalive_seconds`
with no call open, and the coordinator's server (`server_options`) admits those pings, so a connection idle
between two calls is never dropped. The same client against a server at gRPC's defaults is sent GOAWAY
"too_many_pings" within the same idle time, which shows the check can fail.

Both sides are built with a keepalive of KEEPALIVE_SECONDS, 1 s rather than the runs' default of 10 s, so the
idle gap is seconds long rather than most of a minute. The C core takes that interval from a client as it is (1.5 s
drops at 4.5 s); it sends an idle connection's pings at least 1 s apart, so a shorter one would change nothing.

Each case runs in a process of its own (this file run as a script, given both ends' options on its command
line), both at once, so that the C core's log, the only place that names the GOAWAY's reason, can be read from
the process's stderr. Those processes import gRPC only: island_jax (and with it JAX) is imported by this one.

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

CHUNK_BYTES = 1 << 20
KEEPALIVE_SECONDS = 1.0  # both sides' interval here (comm.keepalive_seconds); runs default to 10 s
# With gRPC's server defaults each ping without a call is a strike, and the third (max_ping_strikes = 2) earns
# a GOAWAY: 3 * KEEPALIVE_SECONDS after the last call. The gap runs a few seconds past that, for a loaded machine.
IDLE_SECONDS = 3 * KEEPALIVE_SECONDS + 5
SERVERS = ("matched", "default")  # the coordinator's server_options, and gRPC's defaults (message limits aside)


def _options(server_name: str) -> dict:
    """Both ends' options for the server `server_name` (of SERVERS): {"server": ..., "client": `client_options`}."""
    from island_jax.comm.options import client_options, message_limits, server_options

    servers = {
        "matched": server_options(CHUNK_BYTES, keepalive_seconds=KEEPALIVE_SECONDS),
        "default": message_limits(CHUNK_BYTES),
    }
    return {"server": servers[server_name], "client": client_options(CHUNK_BYTES, keepalive_seconds=KEEPALIVE_SECONDS)}


class _Health(health.HealthServicer):
    """The health service, noting each caller's address (its TCP connection's client end)."""

    def __init__(self):
        super().__init__()
        self.peers = []

    def Check(self, request, context):
        self.peers.append(context.peer())
        return super().Check(request, context)


def _idle_between_calls(options: dict) -> dict:
    """Two calls IDLE_SECONDS apart from a channel with options["client"] to a server with options["server"]
    (`_options`, as JSON gives them back); the channel's states during the gap (seconds after the first call,
    state) and the peers the server saw."""
    servicer = _Health()
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[tuple(o) for o in options["server"]])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[tuple(o) for o in options["client"]])
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
            [sys.executable, os.path.abspath(__file__), json.dumps(_options(name))],
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


def test_options_default_to_ten_seconds_and_take_an_interval():
    from island_jax import config as config_lib
    from island_jax.comm import options
    from island_jax.comm.options import client_options, server_options

    assert config_lib.default_config().comm.keepalive_seconds == options.KEEPALIVE_SECONDS == 10
    client, server = dict(client_options(CHUNK_BYTES)), dict(server_options(CHUNK_BYTES))
    assert client["grpc.keepalive_time_ms"] == 10_000
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] == 5_000
    client = dict(client_options(CHUNK_BYTES, keepalive_seconds=KEEPALIVE_SECONDS))
    server = dict(server_options(CHUNK_BYTES, keepalive_seconds=KEEPALIVE_SECONDS))
    assert client["grpc.keepalive_time_ms"] == 1_000
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] == 500
    assert dict(server_options(CHUNK_BYTES, keepalive_seconds=0.003))[
        "grpc.http2.min_recv_ping_interval_without_data_ms"] == 1  # half of 3 ms, in whole ms
    assert all(isinstance(v, int) for v in (*client.values(), *server.values()))  # gRPC takes int options


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_keepalive_that_is_not_positive_is_refused(seconds):
    from island_jax import config as config_lib
    from island_jax.comm.options import client_options, server_options

    with pytest.raises(ValueError, match="keepalive_seconds"):
        client_options(CHUNK_BYTES, keepalive_seconds=seconds)
    with pytest.raises(ValueError, match="keepalive_seconds"):
        server_options(CHUNK_BYTES, keepalive_seconds=seconds)
    config = config_lib.default_config()
    config.islands.a = config_lib.island(2, 1, 2, 8, 25)
    config_lib.validate(config)  # valid with the default interval
    config.comm.keepalive_seconds = seconds
    with pytest.raises(config_lib.ConfigError, match=r"comm\.keepalive_seconds is .*; it must be a positive"):
        config_lib.validate(config)


@pytest.mark.slow  # idles IDLE_SECONDS
def test_matched_server_keeps_an_idle_client_connected(runs):
    result, err = runs["matched"]
    assert result["before"] == "READY"
    assert result["gap"] == []  # READY throughout: no transition at all while idle
    assert result["peers"][0] == result["peers"][1]  # the second call on the same TCP connection
    assert "too_many_pings" not in err, err


@pytest.mark.slow  # idles IDLE_SECONDS
def test_default_server_sends_too_many_pings(runs):
    result, err = runs["default"]
    assert result["before"] == "READY"
    assert result["gap"] and result["gap"][0][1] == "IDLE", result["gap"]  # the connection was closed
    dropped_at = result["gap"][0][0]
    assert 2 * KEEPALIVE_SECONDS < dropped_at < IDLE_SECONDS, dropped_at  # on the third ping
    assert result["peers"][0] != result["peers"][1]  # the second call needed a new connection
    assert 'debug data equal to "too_many_pings"' in err, err


if __name__ == "__main__":
    print(json.dumps(_idle_between_calls(json.loads(sys.argv[1]))))
