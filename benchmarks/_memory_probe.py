"""Runs `experiments/train.py` with its arguments, sampling where this process's memory goes: for benchmarks/memory.py.

  python benchmarks/_memory_probe.py OUT.json experiments/train.py --config=... --role=...

Every `SAMPLE_SECONDS` a thread reads the process's resident set (`/proc/self/statm`), the bytes of the JAX
arrays alive on this process's devices (`jax.live_arrays()`: every addressable shard, once the backend is up)
and, with `MEMORY_PROBE_TRACEMALLOC=1`, the bytes Python and NumPy hold on the host (`tracemalloc`: NumPy
reports its data buffers to it). At exit it writes OUT.json: the sample taken at the largest resident set, with
each part in bytes, and with tracemalloc the `TOP_LINES` source lines that held the most host bytes then
(from a snapshot taken when the peak last grew by 5%). The device buffers of XLA:CPU live in host memory but outside tracemalloc's view, so at the
peak: resident = device arrays + traced host memory + the rest (the runtime, compiled programs, XLA's
temporaries, allocator slack).

The probe reads only: train.py runs exactly as it would without it (tracemalloc slows allocation and adds a
little memory of its own, which is why it is off unless asked for).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import time
import tracemalloc

SAMPLE_SECONDS = 0.2
TOP_LINES = 8  # with tracemalloc: the source lines that hold the most host bytes at the peak
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _device_bytes() -> int:
    """Bytes of every live JAX array's shards on this process's devices; 0 before the backend is up (asking
    earlier would start it before train.py sets its device count)."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        return 0
    import jax

    total = 0
    for x in jax.live_arrays():
        try:
            if not x.is_deleted():
                total += sum(s.data.nbytes for s in x.addressable_shards)
        except Exception:  # noqa: BLE001 - deleted by another thread meanwhile: not alive
            pass
    return total


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    traced = os.environ.get("MEMORY_PROBE_TRACEMALLOC") == "1"
    if traced:
        tracemalloc.start(1)
    peak = {"resident_bytes": 0, "device_bytes": 0, "host_traced_bytes": 0, "seconds": 0.0}
    start, stop = time.monotonic(), threading.Event()

    snapped = [0]  # the resident bytes at the last snapshot of the traced allocations

    def sample() -> None:
        while not stop.wait(SAMPLE_SECONDS):
            resident = _resident()
            if resident > peak["resident_bytes"]:
                peak.update(resident_bytes=resident, device_bytes=_device_bytes(),
                            host_traced_bytes=tracemalloc.get_traced_memory()[0] if traced else 0,
                            seconds=time.monotonic() - start)
                if traced and resident > 1.05 * snapped[0]:  # where the host bytes were allocated, by line
                    snapped[0] = resident
                    stats = tracemalloc.take_snapshot().statistics("lineno")[:TOP_LINES]
                    peak["top"] = [[f"{s.traceback[0].filename}:{s.traceback[0].lineno}", s.size] for s in stats]

    def write() -> None:
        stop.set()
        peak["traced"] = traced
        with open(out, "w") as f:
            json.dump(peak, f)

    threading.Thread(target=sample, name="memory probe", daemon=True).start()
    atexit.register(write)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
