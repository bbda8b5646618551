"""The training pipeline: an island's data as shuffled, repeating grain batches, indexed by the inner step.

Bytes are cut into non-overlapping windows of seq_len + 1 bytes (inputs and next-byte targets, `Windows`);
prepared records are windows already. `train_dataset(...)[step]` is one batch, so the data position is one
integer, the inner step count, which an island's checkpoint holds.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

from island_jax.data.errors import DataError


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
        devices hold, `island.placement.Shardings.local_rows`): `ds[step]` is then [rows, seq_len + 1] (records:
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
