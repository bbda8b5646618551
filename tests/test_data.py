"""Corpus split and pipelines."""

import numpy as np
import pytest

from island_jax import data


def _corpus(tmp_path, n=40):
    for i in range(n):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * (300 + i))
    return str(tmp_path / "*.txt")


def test_split_is_disjoint_deterministic_and_fingerprinted(tmp_path):
    pattern = _corpus(tmp_path)
    a = data.load_corpus(pattern, 0.1, ["a", "b"])
    again = data.load_corpus(pattern, 0.1, ["a", "b"])
    assert a.fingerprint == again.fingerprint
    assert a.fingerprint["files"] == 40 and a.fingerprint["bytes"] == sum(300 + i for i in range(40))
    sizes = len(a.eval_bytes) + len(a.train_bytes["a"]) + len(a.train_bytes["b"])
    assert sizes == a.fingerprint["bytes"]  # every byte in exactly one split
    np.testing.assert_array_equal(a.train_bytes["b"], again.train_bytes["b"])


def test_stdlib_is_the_default_corpus():
    root, files = data.find_files("")
    assert root == data.stdlib_root()
    assert any(f.name == "os.py" and f.parent == root for f in files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_no_match_says_what_to_do(tmp_path):
    with pytest.raises(data.DataError, match="matches no files"):
        data.load_corpus(str(tmp_path / "*.none"), 0.1, ["a"])


def test_train_batches_are_next_byte_windows():
    stream = np.arange(1000, dtype=np.uint32).astype(np.uint8)
    ds = data.train_dataset(stream, 8, 4, seed=0)
    batch = ds[3]
    assert batch.shape == (4, 9) and batch.dtype == np.uint8
    for row in batch:  # contiguous bytes from a window start (multiple of 8)
        np.testing.assert_array_equal(np.diff(row.astype(int)) % 256, 1)
    np.testing.assert_array_equal(ds[3], data.train_dataset(stream, 8, 4, seed=0)[3])


def test_eval_batches_are_fixed():
    stream = np.arange(10_000, dtype=np.uint32).astype(np.uint8)
    batches = data.eval_batches(stream, 16, 4, 3)
    assert len(batches) == 3 and batches[0].shape == (4, 17)
    np.testing.assert_array_equal(batches[0][0], stream[:17])
    np.testing.assert_array_equal(batches[-1][-1], stream[(len(stream) - 1) // 16 * 16 - 16 : (len(stream) - 1) // 16 * 16 + 1])
