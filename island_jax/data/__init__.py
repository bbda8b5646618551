"""Text data: the byte corpus or prepared token records, a deterministic split, grain pipelines, held-out sets.

  errors       `DataError` (imports neither grain nor NumPy)
  tokenizer    text to token ids and back, five kinds, from local files only
  records      the packed record format, and a prepared folder opened for reading (`PreparedDataset`)
  preparation  `prepare`: local documents tokenized into ArrayRecord shards with a manifest
  corpus       `load`: the run's data for an island, bytes or prepared records (`Corpus`)
  pipeline     `train_dataset`: shuffled, repeating batches indexed by the inner step
  heldout      `eval_windows` and its batches, scores and units (bits per byte)

`parse_mixture` and `sharing` read the config alone and live in `island_jax.config`; they are named here too.
"""

from island_jax.config.mixture import parse_mixture, sharing
from island_jax.data.corpus import Corpus, find_files, load, load_corpus, stdlib_root
from island_jax.data.errors import DataError
from island_jax.data.heldout import (
    bits_per_byte,
    eval_batches,
    eval_windows,
    loss_unit,
    mean_and_stderr,
    scored,
    windows_sha256,
)
from island_jax.data.pipeline import Windows, train_dataset

__all__ = [
    "Corpus", "DataError", "Windows", "bits_per_byte", "eval_batches", "eval_windows", "find_files", "load",
    "load_corpus", "loss_unit", "mean_and_stderr", "parse_mixture", "scored", "sharing", "stdlib_root",
    "train_dataset", "windows_sha256",
]
