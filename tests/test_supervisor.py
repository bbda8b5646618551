"""launch/local.py without JAX: the supervisor (restarts, stopping, the lines it prints) and `--dial`."""

import io
import os
import re
import signal
import sys
import time

import pytest
from launchers import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

local = launcher("local")  # once per process, shared with tests/test_entry_points.py: it defines absl flags

# Exits with status 1 the first time (leaving the marker argv[1]); the next time it prints its pid, touches
# argv[2] and exits with status 0.
FLAKY = """
import os, sys
if not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    print("first try", flush=True)
    sys.exit(1)
print(f"second try, pid {os.getpid()}", flush=True)
open(sys.argv[2], "w").close()
"""
WAITS = "import time; time.sleep(60)"  # until it is stopped
KILLS_ITSELF = "import os, signal; print('dying', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
INTERRUPTS = "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(60)"  # Ctrl-C


def role(name, code, *args):
    return local.Role(name, [sys.executable, "-c", code, *map(str, args)])


def supervise(roles, restarts=0, progress=list):
    out = io.StringIO()
    start = time.monotonic()
    failed = local.Supervisor(roles, restarts, out=out, interval=0.05, grace=5.0).run(progress)
    return failed, out.getvalue(), time.monotonic() - start


def lines(out, prefix):
    """The lines that start with `prefix`, with every pid written N."""
    return [re.sub(r"pid \d+", "pid N", line) for line in out.splitlines() if line.startswith(prefix)]


def assert_all_gone(out):
    """Every process the lines name has ended (and was waited for)."""
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_failed_role_is_started_again_and_the_run_succeeds(tmp_path):
    marker, done = tmp_path / "failed_once", tmp_path / "done"
    said = []

    def progress():  # a line at the first poll, before any check; one more once b has run to its end
        if not said:
            said.append(1)
            return ["round 1/2"]
        if done.exists() and len(said) == 1:
            said.append(2)
            return ["round 2/2"]
        return []

    failed, out, _ = supervise(
        [role("coordinator", "print('finished', end='')"), role("island b", FLAKY, marker, done)], 2, progress
    )
    assert failed is None
    assert lines(out, "[launch]") == [
        "[launch] started coordinator (pid N)",
        "[launch] started island b (pid N)",
        "[launch] round 1/2",
        "[launch] island b exited with status 1; restarting it (restart 1 of 2, pid N)",
        "[launch] round 2/2 | restarts: island b 1",
    ]
    assert lines(out, "[island b]") == ["[island b] first try", "[island b] second try, pid N"]
    assert lines(out, "[coordinator]") == ["[coordinator] finished"]  # status 0: done, not started again
    restarted = re.search(r"restarting it \(restart 1 of 2, pid (\d+)\)", out)[1]
    assert f"[island b] second try, pid {restarted}\n" in out  # the pid in the line is the new process's
    # A role's last lines come before the launcher's line about its end.
    assert out.index("[island b] first try") < out.index("restarting it") < out.index("[island b] second try")
    assert_all_gone(out)


def test_without_restarts_the_first_failure_stops_every_process(tmp_path):
    roles = [role("coordinator", WAITS), role("island a", WAITS), role("island b", FLAKY, tmp_path / "m", tmp_path / "d")]
    failed, out, seconds = supervise(roles, 0)
    assert failed == ("island b", 1)
    assert lines(out, "[launch]") == [
        "[launch] started coordinator (pid N)",
        "[launch] started island a (pid N)",
        "[launch] started island b (pid N)",
        "[launch] island b exited with status 1; stopping the other processes",
    ]
    assert lines(out, "[island b]") == ["[island b] first try"]
    assert seconds < 30  # the waiting roles were stopped, not waited for
    assert_all_gone(out)


def test_a_role_that_fails_beyond_its_restarts_stops_every_process():
    failed, out, seconds = supervise([role("coordinator", WAITS), role("island b", KILLS_ITSELF)], 2)
    assert failed == ("island b", -9)
    assert lines(out, "[launch]") == [
        "[launch] started coordinator (pid N)",
        "[launch] started island b (pid N)",
        "[launch] island b exited with status -9; restarting it (restart 1 of 2, pid N)",
        "[launch] island b exited with status -9; restarting it (restart 2 of 2, pid N)",
        "[launch] island b exited with status -9; stopping the other processes",
    ]
    assert lines(out, "[island b]") == ["[island b] dying"] * 3
    assert seconds < 30
    assert_all_gone(out)


def test_ctrl_c_stops_every_process_and_restarts_none():
    # Ctrl-C raises KeyboardInterrupt here as in the launcher, whatever handler the test runner's process has
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        failed, out, seconds = supervise([role("coordinator", WAITS), role("island b", INTERRUPTS)], 2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert failed == ("launch", 130)
    assert lines(out, "[launch]") == [
        "[launch] started coordinator (pid N)",
        "[launch] started island b (pid N)",
        "[launch] interrupted; stopping every process",
    ]
    assert seconds < 30
    assert_all_gone(out)


def test_restarts_must_not_be_negative():
    with pytest.raises(ValueError, match="restarts is -1; it must be 0 or more"):
        local.Supervisor([role("coordinator", WAITS)], -1)


@pytest.mark.parametrize("dial", ["", "proxy.example.org:50051", "10.0.0.1:1", "[::1]:50051"])
def test_dial_addresses_that_are_taken(dial):
    assert local.check_dial(dial, 50051, namespaces=False) == dial


def test_no_dial_is_taken_with_namespaces_and_any_port():
    assert local.check_dial("", 0, namespaces=True) == ""


@pytest.mark.parametrize(
    "dial, port, namespaces, message",
    [
        ("proxy", 50051, False, "--dial: cannot read 'proxy'; give HOST:PORT, e.g. --dial=proxy.example.org:50051"),
        (":50051", 50051, False, "--dial: cannot read ':50051'; give HOST:PORT"),
        ("proxy:http", 50051, False, "--dial: cannot read 'proxy:http'; give HOST:PORT"),
        ("proxy:70000", 50051, False, "--dial: cannot read 'proxy:70000'; give HOST:PORT"),
        ("proxy:50051", 50051, True, "--dial cannot be combined with --netns_coordinator/--netns_islands: with "
         "namespaces islands dial the coordinator namespace's own address"),
        ("proxy:50051", 0, False, "--dial needs --port: whatever forwards the dialled address to the coordinator "
         "must know the port it listens on"),
    ],
)
def test_dial_refuses_what_cannot_work(dial, port, namespaces, message):
    with pytest.raises(ValueError) as e:
        local.check_dial(dial, port, namespaces)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "specs, message",
    [
        (["z=0"], "--cpus: no role 'z' (roles: coordinator, a, b)"),
        (["a"], "--cpus: cannot read 'a'; give ROLE=CPUS"),
        (["a=0-x"], "--cpus: cannot read CPUs '0-x' of 'a'; write them as in 0,2-3"),
        (["a=4096"], "--cpus: CPUs [4096] of 'a' are not available here; this process may use"),
        (["a=0", "a=0"], "--cpus: role 'a' is placed twice"),
    ],
)
def test_cpus_refuses_bad_placements(specs, message):
    with pytest.raises(ValueError) as e:
        local.parse_cpus(specs, ["coordinator", "a", "b"], os.sched_getaffinity(0))
    assert str(e.value).startswith(message)


def test_cpus_takes_lists_and_ranges():
    available = os.sched_getaffinity(0)
    first = min(available)
    assert local.parse_cpus([f"a={first}", f"coordinator={first}-{first}"], ["coordinator", "a", "b"], available) == {
        "a": {first}, "coordinator": {first}}


# The roles of a run (`plan_roles`): render only, nothing started.
ISLANDS = {"islands": {"a": {"num_processes": 1}, "b": {"num_processes": 2}}}
OVERRIDES = ["--config=/cfg/two_islands.py", "--config.coordinator.shards=3"]


def plan(listen, dial, **kwargs):
    from ml_collections import ConfigDict

    roles = local.plan_roles(ConfigDict(ISLANDS), "/w", listen, dial, OVERRIDES, ["--role=coordinator"],
                             {"a": ["--config.comm.auth.token_file=/s/token_a"]}, env={}, island_port=lambda ns: 7000,
                             **kwargs)
    found = []
    for r in roles:  # (name, group, the arguments after --workdir, CPUs, namespace)
        head = [*(["ip", "netns", "exec", r.netns] if r.netns else []), sys.executable, "-u", str(local.TRAIN), "--workdir=/w"]
        assert r.command[:len(head)] == head and r.env == {}
        found.append((r.name, r.group, r.command[len(head):], sorted(r.cpus) if r.cpus else None, r.netns))
    return found


def test_one_coordinator_is_the_role_coordinator_with_one_address():
    roles = plan(["localhost:5000"], ["localhost:5000"], cpus={"coordinator": {0}, "b": {1}})
    assert roles == [
        ("coordinator", "", ["--coordinator=localhost:5000", *OVERRIDES, "--role=coordinator"], [0], ""),
        ("island a", "", ["--coordinator=localhost:5000", *OVERRIDES, "--role=island", "--island=a",
                          "--config.comm.auth.token_file=/s/token_a"], None, ""),
        *((f"island b/{i}", "island b", ["--coordinator=localhost:5000", *OVERRIDES, "--role=island", "--island=b",
                                         f"--process_id={i}", "--island_coordinator=localhost:7000"], [1], "")
          for i in (0, 1)),
    ]


def test_a_coordinator_of_three_shards_is_three_roles_that_restart_as_one():
    listen = ["localhost:5000", "localhost:5001", "localhost:5002"]
    dial = ["proxy:6000", "proxy:6001", "proxy:6002"]
    roles = plan(listen, dial, shard_service="localhost:5100", coordinator_ns="ij-coord",
                 island_ns={"a": "ij-island"}, cpus={"coordinator": {0}, "coordinator/2": {3}})
    assert roles[:3] == [
        (f"coordinator/{k}", "coordinator",
         ["--coordinator=localhost:5000,localhost:5001,localhost:5002", *OVERRIDES, "--role=coordinator",
          f"--shard={k}", "--shard_service=localhost:5100"], [3] if k == 2 else [0], "ij-coord")
        for k in range(3)]
    assert [(name, group, netns) for name, group, _, _, netns in roles[3:]] == [
        ("island a", "", "ij-island"), ("island b/0", "island b", "ij-coord"), ("island b/1", "island b", "ij-coord")]
    for _, _, command, _, _ in roles[3:]:  # every island dials every shard, shard 0 first
        assert command[0] == "--coordinator=proxy:6000,proxy:6001,proxy:6002"
        assert not [a for a in command if a.startswith(("--shard", "--role=coordinator"))]
    # the supervisor counts the shards' restarts once, under their group
    assert local.Supervisor([local.Role(n, ["true"], group=g) for n, g, *_ in roles]).restarted == {
        "coordinator": 0, "island a": 0, "island b": 0}


def test_dial_lists_one_address_per_shard():
    assert local.check_dial("p:1,p:2", 50051, namespaces=False, shards=2) == "p:1,p:2"
    with pytest.raises(ValueError, match=r"^--dial lists 1 address\(es\) but coordinator\.shards is 2: give one "
                                         r"HOST:PORT per coordinator shard, shard 0 first"):
        local.check_dial("p:1", 50051, namespaces=False, shards=2)
    with pytest.raises(ValueError, match=r"^--dial: cannot read 'p'; give HOST:PORT"):
        local.check_dial("p:1,p", 50051, namespaces=False, shards=2)


def test_cpus_places_the_shards_together_or_one_by_one_but_not_both():
    roles = ["coordinator", "coordinator/0", "coordinator/1", "a"]
    first = min(os.sched_getaffinity(0))
    assert local.parse_cpus([f"coordinator/1={first}"], roles, os.sched_getaffinity(0)) == {"coordinator/1": {first}}
    with pytest.raises(ValueError) as e:
        local.parse_cpus([f"coordinator={first}", f"coordinator/1={first}"], roles, os.sched_getaffinity(0))
    assert str(e.value) == ("--cpus: coordinator and coordinator/1 are both placed; give coordinator=CPUS for all of "
                            "its processes, or coordinator/K=CPUS for each, not both")
