"""island_jax/outer/topk.py: the bytes of a top-k leaf, one group's decoding, and error feedback on a sparse
signal (SparseLoCo, arXiv 2508.15706)."""

import math

import numpy as np
import pytest

from island_jax.outer import topk


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096, 4096 + 10, 3 * 4096, 3 * 4096 + 100, 10_000])
def test_a_leaf_costs_the_sum_over_its_groups_of_the_packed_values_and_a_scale(n):
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    expected = sum(math.ceil(min(64, len(x[s:s + 4096])) * 14 / 8) + 4 for s in range(0, n, 4096))
    assert len(topk.encode(x, 4096, 64)) == topk.leaf_bytes(n, 4096, 64) == expected


def test_a_full_group_of_4096_with_k_64_is_116_bytes():
    assert topk.group_bytes(4096, 4096, 64) == 116
    assert round(116 * 8 / 4096, 3) == 0.227 and round(112 * 8 / 4096, 3) == 0.219  # with and without the scale


def test_one_group_decodes_to_its_64_largest_values_as_the_nearer_of_s_over_3_and_s():
    rng = np.random.default_rng(0)
    x = rng.normal(size=4096).astype(np.float32)
    out = topk.decode(topk.encode(x, 4096, 64), 4096, 4096, 64)
    largest = np.argsort(-np.abs(x), kind="stable")[:64]
    assert set(np.flatnonzero(out)) == set(largest)
    s = np.float32(np.abs(x[largest]).max())
    near = np.where(np.abs(np.abs(x[largest]) - s) <= np.abs(np.abs(x[largest]) - s / np.float32(3)), s,
                    s / np.float32(3))
    np.testing.assert_array_equal(out[largest], np.sign(x[largest]) * near)
    assert np.count_nonzero(out) == 64 and out.dtype == np.float32


def test_error_feedback_carries_a_sparse_signal_of_twice_k_within_10_percent_in_20_rounds():
    rng = np.random.default_rng(1)
    x = np.zeros(4096, np.float32)
    x[rng.choice(4096, 128, replace=False)] = rng.normal(size=128)
    residual = np.zeros_like(x)
    sent = np.zeros_like(x)
    for _ in range(20):
        buf, residual = topk.encode_with_feedback(x, residual, 4096, 64)
        sent += topk.decode(buf, 4096, 4096, 64)
    error = np.linalg.norm(sent - 20 * x) / np.linalg.norm(20 * x)
    assert error < 0.10, error


def test_bytes_of_another_length_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"a topk leaf of 4096 values \(group 4096, k 64\) is 116 bytes, not 115"):
        topk.decode(bytes(115), 4096, 4096, 64)
