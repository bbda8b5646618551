"""Byte-level text data: corpus discovery, a deterministic split, grain pipelines, the held-out set.

The default corpus is real text found on every machine that runs island_jax:
the `.py` files of the running interpreter's standard library (located through
`sysconfig`, so no path is fixed). `data.files`, a glob, takes other text.

Split by file, deterministically: a file is held out for evaluation when the
CRC32 of its path relative to the corpus root falls in the lowest
`eval_fraction` of the range, so the held-out set does not move when files
are added elsewhere; the other files, in sorted order, are dealt round-robin
to the islands, giving disjoint training shards. A shard is the concatenation
of its files' bytes, cut into non-overlapping windows of seq_len + 1 bytes
(inputs and next-byte targets); grain shuffles and batches them. The held-out
set is a fixed sample of the held-out files' windows (`eval_windows`), the
same for every config that scores the same corpus.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grain
import numpy as np


class DataError(ValueError):
    """The corpus cannot be used as configured."""


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_files(pattern: str = "") -> tuple[Path, list[Path]]:
    """Corpus root and sorted files: `pattern` (a recursive glob) or the stdlib's *.py.

    Raises:
      DataError: if nothing matches.
    """
    if pattern:
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path(".")
    else:
        root = stdlib_root()
        skip = ("site-packages", "dist-packages")
        files = []
        # os.walk (about 15 times faster than Path.rglob here), not into symlinked folders, as rglob; the skipped
        # folders are pruned, and the filter below keeps rglob's rule for a root inside one. Sorted as Paths.
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in skip]
            files += [Path(folder, n) for n in names if n.endswith(".py") and os.path.isfile(os.path.join(folder, n))]
        files = sorted(p for p in files if not any(s in p.parts for s in skip))
    if not files:
        raise DataError(f"data.files={pattern!r} matches no files; give a glob such as '~/text/**/*.txt'")
    return root, files


@dataclass(frozen=True)
class Corpus:
    """Held-out evaluation bytes and one training shard per island.

    Attributes:
      eval_bytes: uint8 [n], the held-out files' bytes, concatenated.
      train_bytes: {island name: uint8 [n]}, each island's disjoint shard.
      fingerprint: see `load_corpus`.
    """

    eval_bytes: np.ndarray
    train_bytes: dict[str, np.ndarray]
    fingerprint: dict


def _join(contents: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(contents), np.uint8)


def load_corpus(pattern: str, eval_fraction: float, island_names: Sequence[str]) -> Corpus:
    """Reads and splits the corpus.

    Args:
      pattern: `config.data.files` ("" for the stdlib).
      eval_fraction: share of files held out, in (0, 1).
      island_names: islands in config order; each gets a disjoint shard.

    Returns:
      A Corpus whose fingerprint holds `files` (count), `bytes`, `eval_files`
      (count), `sha256` (the first 16 hex digits of the SHA-256 of the sorted
      relative paths) and `content_sha256` (of every file's relative path and
      bytes, in that order): islands whose fingerprints are equal split the same
      corpus the same way, wherever their copies of it lie.

    Raises:
      DataError: if no file matches, or the split leaves an island or the
        evaluation set without data.
    """
    root, files = find_files(pattern)
    rel = [f.relative_to(root).as_posix() for f in files]
    contents = [f.read_bytes() for f in files]
    content = hashlib.sha256()
    for path, data in zip(rel, contents):
        content.update(f"{path}\0{len(data)}\0".encode())
        content.update(data)
    threshold = int(eval_fraction * 2**32)
    held = [zlib.crc32(r.encode()) < threshold for r in rel]
    eval_files = [c for c, h in zip(contents, held) if h]
    train_files = [c for c, h in zip(contents, held) if not h]
    n = len(island_names)
    shards = {name: train_files[i::n] for i, name in enumerate(island_names)}
    if not eval_files or any(not s for s in shards.values()):
        raise DataError(
            f"{len(files)} files cannot be split into an evaluation set and {n} island shards; "
            "add files or change data.eval_fraction"
        )
    fingerprint = dict(
        files=len(files),
        bytes=sum(len(c) for c in contents),
        sha256=hashlib.sha256("\n".join(rel).encode()).hexdigest()[:16],
        content_sha256=content.hexdigest()[:16],
        eval_files=len(eval_files),
    )
    return Corpus(_join(eval_files), {k: _join(v) for k, v in shards.items()}, fingerprint)


class Windows:
    """Random-access source: item i is bytes [i*L, i*L + L + 1) of `data`, L = seq_len.

    Args:
      data: uint8 [n] bytes.
      seq_len: L, tokens (bytes) per input sequence; an item is uint8 [L + 1].

    Raises:
      DataError: fewer than L + 1 bytes.
    """

    def __init__(self, data: np.ndarray, seq_len: int):
        self.data, self.seq_len = data, seq_len
        self.count = (len(data) - 1) // seq_len
        if self.count < 1:
            raise DataError(f"{len(data)} bytes are too few for one sequence of {seq_len + 1}; add text")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.data[start : start + self.seq_len + 1]


def train_dataset(
    data: np.ndarray, seq_len: int, batch_size: int, seed: int, rows: slice | None = None
) -> grain.MapDataset:
    """Shuffled, repeating batches: `ds[step]` is a uint8 array [batch_size, seq_len + 1].

    Indexing by step makes the data position one integer (the inner step count).

    Args:
      data: uint8 [n], an island's shard.
      seq_len: bytes per input sequence (each row has one more, the last target).
      batch_size: sequences per batch.
      seed: shuffle seed (`config.seed`).
      rows: only these rows of every batch (a process of a multi-process island reads the rows its own
        devices hold, `island.Shardings.local_rows`): `ds[step]` is then [rows, seq_len + 1], and the
        processes' rows together are the whole batch, the same one a single process reads.

    Raises:
      DataError: fewer than seq_len + 1 bytes.
    """
    windows = grain.MapDataset.source(Windows(data, seq_len)).shuffle(seed=seed).repeat()
    lo, hi, _ = (rows or slice(None)).indices(batch_size)
    if (lo, hi) == (0, batch_size):
        return windows.batch(batch_size, drop_remainder=True)
    return grain.MapDataset.range(0, len(windows) // batch_size, 1).map(
        lambda step: np.stack([windows[step * batch_size + r] for r in range(lo, hi)])
    )


def eval_windows(data: np.ndarray, seq_len: int, num_windows: int, seed: int = 0) -> np.ndarray:
    """The held-out set: `num_windows` distinct windows of the held-out bytes, chosen by `seed` alone.

    The windows are `Windows(data, seq_len)`'s items at the first `num_windows` places of a permutation seeded by
    `seed` (`eval.seed`, not the run's seed, so that runs of every seed score one set), in that order: every
    config that evaluates the same corpus at the same `seq_len` and `eval.num_windows` scores the same windows,
    whatever its batch size or devices, and the set's first and second halves are two random halves.

    Args:
      data: uint8 [n], the held-out bytes (`Corpus.eval_bytes`).
      seq_len: bytes per input sequence; a window is seq_len + 1 bytes.
      num_windows: how many; when the held-out bytes hold fewer windows, all of them (in the seeded order).
      seed: `eval.seed`.

    Returns:
      uint8 [min(num_windows, len(Windows(data, seq_len))), seq_len + 1].

    Raises:
      DataError: fewer than seq_len + 1 bytes.
    """
    source = Windows(data, seq_len)
    order = np.random.default_rng(seed).permutation(len(source))[:num_windows]
    return np.stack([source[i] for i in order])


def windows_sha256(windows: np.ndarray) -> str:
    """The first 16 hex digits of the SHA-256 of a held-out set (`eval_windows`'s array, its shape included)."""
    digest = hashlib.sha256(str(windows.shape).encode())
    digest.update(np.ascontiguousarray(windows, np.uint8).tobytes())
    return digest.hexdigest()[:16]


def eval_batches(windows: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, int]]:
    """The held-out set in batches of `batch_size` windows, the last one padded with zero windows.

    Args:
      windows: uint8 [n, seq_len + 1] (`eval_windows`).
      batch_size: windows per batch (`eval.batch_size`, a multiple of the island's devices).

    Returns:
      [(uint8 [batch_size, seq_len + 1], how many of its rows are windows)], ceil(n / batch_size) of them;
      padded rows come last and are left out of every loss (`Island.evaluate`).
    """
    batches = []
    for start in range(0, len(windows), batch_size):
        part = windows[start : start + batch_size]
        real = len(part)
        if real < batch_size:
            part = np.concatenate([part, np.zeros((batch_size - real, windows.shape[1]), np.uint8)])
        batches.append((part, real))
    return batches


def mean_and_stderr(losses: np.ndarray) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-window losses (float [n], nats per byte): the standard error is
    the sample standard deviation (ddof 1) over sqrt(n); NaN for one window."""
    losses = np.asarray(losses, np.float64)
    stderr = float(np.std(losses, ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return float(np.mean(losses)), stderr


def bits_per_byte(loss: float, tokens: int, text_bytes: int) -> float:
    """Bits per byte of the underlying text: `loss` (nats per token, a mean over `tokens` tokens) x tokens, over
    the text's `text_bytes` UTF-8 bytes and ln 2. Runs of different tokenizers compare by it; on bytes (tokens
    == text_bytes) it is loss / ln 2 exactly.

    Raises:
      ValueError: `text_bytes` is not positive.
    """
    if text_bytes <= 0:
        raise ValueError(f"bits per byte of {text_bytes} bytes of text; score at least one byte")
    return loss / math.log(2) * (tokens / text_bytes)
