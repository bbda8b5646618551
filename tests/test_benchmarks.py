"""Every script in benchmarks/ still runs: each at its `--smoke` size, in a process of its own, to its normal last line.

The figures of a smoke run are not measurements; these tests check that each
benchmark runs to the end and prints the lines docs/benchmarks.md quotes, so
the benchmarks do not rot between the times someone measures with them. The
last tests check benchmarks/_children.py, which makes a helper process or
thread that fails end its benchmark with an error instead of a hang.
"""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from island_jax.mesh import without_forced_device_count

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
R, R2 = r"\d+\.\d{3}", r"\d+\.\d{2}"  # ratios as the scripts print them: 3 decimals, or 2
F = r"-?\d+\.\d"  # bytes per parameter, one decimal (less a baseline: negative for a tiny model)

# name -> the last lines of its stdout (exact regexes, the last line last), the seconds it may take
LAST_LINES = {
    # on CPU: every check but the one that needs an accelerator beside the CPU (docs/benchmarks.md has a GPU's run)
    "accelerator_check": ([r"check mixed: not run \(needs an accelerator beside the CPU\)",
                           r"check packed: not run \(needs a GPU \(cuDNN\)\)",
                           r"accelerator_check: ran=4 not_run=2 failed=0"], 240),
    "compile_depth": ([r"load average \(1, 5, 15 min\): before .+; after .+; \d+ CPUs", rf"compile_depth: ratio={R}"],
                      120),
    "memory": ([rf"memory_shards: coordinator_bytes_per_param={F} shard_bytes_per_param={F},{F} ratio=-?{R}",
                rf"memory: fsdp_bytes_per_param={F} two_process_ratio=-?{R} replicated_bytes_per_param={F} "
                rf"coordinator_bytes_per_param={F} planner_coordinator_bytes_per_param={F}"], 300),
    "merge": ([rf"merge: ratio={R2} \(K=2 / K=1 CPU\)",
               r"merge_shards: 262144 float32 parameters, 2 contributors, 1 timed rounds per shard count; the shards of "
               r"a count take turns on this thread, \d+ CPUs",
               rf"shards=1: shard 0 CPU {R} s/round \(1\.00 of 1 shard\), wall {R} s/round; all shards CPU {R} "
               r"s/round \(1\.00 of 1 shard\)",
               rf"shards=2: shard 0 CPU {R} s/round \({R2} of 1 shard\), wall {R} s/round; shard 1 CPU {R} s/round "
               rf"\({R2} of 1 shard\), wall {R} s/round; all shards CPU {R} s/round \({R2} of 1 shard\)",
               r"merge_shards: on \d+ CPUs the shards share the cores \(here one after another\), so each shard's CPU "
               r"seconds show its share of a round; the round's wall time here is the sum of the shards', and the "
               r"speedup of shards on hosts of their own \(about the largest shard's time\) is not measured",
               rf"merge_shards: ratio={R2} \(largest shard of 2 / 1 shard CPU\)"], 120),
    "moe_layer": ([rf"moe_layer: ratio={R}"], 180),
    "scale_out": ([rf"scale_out: ratio={R2} \(P=2 / P=1 exchange seconds per round\)"], 120),
    "transport": ([rf"transport_tls: ratio={R} \(TLS / plaintext seconds, 16 connections\)", rf"transport: ratio={R}",
                   rf"overhead_vs_grpc={R}"], 120),
    "utilization": ([rf"utilization: plain={R} streaming={R}"], 300),
}


def smoke(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME.py --smoke ARGS` to its end; on `timeout` (seconds), its whole process group is
    interrupted (then killed) and the test fails with the output so far."""
    env = without_forced_device_count(os.environ)  # the benchmarks set their own devices
    cmd = [sys.executable, os.path.join(BENCHMARKS, f"{name}.py"), "--smoke", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # lets the script clean up (network namespaces, temporary folders)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{name} --smoke ran past {timeout} s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_last_lines(name: str, result: subprocess.CompletedProcess, patterns: list[str]) -> None:
    lines = result.stdout.splitlines()
    last = lines[-len(patterns):]
    assert len(last) == len(patterns) and all(re.fullmatch(p, line) for p, line in zip(patterns, last)), (
        f"{name} --smoke ended its stdout with {last!r}, expected lines matching {patterns!r}\n"
        f"--- stdout\n{result.stdout[-2000:]}\n--- stderr\n{result.stderr[-2000:]}"
    )


@pytest.mark.parametrize("name", sorted(LAST_LINES))
def test_benchmark_runs_at_smoke_size_to_its_normal_last_line(name, tmp_path):
    patterns, timeout = LAST_LINES[name]
    result = smoke(name, timeout=timeout)
    assert result.returncode == 0, f"{name} --smoke exited with {result.returncode}\n{result.stderr[-3000:]}"
    assert_last_lines(name, result, patterns)


def test_soak_with_two_coordinator_shards_kills_one_and_no_island_diverges(tmp_path):
    """The soak at smoke size (its last line as `--smoke` prints it), with the coordinator as two shards: every
    fault it injects with one coordinator, a shard's kill for the coordinator's."""
    result = smoke("soak", "--coordinator_shards=2", f"--workdir={tmp_path / 'soak'}", timeout=420)
    assert result.returncode == 0, f"soak --smoke exited with {result.returncode}\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    fired = [line for line in lines if line.startswith("soak: round ")]
    # seed 0's schedule: a reset, island b, shard 1 (a fraction 0.76 of a round after round 5's merge), a flipped bit
    assert [line.split(": ", 1)[1].split(" (")[0] for line in fired] == [
        "round 3: reset", "round 4: kill_island", "round 5: kill_shard", "round 6: corrupt"], result.stdout
    assert fired[2].startswith("soak: round 5: kill_shard (coordinator/1, ") and fired[2].endswith(
        " s after the merge, 0.76 of a round)"), result.stdout
    assert "faults: 4 (kill_island 1, kill_shard 1, reset 1, corrupt 1)" in lines, result.stdout
    assert "rounds_completed: 10 of 10" in lines, result.stdout
    lost = re.fullmatch(r"soak: faults=4 rounds_lost=(\d+) diverged=0", lines[-1])
    assert lost is not None, result.stdout[-3000:]
    assert int(lost.group(1)) <= 4, result.stdout  # one restart of the shard group: k + 2 = 4 rounds at most
    launch = (tmp_path / "soak" / "launch.log").read_text()  # the other shard restarts with the killed one
    assert "[launch] coordinator/1 exited with status -9; restarting it (restart 1 of 20" in launch, launch[-3000:]
    assert "[launch] coordinator/0 was stopped with it; restarting it (restart 1 of 20" in launch, launch[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CAP_NET_ADMIN)")
@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs `ip` and `tc` (iproute2)")
def test_sync_vs_gloo_times_a_sync_across_namespaces_and_without_torch_says_how_to_get_the_baseline():
    result = smoke("sync_vs_gloo", timeout=180)
    if importlib.util.find_spec("torch") is None:  # no baseline: ours is still timed, then it fails saying what to install
        assert result.returncode == 1, f"sync_vs_gloo --smoke exited with {result.returncode}\n{result.stderr[-3000:]}"
        assert "pip install -e '.[bench]'" in result.stderr.splitlines()[-1], result.stderr[-3000:]
        assert_last_lines("sync_vs_gloo", result,
                          [rf"one outer sync {R} s \(median of 1\); CPU s per round: island {R}, coordinator {R}"])
    else:
        assert result.returncode == 0, f"sync_vs_gloo --smoke exited with {result.returncode}\n{result.stderr[-3000:]}"
        assert_last_lines("sync_vs_gloo", result, [rf"sync_vs_gloo: ratio={R}"])


def _children():
    """benchmarks/_children.py, which the benchmarks import as a sibling module."""
    spec = importlib.util.spec_from_file_location("_children", os.path.join(BENCHMARKS, "_children.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_helper_process_that_exits_or_stalls_before_its_line_is_an_error_not_a_hang():
    children = _children()
    exits = subprocess.Popen([sys.executable, "-c", "print('starting', flush=True); raise SystemExit(3)"],
                             stdout=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match=r"exited \(status 3\) before printing its 'PORT' line"):
        children.read_line(exits, "PORT ", timeout=60)
    stalls = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match=r"printed no 'PORT' line within 1 s"):
            children.read_line(stalls, "PORT ", timeout=1)
    finally:
        stalls.kill()
        stalls.wait()


def test_a_thread_that_fails_ends_its_process_with_status_1_instead_of_leaving_it_waiting():
    code = (f"import sys, threading; sys.path.insert(0, {BENCHMARKS!r}); import _children; "
            "_children.exit_on_thread_error(); threading.Thread(target=lambda: 1 / 0, name='server').start(); "
            "threading.Event().wait()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "ZeroDivisionError" in proc.stderr and "thread server failed" in proc.stderr, proc.stderr
