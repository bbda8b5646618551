"""The run's data: the byte corpus split between islands, or the prepared records each island reads.

Two kinds of data, one door (`load`): **bytes** (the default, `data.prepared = ""`), the text files of
`data.files`, by default the `.py` files of the running interpreter's standard library (found through
`sysconfig`, so no path is fixed); or **prepared records** (`data.prepared = PATH`, `records.PreparedDataset`).
The byte corpus is split by file: a file is held out when the CRC32 of its path relative to the corpus root
falls in the lowest `eval_fraction` of the range, so the held-out set does not move when files are added
elsewhere; the other files, in sorted order, are dealt round-robin to the islands as disjoint shards. With
prepared records an island reads the shared dataset or data of its own (`islands.NAME.data`, a dataset or
a weighted mixture), its share of each dataset's training records as `config.sharing` plans it; the shared
dataset's eval split is the held-out set, and an island with data of its own also scores that data's.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grain
import numpy as np

from island_jax.config import ConfigError, dataset_key, parse_mixture, sharing
from island_jax.data.errors import DataError
from island_jax.data.records import PreparedDataset, tokenizer_flags


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


def _concatenated(datasets: Sequence[grain.MapDataset]) -> grain.MapDataset:
    """The items of `datasets` one after another (each finite)."""
    if len(datasets) == 1:
        return datasets[0]
    ends = np.cumsum([len(d) for d in datasets])

    def item(i: int):
        k = int(np.searchsorted(ends, i, side="right"))
        return datasets[k][i - (int(ends[k - 1]) if k else 0)]

    return grain.MapDataset.range(int(ends[-1])).map(item)



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
    if not config.data.get("prepared", ""):
        return load_corpus(config.data.files, config.data.eval_fraction, island_names)

    def opened(path: str, field: str):
        try:
            return PreparedDataset(path)
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
            dataset = shared if dataset_key(path) == dataset_key(config.data.prepared) else opened(path, field)
            if dataset.tokenizer_hash != shared.tokenizer_hash:
                raise DataError(f"{field} names {path}, prepared with tokenizer {dataset.tokenizer_hash}, but "
                                f"data.prepared ({shared.path}) has tokenizer {shared.tokenizer_hash}; prepare it with "
                                f"the shared dataset's tokenizer ({tokenizer_flags(shared)})")
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
