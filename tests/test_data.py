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
    sizes = len(a.eval) + len(a.train["a"]) + len(a.train["b"])
    assert sizes == a.fingerprint["bytes"]  # every byte in exactly one split
    np.testing.assert_array_equal(a.train["b"], again.train["b"])


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


def test_the_held_out_set_depends_on_its_size_and_seed_only_and_pads_its_last_batch():
    stream = np.arange(10_000, dtype=np.uint32).astype(np.uint8)
    windows = data.eval_windows(stream, 16, 10, seed=0)
    order = np.random.default_rng(0).permutation((10_000 - 1) // 16)[:10]  # 624 windows; the seeded first 10
    assert windows.shape == (10, 17) and windows.dtype == np.uint8
    np.testing.assert_array_equal(windows, np.stack([stream[i * 16 : i * 16 + 17] for i in order]))
    assert data.windows_sha256(windows) == data.windows_sha256(data.eval_windows(stream, 16, 10, seed=0))
    assert data.windows_sha256(windows) != data.windows_sha256(data.eval_windows(stream, 16, 10, seed=1))
    np.testing.assert_array_equal(data.eval_windows(stream, 16, 20, seed=0)[:10], windows)  # a larger set extends it
    assert len(data.eval_windows(stream, 16, 10**6, seed=0)) == 624  # all of them, when fewer than asked
    for batch_size in (4, 5, 10):  # the same windows in batches of any size; the last one padded with zeros
        batches = data.eval_batches(windows, batch_size)
        assert [real for _, real in batches] == {4: [4, 4, 2], 5: [5, 5], 10: [10]}[batch_size]
        assert all(b.shape == (batch_size, 17) for b, _ in batches)
        np.testing.assert_array_equal(np.concatenate([b[:real] for b, real in batches]), windows)
        assert not batches[-1][0][batches[-1][1]:].any()
    mean, stderr = data.mean_and_stderr(np.array([1.0, 2.0, 3.0, 6.0], np.float32))
    assert mean == 3.0 and stderr == pytest.approx(np.sqrt(14 / 3) / 2, rel=1e-12)


def test_baseline_dp_and_two_islands_score_the_same_held_out_windows():
    from island_jax.experiment import load_config

    sets = {}
    for name in ("baseline_dp", "two_islands", "hetero_islands"):
        config = load_config(f"experiments/configs/{name}.py")
        corpus = data.load_corpus(config.data.files, config.data.eval_fraction, list(config.islands.keys()))
        windows = data.eval_windows(corpus.eval, config.model.seq_len, config.eval.num_windows, config.eval.seed)
        sets[name] = (len(windows), data.windows_sha256(windows), config.eval.batch_size)
    assert sets["baseline_dp"][:2] == sets["two_islands"][:2] == sets["hetero_islands"][:2]
    assert sets["baseline_dp"][0] == 2048 and sets["baseline_dp"][2] != sets["two_islands"][2]  # 48 and 32 per batch
