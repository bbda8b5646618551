"""Text data: the byte corpus or prepared token records, a deterministic split, grain pipelines, held-out sets.

Two kinds of data, one pipeline (`load`):

- **Bytes** (the default, `data.prepared = ""`): the text files below, byte by byte.
- **Prepared records** (`data.prepared = PATH`, island_jax/prepared.py): token records packed with segment
  ids. An island reads that dataset, or data of its own (`islands.NAME.data`: a dataset, or a mixture
  "PATH,WEIGHT;PATH,WEIGHT" sampled by weight). Every dataset's training records are split between the
  islands that read it: record i to the (i mod n)-th of those n islands, in config order. The shared
  dataset's eval split is the shared held-out set, and an island with data of its own also scores that
  data's eval split.

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

import dataclasses
import glob
import hashlib
import math
import os
import sys
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
    """The held-out set and each island's training data.

    Attributes:
      eval: the shared held-out source: uint8 [n] bytes (the held-out files' bytes, concatenated), or a
        `grain.MapDataset` of int32 [2, S + 1] packed records (a prepared dataset's eval split).
      train: {island name: its training data}: uint8 [n] bytes (a disjoint shard), or a `grain.MapDataset` of
        packed records (finite: its share; endless: a mixture).
      fingerprint: see `load_corpus` and `load`.
      own_eval: {island name: the eval records of the island's own data} for islands with data of their own.
      token_bytes: int32 [vocab] UTF-8 bytes of text per token of a prepared dataset; None for bytes (1 each).
    """

    eval: np.ndarray | grain.MapDataset
    train: dict
    fingerprint: dict
    own_eval: dict = dataclasses.field(default_factory=dict)
    token_bytes: np.ndarray | None = None


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


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """`islands.NAME.data`: "PATH" or "PATH,WEIGHT;PATH,WEIGHT;..." -> [(path, weight)], weights as given.

    Raises:
      DataError: a weight that is not a positive number, or an empty part.
    """
    parts = []
    for part in spec.split(";"):
        path, _, weight = part.strip().rpartition(",") if "," in part else (part.strip(), "", "1")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not path.strip() or not w > 0:
            raise DataError(f"islands.*.data is {spec!r}; give a prepared dataset's folder, or a mixture "
                            "'PATH,WEIGHT;PATH,WEIGHT' with positive weights")
        parts.append((path.strip(), w))
    return parts


def _concatenated(datasets: Sequence[grain.MapDataset]) -> grain.MapDataset:
    """The items of `datasets` one after another (each finite)."""
    if len(datasets) == 1:
        return datasets[0]
    ends = np.cumsum([len(d) for d in datasets])

    def item(i: int):
        k = int(np.searchsorted(ends, i, side="right"))
        return datasets[k][i - (int(ends[k - 1]) if k else 0)]

    return grain.MapDataset.range(int(ends[-1])).map(item)


def _dataset_key(path: str) -> str:
    """A prepared dataset's identity in a config: its path with `~` and `..` resolved."""
    return os.path.normpath(os.path.expanduser(path))


def sharing(config, island_names: Sequence[str]) -> dict:
    """Who reads which dataset, from the config alone: {island: [[dataset, reader index, readers, weight], ...]},
    a dataset named by its first reader's island and the index in that island's mixture. Every dataset's
    training records are split between the islands that read it (record i to the (i mod n)-th of those n
    islands, in config order); islands join with this plan (`config.fingerprint_fields`), so that roles whose
    configs spread the data otherwise are refused before they train on overlapping records. Datasets are the
    same when their paths are, after `~` and `..` are resolved ({} without `data.prepared`).
    """
    if not config.data.get("prepared", ""):
        return {}
    specs = {n: config.islands[n].get("data", "") for n in island_names}
    mixtures = {n: parse_mixture(specs[n]) if specs[n] else [(config.data.prepared, 1.0)] for n in island_names}
    names: dict[str, str] = {}  # path -> the dataset's name in the plan
    readers: dict[str, list[str]] = {}
    for n in island_names:
        for k, (path, _) in enumerate(mixtures[n]):
            key = _dataset_key(path)
            names.setdefault(key, f"{n}:{k}")
            if n not in readers.setdefault(key, []):
                readers[key].append(n)
    return {n: [[names[key], readers[key].index(n), len(readers[key]), w]
                for key, w in ((_dataset_key(p), w) for p, w in mixtures[n])]
            for n in island_names}


def load(config, island_names: Sequence[str], island: str | None = None) -> Corpus:
    """The run's data for `island` (every island when None): the byte corpus (`load_corpus`) or, with
    `data.prepared`, prepared records (module docstring; `sharing` says which island reads which records).
    Only `island`'s own datasets are opened, so an island needs only its own data and the shared dataset on
    its host.

    Returns:
      A Corpus; with prepared data its fingerprint is the shared dataset's (`PreparedDataset.fingerprint`), the
      one every island must read the same, and `train` holds `island`'s data (every island's when None).

    Raises:
      DataError: naming the field (`data.prepared`, `islands.NAME.data`): a missing or unfinished prepared
        folder, a split without records (an own dataset's eval split, which `own_eval` scores, included), fewer
        training records than the islands that split them, a dataset of another tokenizer or record length
        than the shared one.
      ConfigError: `model.vocab_size` below the tokenizer's vocabulary, or `model.seq_len` not the records'.
    """
    from island_jax import prepared as prepared_lib
    from island_jax.config import ConfigError

    if not config.data.get("prepared", ""):
        return load_corpus(config.data.files, config.data.eval_fraction, island_names)

    def opened(path: str, field: str):
        try:
            return prepared_lib.PreparedDataset(path)
        except DataError as e:
            raise DataError(f"{field}: {e}") from None

    def split(dataset, which: str, field: str):
        try:
            return dataset.records(which)
        except DataError as e:
            own = " (an island with data of its own scores its eval split: own_eval)" if which == "eval" and \
                field != "data.prepared" else ""
            raise DataError(f"{field}: {e}{own}") from None

    shared = opened(config.data.prepared, "data.prepared")
    if config.model.vocab_size < shared.vocab_size:
        raise ConfigError(f"model.vocab_size is {config.model.vocab_size} but the tokenizer of {shared.path} has "
                          f"{shared.vocab_size} tokens; set model.vocab_size to at least {shared.vocab_size}")
    if config.model.seq_len != shared.seq_len:
        raise ConfigError(f"model.seq_len is {config.model.seq_len} but {shared.path} holds records of "
                          f"{shared.seq_len} predictions ({shared.seq_len + 1} tokens); set "
                          f"model.seq_len={shared.seq_len}, or prepare the data with --seq_len={config.model.seq_len}")
    plan = sharing(config, island_names)
    train, own_eval = {}, {}
    for name in island_names:
        if island is not None and name != island:
            continue
        spec = config.islands[name].get("data", "")
        field = f"islands.{name}.data" if spec else "data.prepared"
        parts = []
        for (path, weight), (_, index, readers, _) in zip(parse_mixture(spec) if spec else
                                                          [(config.data.prepared, 1.0)], plan[name]):
            dataset = shared if _dataset_key(path) == _dataset_key(config.data.prepared) else opened(path, field)
            if dataset.tokenizer_hash != shared.tokenizer_hash:
                raise DataError(f"{field} names {path}, prepared with tokenizer {dataset.tokenizer_hash}, but "
                                f"data.prepared ({shared.path}) has tokenizer {shared.tokenizer_hash}; prepare it with "
                                f"the shared dataset's tokenizer ({prepared_lib.tokenizer_flags(shared)})")
            if dataset.seq_len != shared.seq_len:
                raise DataError(f"{field} names {path}, whose records hold {dataset.seq_len} predictions, but "
                                f"data.prepared's hold {shared.seq_len}; prepare it with --seq_len={shared.seq_len}")
            records = split(dataset, "train", field)
            if len(records) < readers:
                raise DataError(f"{field}: the {len(records)} training records of {dataset.path} cannot be split "
                                f"between the {readers} islands that read it; prepare more text")
            parts.append((records[index::readers], dataset, weight))
        if len(parts) == 1:
            train[name] = parts[0][0]
        else:  # each part shuffled and repeated on its own, then drawn from by weight: an endless mixture
            endless = [share.shuffle(seed=config.seed + i).repeat() for i, (share, _, _) in enumerate(parts)]
            train[name] = grain.MapDataset.mix(endless, [w for _, _, w in parts])
        if spec and not (len(parts) == 1 and parts[0][1] is shared):  # the shared set is scored already
            own_eval[name] = _concatenated([split(d, "eval", field) for _, d, _ in parts])
    return Corpus(split(shared, "eval", "data.prepared"), train, shared.fingerprint(), own_eval, shared.token_bytes)


def scored(windows: np.ndarray, token_bytes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(targets, bytes of text) each window of a held-out set predicts: int64 [n] each.

    Args:
      windows: `eval_windows`' array: uint8 [n, S + 1] byte windows (S targets of one byte each), or int32
        [n, 2, S + 1] packed records (the targets whose segment is not 0, and their tokens' bytes).
      token_bytes: `Corpus.token_bytes` (needed for records).
    """
    if windows.ndim == 2:
        count = np.full(len(windows), windows.shape[1] - 1, np.int64)
        return count, count
    real = windows[:, 1, 1:] != 0
    return real.sum(axis=1).astype(np.int64), np.where(real, token_bytes[windows[:, 0, 1:]], 0).sum(axis=1).astype(np.int64)


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
    data, seq_len: int, batch_size: int, seed: int, rows: slice | None = None
) -> grain.MapDataset:
    """Shuffled, repeating batches: `ds[step]` is a uint8 array [batch_size, seq_len + 1] of byte windows, or an
    int32 array [batch_size, 2, seq_len + 1] of packed records.

    Indexing by step makes the data position one integer (the inner step count): a resumed island reads the
    batches an uninterrupted one would, with nothing else to save. Records are read on demand.

    Args:
      data: an island's data (`Corpus.train`): uint8 [n] bytes, a finite `grain.MapDataset` of records
        (shuffled by `seed` and repeated here), or an endless one (a mixture, shuffled already).
      seq_len: tokens per input sequence (each row has one more, the last target).
      batch_size: sequences per batch.
      seed: shuffle seed (`config.seed`).
      rows: only these rows of every batch (a process of a multi-process island reads the rows its own
        devices hold, `island.Shardings.local_rows`): `ds[step]` is then [rows, seq_len + 1] (records:
        [rows, 2, seq_len + 1]), and the
        processes' rows together are the whole batch, the same one a single process reads.

    Raises:
      DataError: fewer than seq_len + 1 bytes.
    """
    if isinstance(data, np.ndarray):
        data = grain.MapDataset.source(Windows(data, seq_len))
    windows = data if len(data) == sys.maxsize else data.shuffle(seed=seed).repeat()
    lo, hi, _ = (rows or slice(None)).indices(batch_size)
    if (lo, hi) == (0, batch_size):
        return windows.batch(batch_size, drop_remainder=True)
    return grain.MapDataset.range(0, len(windows) // batch_size, 1).map(
        lambda step: np.stack([windows[step * batch_size + r] for r in range(lo, hi)])
    )


def eval_windows(data, seq_len: int, num_windows: int, seed: int = 0) -> np.ndarray:
    """The held-out set: `num_windows` distinct windows of the held-out bytes, chosen by `seed` alone.

    The windows are `Windows(data, seq_len)`'s items at the first `num_windows` places of a permutation seeded by
    `seed` (`eval.seed`, not the run's seed, so that runs of every seed score one set), in that order: every
    config that evaluates the same corpus at the same `seq_len` and `eval.num_windows` scores the same windows,
    whatever its batch size or devices, and the set's first and second halves are two random halves.

    Args:
      data: uint8 [n], the held-out bytes (`Corpus.eval`), or a `grain.MapDataset` of packed records (each
        one a window).
      seq_len: tokens per input sequence; a window is seq_len + 1 tokens.
      num_windows: how many; when the held-out data hold fewer windows, all of them (in the seeded order).
      seed: `eval.seed`.

    Returns:
      uint8 [min(num_windows, len(Windows(data, seq_len))), seq_len + 1], or int32 [n, 2, seq_len + 1] records.

    Raises:
      DataError: fewer than seq_len + 1 bytes.
    """
    source = Windows(data, seq_len) if isinstance(data, np.ndarray) else data
    order = np.random.default_rng(seed).permutation(len(source))[:num_windows]
    return np.stack([source[i] for i in order])


def windows_sha256(windows: np.ndarray) -> str:
    """The first 16 hex digits of the SHA-256 of a held-out set (`eval_windows`'s array, its shape included)."""
    digest = hashlib.sha256(str(windows.shape).encode())
    digest.update(np.ascontiguousarray(windows, np.uint8 if windows.ndim == 2 else np.int32).tobytes())
    return digest.hexdigest()[:16]


def eval_batches(windows: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, int]]:
    """The held-out set in batches of `batch_size` windows, the last one padded with zero windows.

    Args:
      windows: uint8 [n, seq_len + 1] or int32 [n, 2, seq_len + 1] (`eval_windows`).
      batch_size: windows per batch (`eval.batch_size`, a multiple of the island's devices).

    Returns:
      [(windows' dtype [batch_size, ...], how many of its rows are windows)], ceil(n / batch_size) of them;
      padded rows come last and are left out of every loss (`Island.evaluate`).
    """
    batches = []
    for start in range(0, len(windows), batch_size):
        part = windows[start : start + batch_size]
        real = len(part)
        if real < batch_size:
            part = np.concatenate([part, np.zeros((batch_size - real, *windows.shape[1:]), windows.dtype)])
        batches.append((part, real))
    return batches


def mean_and_stderr(losses: np.ndarray) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-window losses (float [n], nats per byte): the standard error is
    the sample standard deviation (ddof 1) over sqrt(n); NaN for one window."""
    losses = np.asarray(losses, np.float64)
    stderr = float(np.std(losses, ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return float(np.mean(losses)), stderr


def loss_unit(config, bits_per_byte: float | None = None) -> str:
    """The unit of the run's losses in log lines: "nats/byte" on bytes; "nats/token" on prepared records, with
    `bits_per_byte` of the text beside it when given."""
    if not config.data.get("prepared", ""):
        return "nats/byte"
    return "nats/token" + ("" if bits_per_byte is None else f" ({bits_per_byte:.4f} bits per byte)")


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
