"""How the host's C allocator gives memory back: large buffers straight from and to the kernel.

A role allocates and frees buffers of megabytes all the time: chunk rows and payloads on the coordinator,
shards of the global view, decoded updates, checkpoint snapshots and XLA:CPU's device buffers on an island.
glibc's malloc serves a request from its heaps unless it is at least `M_MMAP_THRESHOLD` bytes, a threshold
that starts at 128 KiB and rises (up to 32 MiB on 64-bit) each time a mapped buffer is freed. Once it has
risen, freed megabyte buffers stay in the heaps of the threads that used them, where fragmentation keeps them
from the kernel: the resident set then grows well past what is alive (docs/benchmarks.md, "Host memory per
parameter", has the measured bytes per parameter with and without this setting).

`return_large_buffers` fixes the threshold, so every buffer of at least that size is its own mapping,
returned to the kernel when freed. The cost is a fresh mapping (page faults, zeroed pages) per large
allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
DEFAULT_THRESHOLD_BYTES = 1 << 20


def return_large_buffers(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Makes this process's C allocator map every buffer of at least `threshold_bytes` on its own (glibc's
    `mallopt(M_MMAP_THRESHOLD)`), so it goes back to the kernel when freed. Call it early, before the large
    buffers are allocated; it applies to every allocation after the call.

    Args:
      threshold_bytes: bytes, at most 32 MiB (glibc's limit); 0 leaves glibc's own adaptive threshold.

    Returns:
      Whether the setting took: False with 0, or where the C library is not glibc (macOS: nothing to do).

    Raises:
      ValueError: `threshold_bytes` is negative or above 32 MiB.
    """
    if not 0 <= threshold_bytes <= 32 << 20:
        raise ValueError(f"the mmap threshold is {threshold_bytes} bytes; give 0 (glibc's default) up to 33554432 "
                         "(32 MiB)")
    if threshold_bytes == 0:
        return False
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1
