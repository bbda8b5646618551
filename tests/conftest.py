"""Eight virtual CPU devices for every test, set before JAX starts its backend, and a persistent JAX
compilation cache in `.pytest_cache/jax-compilation` (cleared with `pytest --cache-clear`).

Most of the suite's time is XLA compiling the same small programs again: for every in-process run, and
in every process a test starts (they inherit the environment). With the cache, each program compiles
once per machine; a cached executable is the one compiled, so results are the same bits. Cache entries
are written under a file lock (`filelock`), so concurrent processes share the folder safely.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ["XLA_FLAGS"] = " ".join(
    f for f in [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"] if f
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
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


def pytest_collection_modifyitems(config, items):
    """The tests that start processes first: they are the longest work of the run, and the quick ones then even
    out the ends of pytest-xdist's workers."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order within each part
