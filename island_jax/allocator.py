"""How a role's host memory is allocated and given back: glibc malloc's settings, in one place.

A role allocates and frees arrays of megabytes all the time (activations and device buffers on XLA:CPU, view
shards and decoded updates, chunk rows and payloads, checkpoint snapshots). glibc's malloc maps a request of at
least `M_MMAP_THRESHOLD` bytes on its own and unmaps it when freed, which costs page faults at every first
touch; below that it serves from its heaps, which keep what is freed in the resident set.

So every role `configure`s `SPEED` (`mallopt`: buffers up to 32 MiB from the heaps, freed memory kept) and gives
its freed heap memory back with `trim` (`malloc_trim(0)`) once a round (the coordinator after each merged round,
an island after each of its rounds) and after each checkpoint is written, rather than at every free. A
`MALLOC_*_` variable in the environment is the operator's explicit choice and wins over the setting it names.
Measurements: docs/benchmarks.md, "Memory allocation" and "Host memory per parameter".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt's parameter numbers (glibc's malloc.h) and the environment variables that set them at a process's start
_PARAMS = {"trim_threshold": (-1, "MALLOC_TRIM_THRESHOLD_"), "top_pad": (-2, "MALLOC_TOP_PAD_"),
           "mmap_threshold": (-3, "MALLOC_MMAP_THRESHOLD_")}
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's limit on 64-bit, bytes

# Every role's settings, bytes: buffers up to 32 MiB come from the heaps, up to 1 GiB freed at a heap's top is
# kept, and a heap grows by 64 MiB at a time.
SPEED = {"mmap_threshold": 32 << 20, "trim_threshold": 1 << 30, "top_pad": 64 << 20}


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def configure(settings: dict[str, int] = SPEED) -> list[str]:
    """Applies `settings` ({"mmap_threshold" | "trim_threshold" | "top_pad": bytes}) to this process's C
    allocator with glibc's `mallopt`, each unless its `MALLOC_*_` variable is in the environment (the operator's
    choice). Applies to allocations after the call.

    Returns:
      The names of the settings applied: none where the C library is not glibc (macOS: nothing to do).

    Raises:
      ValueError: an unknown name, a negative value, or an mmap threshold above 32 MiB (glibc's limit).
    """
    for name, value in settings.items():
        if name not in _PARAMS:
            raise ValueError(f"unknown allocator setting {name!r}; choose from {sorted(_PARAMS)}")
        if value < 0 or (name == "mmap_threshold" and value > MAX_MMAP_THRESHOLD):
            raise ValueError(f"allocator setting {name} is {value} bytes; give 0 or more"
                             f"{f', up to {MAX_MMAP_THRESHOLD} (32 MiB)' if name == 'mmap_threshold' else ''}")
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return []
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = []
    for name, value in settings.items():
        number, variable = _PARAMS[name]
        if variable not in os.environ and mallopt(number, value) == 1:
            applied.append(name)
    return applied


def trim() -> bool:
    """Gives the heaps' freed memory back to the kernel (glibc's `malloc_trim(0)`, every heap of the process).
    Costs a walk over the heaps and, later, fresh pages where the memory is used again.

    Returns:
      Whether memory was given back (False also where the C library is not glibc).
    """
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return malloc_trim(0) == 1
