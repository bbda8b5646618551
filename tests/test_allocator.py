"""glibc malloc's settings for the roles, and giving freed memory back (island_jax/allocator.py)."""

import os
import sys

import numpy as np
import pytest

from island_jax import allocator

MIB = 1 << 20
glibc = pytest.mark.skipif(sys.platform != "linux", reason="mallopt and malloc_trim are glibc's")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@glibc
def test_trim_gives_what_the_heaps_keep_back_to_the_kernel(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    assert allocator.configure() == ["mmap_threshold", "trim_threshold", "top_pad"]
    buffers = [np.ones(4 * MIB, np.uint8) for _ in range(16)]  # 64 MiB, touched, from the heaps
    held = _resident()
    del buffers
    kept = _resident()
    assert held - kept < 16 * MIB  # SPEED keeps most of what was freed (1 GiB may stay at a heap's top) ...
    assert allocator.trim() is True
    assert kept - _resident() >= 48 * MIB  # ... until it is trimmed


def test_a_malloc_variable_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MIB))
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    expected = ["trim_threshold"] if sys.platform == "linux" else []
    assert allocator.configure() == expected


def test_a_bad_setting_is_refused_naming_it():
    with pytest.raises(ValueError, match="mmap_threshold is 33554433 bytes; give 0 or more, up to 33554432"):
        allocator.configure({"mmap_threshold": 32 * MIB + 1})
    with pytest.raises(ValueError, match="top_pad is -1 bytes; give 0 or more"):
        allocator.configure({"top_pad": -1})
    with pytest.raises(ValueError, match="unknown allocator setting 'arena_max'"):
        allocator.configure({"arena_max": 2})
