"""Top-k sparsification of a pseudo-gradient by groups, with two magnitude levels (SparseLoCo, arXiv 2508.15706).

The `topk` codec's arithmetic on one flat float32 leaf (or piece of a leaf, which always holds whole groups).
For each group of `group` consecutive values (the last may be shorter), the `k` values of largest magnitude are
kept (ties to the lower index). Each kept value is sent as its index in the group (ceil(log2(group)) bits, 12
for 4096), its sign (1 bit) and one of two magnitudes, {s/3, s}, the nearer one (1 bit), where s is the group's
largest kept magnitude, sent once as a float32. A group of length L thus costs

    ceil(min(k, L) x (ceil(log2(group)) + 2) / 8) + 4 bytes,

116 bytes for a full group of 4096 with k = 64: 0.227 bits per parameter with the scale, 0.219 without.
The values a group does not keep decode to zero; with error feedback (`encoder.ChunkEncoder`'s residual, always
on for this codec) they are carried into the next round's input, as SparseLoCo does. `encoder.py` puts it on the
chunked wire; `chunk_step.py` merges its contributions with a sparse add and encodes the coordinator's update.
"""

from __future__ import annotations

import math

import numpy as np

SCALE_BYTES = 4  # one float32 per group: its largest kept magnitude


def index_bits(group: int) -> int:
    """Bits of a kept value's index in its group: ceil(log2(group)), at least 1."""
    return max(1, math.ceil(math.log2(group)))


def group_bytes(length: int, group: int, k: int) -> int:
    """Bytes of one encoded group of `length` values (at most `group`): the packed kept values and the scale."""
    return math.ceil(min(k, length) * (index_bits(group) + 2) / 8) + SCALE_BYTES


def leaf_bytes(size: int, group: int, k: int) -> int:
    """Bytes of an encoded leaf of `size` values: the sum over its groups of `group_bytes`."""
    full, rest = divmod(size, group)
    return full * group_bytes(group, group, k) + (group_bytes(rest, group, k) if rest else 0)


def kept(size: int, group: int, k: int) -> int:
    """Values a leaf of `size` values keeps: the sum over its groups of min(k, length)."""
    full, rest = divmod(size, group)
    return full * min(k, group) + min(k, rest)


def _check(group: int, k: int) -> None:
    if group < 1 or k < 1:
        raise ValueError(f"topk group {group} and k {k}: both must be at least 1")


def _runs(size: int, group: int):
    """(first value, groups, length) of the leaf's runs of equal-length groups: the full ones, then a short one."""
    full, rest = divmod(size, group)
    if full:
        yield 0, full, group
    if rest:
        yield full * group, 1, rest


def select(values: np.ndarray, k: int) -> np.ndarray:
    """The positions each row of float32 `values` [G, L] keeps: int64 [G, min(k, L)], increasing in each row.

    A row keeps its min(k, L) values of largest magnitude; among equal magnitudes at the threshold, the lower
    positions (the rule SparseLoCo's `torch.topk` leaves open, fixed here so that every machine keeps the same).
    """
    groups, length = values.shape
    keep = min(k, length)
    if keep == length:
        return np.broadcast_to(np.arange(length), (groups, length)).copy()
    magnitude = np.abs(values)
    if np.isnan(magnitude).any():  # kept first, so that the coordinator sees the NaN and refuses the contribution
        magnitude = np.where(np.isnan(magnitude), np.inf, magnitude)
    threshold = np.partition(magnitude, length - keep, axis=1)[:, length - keep : length - keep + 1]
    above = magnitude > threshold
    at = magnitude == threshold
    ties = keep - above.sum(axis=1, keepdims=True)
    mask = above | (at & (np.cumsum(at, axis=1) <= ties))
    return np.nonzero(mask)[1].reshape(groups, keep)


def encode(x: np.ndarray, group: int, k: int) -> bytes:
    """The bytes of a flat float32 leaf `x` [n], group after group (module docstring): for each, its scale
    (float32, little-endian) and then its kept values' codes, (index << 2 | sign << 1 | magnitude bit), each of
    index_bits(group) + 2 bits, most significant first, in increasing index order, packed into whole bytes.

    Raises:
      ValueError: `group` or `k` below 1, or `x` not one-dimensional.
    """
    _check(group, k)
    x = np.asarray(x, np.float32)
    if x.ndim != 1:
        raise ValueError(f"topk encodes a flat leaf; got shape {x.shape}")
    width = index_bits(group) + 2
    out = []
    for start, groups, length in _runs(x.size, group):
        values = x[start : start + groups * length].reshape(groups, length)
        chosen = select(values, k)
        kept_values = np.take_along_axis(values, chosen, axis=1)
        scale = np.abs(kept_values).max(axis=1).astype(np.float32)
        high = np.abs(kept_values) * np.float32(3) >= np.float32(2) * scale[:, None]  # nearer to s than to s/3
        codes = (chosen << 2) | ((kept_values < 0).astype(np.int64) << 1) | high.astype(np.int64)
        bits = ((codes[:, :, None] >> np.arange(width - 1, -1, -1)) & 1).astype(np.uint8)
        packed = np.packbits(bits.reshape(groups, -1), axis=1)
        rows = np.empty((groups, SCALE_BYTES + packed.shape[1]), np.uint8)
        rows[:, :SCALE_BYTES] = scale.astype("<f4").view(np.uint8).reshape(groups, SCALE_BYTES)
        rows[:, SCALE_BYTES:] = packed
        out.append(rows.tobytes())
    return b"".join(out)


def decode_sparse(buf, size: int, group: int, k: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The kept values of a leaf of `size` values from `encode`'s bytes at `offset` of `buf` (bytes or a buffer):
    (positions int64 [kept(size, group, k)], increasing; float32 values, each ±s or ±s/3 of its group).

    Raises:
      ValueError: `buf` holds fewer than `leaf_bytes(size, group, k)` bytes from `offset`.
    """
    _check(group, k)
    need = leaf_bytes(size, group, k)
    if len(memoryview(buf).cast("B")) - offset < need:
        raise ValueError(f"a topk leaf of {size} values (group {group}, k {k}) is {need} bytes, not "
                         f"{len(memoryview(buf).cast('B')) - offset}")
    width = index_bits(group) + 2
    weights = np.int64(1) << np.arange(width - 1, -1, -1)
    positions, values, at = [], [], offset
    for start, groups, length in _runs(size, group):
        keep, nbytes = min(k, length), group_bytes(length, group, k)
        rows = np.frombuffer(buf, np.uint8, groups * nbytes, at).reshape(groups, nbytes)
        scale = rows[:, :SCALE_BYTES].copy().view("<f4").astype(np.float32)  # [groups, 1]
        bits = np.unpackbits(rows[:, SCALE_BYTES:], axis=1)[:, : keep * width].reshape(groups, keep, width)
        codes = bits.astype(np.int64) @ weights  # [groups, keep]
        magnitude = np.where(codes & 1, scale, scale / np.float32(3)).astype(np.float32)
        values.append(np.where(codes & 2, -magnitude, magnitude).reshape(-1))
        positions.append((start + length * np.arange(groups)[:, None] + (codes >> 2)).reshape(-1))
        at += groups * nbytes
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(positions), np.concatenate(values)


def decode(buf, size: int, group: int, k: int) -> np.ndarray:
    """A leaf of `size` values from `encode`'s bytes: float32 [size], the kept values as ±s or ±s/3, zeros
    elsewhere.

    Raises:
      ValueError: `buf` is not `leaf_bytes(size, group, k)` long.
    """
    if len(memoryview(buf).cast("B")) != leaf_bytes(size, group, k):
        raise ValueError(f"a topk leaf of {size} values (group {group}, k {k}) is {leaf_bytes(size, group, k)} "
                         f"bytes, not {len(memoryview(buf).cast('B'))}")
    positions, values = decode_sparse(buf, size, group, k)
    out = np.zeros(size, np.float32)
    out[positions] = values
    return out
