"""A prepared dataset on disk: its packed record format, and the folder opened for reading.

A record gives `seq_len` predictions: tokens [seq_len + 1] and segment_ids [seq_len + 1] uint16 (the 1-based
index of each token's document within the record, 0 on padding), stored as one ArrayRecord entry
(`encode_record`, `decode_record`); two consecutive records share one token (`pack`). A prepared folder
(`preparation.prepare`'s output) holds the shards of the `train` and `eval` splits, `manifest.json`, the
tokenizer's file and `token_bytes.npy` (the UTF-8 bytes of text of each token, for bits per byte).
`PreparedDataset` reads its records as grain datasets of int32 [2, seq_len + 1] items, on demand.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from island_jax.data.errors import DataError

FORMAT_VERSION = 2  # 2: a record holds seq_len + 1 tokens, sharing one with the next (1: seq_len, none shared)
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"  # int32 [vocab]: the text bytes of each token (`Tokenizer.token_bytes`)
SPLITS = ("train", "eval")


def pack(documents: Sequence[np.ndarray], seq_len: int, token_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Documents' token ids (each ending in its end-of-document token) one after another, cut into records that
    each give `seq_len` predictions: record i holds tokens [i x seq_len, i x seq_len + seq_len + 1), so two
    consecutive records share one token (the last target of one is the first input of the next), as the byte
    windows of `data.Windows` do.

    Returns:
      (tokens [records, seq_len + 1], segment_ids [records, seq_len + 1] uint16): a token's segment id is the
      1-based index, within its record, of the document it belongs to; the last record's padding is token 0,
      segment 0.
    """
    width = seq_len + 1
    if not documents:
        return np.zeros((0, width), token_dtype), np.zeros((0, width), np.uint16)
    tokens = np.concatenate(documents).astype(token_dtype)
    doc_index = np.repeat(np.arange(len(documents)), [len(d) for d in documents])
    records = max(1, -(-(len(tokens) - 1) // seq_len))
    pad = records * seq_len + 1 - len(tokens)
    tokens = np.concatenate([tokens, np.zeros(pad, token_dtype)])
    doc_index = np.concatenate([doc_index, np.full(pad, -1)])
    at = np.arange(records)[:, None] * seq_len + np.arange(width)
    tokens, doc_index = tokens[at], doc_index[at]
    segments = np.where(doc_index >= 0, doc_index - doc_index[:, :1] + 1, 0).astype(np.uint16)
    return tokens, segments


def encode_record(tokens: np.ndarray, segment_ids: np.ndarray) -> bytes:
    """One record's bytes: its tokens, then its segment ids (little-endian, the manifest's dtypes)."""
    return tokens.astype(tokens.dtype.newbyteorder("<")).tobytes() + segment_ids.astype("<u2").tobytes()


def decode_record(data: bytes, seq_len: int, token_dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [seq_len + 1] of `token_dtype`, segment_ids [seq_len + 1] uint16) of a record's bytes."""
    dtype = np.dtype(token_dtype).newbyteorder("<")
    tokens = np.frombuffer(data, dtype, seq_len + 1)
    return tokens, np.frombuffer(data, "<u2", seq_len + 1, (seq_len + 1) * dtype.itemsize)


def token_dtype_for(vocab_size: int) -> str:
    """The dtype of a record's tokens for a vocabulary of `vocab_size`: uint16 where it fits, else int32."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def tokenizer_flags(dataset: "PreparedDataset") -> str:
    """The experiments/prepare_data.py flags that prepare another dataset with `dataset`'s tokenizer."""
    settings = dataset.manifest["settings"]
    kind = settings["tokenizer"]
    if kind == "bytes":
        return "--tokenizer=bytes"
    if kind == "bpe":  # trained there, saved beside the shards
        return f"--tokenizer=tokenizer_json --tokenizer_path={os.path.join(dataset.path, TOKENIZER_FILE)}"
    flags = f"--tokenizer={kind} --tokenizer_path={settings['tokenizer_path']}"
    if kind == "tokenizer_json":
        flags += f" --eos_token={settings['eos_token']}"
    if kind == "tiktoken":
        flags += f" --tiktoken_name={settings['tiktoken_name']}"
    return flags


class PreparedDataset:
    """A prepared folder (`prepare`'s output), opened for reading: its records as grain datasets.

    An item is int32 [2, seq_len + 1]: row 0 the record's tokens, row 1 their segment ids (`pack`). Records are
    read from the ArrayRecord shards on demand (`grain.sources.ArrayRecordDataSource`), so memory does not grow
    with the dataset.

    Args:
      path: the folder.

    Attributes:
      path, manifest: the folder and its manifest.json.
      seq_len: predictions per record (a record holds seq_len + 1 tokens).
      vocab_size, eos_id, tokenizer_hash: the tokenizer's (`island_jax.data.tokenizer`).
      token_bytes: int32 [vocab_size], the UTF-8 bytes of text of each token.

    Raises:
      DataError: no manifest.json in `path` (not prepared, or not finished), or one of another format version.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        manifest = os.path.join(self.path, MANIFEST)
        if not os.path.isdir(self.path):
            raise DataError(f"the prepared dataset {path} does not exist; prepare it with experiments/prepare_data.py "
                            f"--out={path}, or give the folder it was prepared into")
        if not os.path.isfile(manifest):
            raise DataError(f"{path} holds no {MANIFEST}: it is not a prepared dataset, or its preparation did not "
                            "finish; run experiments/prepare_data.py --out=" + path)
        with open(manifest, encoding="utf-8") as f:
            self.manifest = json.load(f)
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise DataError(f"{path} was prepared in format {version}, and this version of island_jax reads format "
                            f"{FORMAT_VERSION}; prepare it again into a new folder (experiments/prepare_data.py)")
        self.seq_len = int(self.manifest["settings"]["seq_len"])
        tok = self.manifest["tokenizer"]
        self.vocab_size, self.eos_id, self.tokenizer_hash = int(tok["vocab_size"]), int(tok["eos_id"]), tok["hash"]
        try:
            self.token_bytes = np.load(os.path.join(self.path, self.manifest["token_bytes"])).astype(np.int32)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: its {self.manifest['token_bytes']} cannot be read ({e}); copy the whole folder, "
                            "or prepare it again") from e
        self._dtype = self.manifest["token_dtype"]

    def records(self, split: str = "train"):
        """`split`'s records in shard order, a `grain.MapDataset` of int32 [2, seq_len + 1] items.

        Raises:
          DataError: the split has no record, or a shard file is missing.
        """
        import grain

        shards = self.manifest["splits"][split]["shards"]
        paths = [os.path.join(self.path, s["file"]) for s in shards if s["records"]]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise DataError(f"{self.path} lacks its shard {missing[0]}; copy the whole folder, or prepare it again")
        if not paths:
            raise DataError(f"the {split} split of {self.path} has no record; prepare it with more documents"
                            + (" or a larger --eval_fraction" if split == "eval" else ""))
        seq_len, dtype = self.seq_len, self._dtype

        def decode(data: bytes) -> np.ndarray:
            return np.stack(decode_record(data, seq_len, dtype)).astype(np.int32)

        return grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).map(decode)

    def fingerprint(self) -> dict:
        """What islands reading this dataset agree on: the tokenizer's hash and a hash of every shard's SHA-256,
        with the records of each split."""
        shards = [s["sha256"] for split in SPLITS for s in self.manifest["splits"][split]["shards"]]
        return dict(tokenizer=self.tokenizer_hash, seq_len=self.seq_len,
                    shards_sha256=hashlib.sha256("\n".join(shards).encode()).hexdigest()[:16],
                    **{f"{split}_records": sum(s["records"] for s in self.manifest["splits"][split]["shards"])
                       for split in SPLITS})
