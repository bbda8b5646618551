"""Large host buffers mapped on their own (island_jax/allocator.py), so that freeing one gives it back."""

import ctypes
import sys

import numpy as np
import pytest

from island_jax.allocator import DEFAULT_THRESHOLD_BYTES, return_large_buffers

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h), fields of size_t
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """Bytes the C allocator holds in buffers mapped on their own (`hblkhd`)."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2().hblkhd


@pytest.mark.skipif(sys.platform != "linux", reason="mallopt and mallinfo2 are glibc's")
def test_buffers_from_the_threshold_up_are_mapped_and_given_back():
    try:
        assert return_large_buffers(32 * MIB)
        before = _mapped_bytes()
        small = np.ones(2 * MIB, np.uint8)  # under 32 MiB: from the heap
        assert _mapped_bytes() == before
        del small
        assert return_large_buffers(MIB)
        large = np.ones(2 * MIB, np.uint8)  # over 1 MiB: a mapping of its own ...
        assert _mapped_bytes() - before >= 2 * MIB
        del large
        assert _mapped_bytes() == before  # ... unmapped when freed
    finally:
        return_large_buffers(DEFAULT_THRESHOLD_BYTES)  # what the roles run with


def test_zero_keeps_glibcs_threshold_and_a_bad_one_is_refused():
    assert return_large_buffers(0) is False
    for bad in (-1, 32 * MIB + 1):
        with pytest.raises(ValueError, match="0 \\(glibc's default\\) up to 33554432"):
            return_large_buffers(bad)
