"""Eight virtual CPU devices for every test, set before JAX starts its backend, and a persistent JAX
compilation cache in `.pytest_cache/jax-compilation` (cleared with `pytest --cache-clear`).

Most of the suite's time is XLA compiling the same small programs again: for every in-process run, and
in every process a test starts (they inherit the environment). With the cache, each program compiles
once per machine; a cached executable is the one compiled, so results are the same bits. Cache entries
are written under a file lock (`filelock`), so concurrent processes share the folder safely.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA:CPU's fusion emitters off: with them, compiling the tiny model's inner step took twice as long (2.4 s
# against 1.1 s), and a fresh clone's cold cache compiles every program once (docs/benchmarks.md). Every process a
# test starts keeps this flag (`mesh.without_forced_device_count` drops only the device count), so runs compared
# within the suite compile alike.
os.environ["XLA_FLAGS"] = " ".join(
    f for f in [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                "--xla_cpu_use_fusion_emitters=false"] if f
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gRPC's fork handlers off: the launcher's tests fork role processes from a worker where earlier tests left gRPC
# threads running ("skipping fork() handlers"), and one such child ended by SIGABRT before it ran (status -6,
# once, in a fresh clone's suite). Every child the suite forks execs at once and needs no gRPC state.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Bytecode for this checkout's modules (in its gitignored __pycache__ folders), even where the environment asks for
# none (PYTHONDONTWRITEBYTECODE): otherwise every process a test starts, about 120 of them, compiles island_jax's
# sources again, some 0.3 CPU seconds each (docs/benchmarks.md). Installed packages have theirs from pip.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# XLA:CPU's LLVM backend at optimization level 0: the suite's programs are small, so compiling them costs far more
# than running them, and a cold suite spends a third less time compiling (docs/benchmarks.md). The HLO passes
# are the same; every process a test starts inherits this, so runs compared within the suite compile alike.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(ROOT, ".pytest_cache", "jax-compilation")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(1 << 30)  # bytes; also turns on the file lock

from processes import corpus, run_dir, straight  # noqa: E402, F401 - fixtures of the tests that start processes

# The longest tests first, so that neither pytest-xdist worker is left with one of them at the end while the
# other waits: by the seconds each took in this clone's last run (pytest's cache, `--cache-clear` forgets them),
# else the tests that start processes first, these modules leading in this order (the longest on a fresh clone,
# docs/benchmarks.md), the rest in file order.
LONGEST_MODULES = ("test_notebook.py", "test_benchmarks.py", "test_faults.py", "test_multiprocess.py")
DURATIONS_KEY = "island_jax/durations"  # pytest cache key: {test id: seconds of its setup, call and teardown}


def pytest_collection_modifyitems(config, items):
    """Orders the run's tests longest first (see LONGEST_MODULES). Every pytest-xdist worker computes the same
    order, since the cache changes only when the whole run ends."""
    cache = getattr(config, "cache", None)  # None, or absent with `-p no:cacheprovider`
    seconds = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    if seconds and all(item.nodeid in seconds for item in items):
        items.sort(key=lambda item: -seconds[item.nodeid])
    else:  # a test this clone has not timed yet: the fixed order, so that no guess mixes with measured seconds
        def fixed(item):
            module = item.path.name
            rank = LONGEST_MODULES.index(module) if module in LONGEST_MODULES else len(LONGEST_MODULES)
            return item.get_closest_marker("slow") is None, rank

        items.sort(key=fixed)  # stable: file order within each part


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one pytest-xdist worker more than this machine's CPUs, unless
    PYTEST_XDIST_AUTO_NUM_WORKERS says otherwise. The tests that start processes spend part of their time waiting
    on a condition in those processes (a round, a heartbeat, a restart), and the extra worker runs other tests
    meanwhile (docs/benchmarks.md, "The test suite")."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return (os.cpu_count() or 1) + 1


_durations: dict = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Keeps each test's seconds for the next run's order, after a run in which every test passed (the
    pytest-xdist controller's reports hold every worker's tests; the workers themselves write nothing)."""
    config = session.config
    cache = getattr(config, "cache", None)
    if hasattr(config, "workerinput") or cache is None or exitstatus != 0 or not _durations:
        return
    known = cache.get(DURATIONS_KEY, {})
    cache.set(DURATIONS_KEY, known | {k: round(v, 2) for k, v in _durations.items()})
