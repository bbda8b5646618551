"""Prepared datasets: local documents tokenized, packed into fixed-length records, in ArrayRecord shards.

`prepare(inputs, out, ...)` (the library behind experiments/prepare_data.py):

1. Reads documents from local files only: text files (a document each), JSONL (one field of each line) or
   Parquet (one column, with pyarrow), in the sorted order of the paths.
2. Splits them into `train` and `eval` by a hash of where each came from, never by chance: a text file by
   its path, a JSONL or Parquet document by its path and index (`split_of`). The manifest lists the text
   files that went to evaluation and states the rule.
3. Makes the tokenizer (`island_jax.tokenizer`): a byte-level BPE is trained on the training documents in
   order and saved beside the shards as tokenizer.json; the other kinds are read from their files.
4. Cuts each split into shards of about `shard_bytes` of text (a shard depends only on its documents), and
   tokenizes the shards in parallel processes. In a shard, every document's tokens and then the
   end-of-document token follow each other, cut into records of `seq_len` predictions (`pack`): a record
   holds seq_len + 1 tokens, the last of one the first of the next, and the last record is padded. A record
   is `tokens` and `segment_ids` (the 1-based index of each token's document in the record, 0 on padding),
   each [seq_len + 1], stored as one ArrayRecord entry (`decode_record`). Each token's bytes of text go to
   token_bytes.npy, for bits per byte.
5. A shard is written under a temporary name and renamed when complete, with a `.done.json` beside it
   (documents, tokens, records, the file's SHA-256). Running again keeps the finished shards (checked by
   their hash) and makes the rest, so an interrupted preparation resumes to the same bytes. The manifest is
   written last.

Training reads a prepared folder through `PreparedDataset` (grain over the ArrayRecord shards; island_jax/data.py
splits it between islands).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from absl import logging

from island_jax import tokenizer as tokenizer_lib
from island_jax.data import DataError
from island_jax.metrics import write_json

FORMAT_VERSION = 2  # 2: a record holds seq_len + 1 tokens, sharing one with the next (1: seq_len, none shared)
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"  # int32 [vocab]: the text bytes of each token (`Tokenizer.token_bytes`)
FORMATS = ("auto", "text", "jsonl", "parquet")
SPLITS = ("train", "eval")
SPLIT_RULE = ("a text file goes to eval when the first 8 bytes of SHA-256(its path relative to its input's root), "
              "as a fraction of 2**64, are below eval_fraction; a JSONL or Parquet document likewise by "
              "SHA-256(path + ':' + its 0-based index in the file)")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: where it came from (`source`: a path relative to its input's root, with `:index` for a
    record of a JSONL or Parquet file) and its text."""

    source: str
    text: str


def _unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def split_of(source: str, eval_fraction: float) -> str:
    """"eval" or "train" for a document from `source` (`SPLIT_RULE`)."""
    return "eval" if _unit(source) < eval_fraction else "train"


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower()
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def input_files(patterns: Sequence[str]) -> list[tuple[str, str]]:
    """(root, path) of every file the patterns name (a file, a folder's files, or a glob), sorted by path.

    Raises:
      DataError: a pattern names nothing.
    """
    found = []
    for pattern in patterns:
        if os.path.isfile(pattern):
            found.append((os.path.dirname(os.path.abspath(pattern)), os.path.abspath(pattern)))
            continue
        if os.path.isdir(pattern):
            root, paths = os.path.abspath(pattern), glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
        else:
            root, paths = os.path.abspath(_glob_root(pattern)), glob.glob(pattern, recursive=True)
        paths = [os.path.abspath(p) for p in paths if os.path.isfile(p)]
        if not paths:
            raise DataError(f"{pattern!r} names no file; give a file, a folder or a glob of local files")
        found += [(root, p) for p in paths]
    return sorted(set(found), key=lambda rp: rp[1])


def _glob_root(pattern: str) -> str:
    parts = Path(pattern).parts
    fixed = [p for p in parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))]]
    return str(Path(*fixed)) if fixed else "."


def read_documents(files: Sequence[tuple[str, str]], fmt: str = "auto", field: str = "text") -> Iterator[Document]:
    """The documents of `files` ((root, path) each, `input_files`), in order.

    Text is read as UTF-8, undecodable bytes replaced (U+FFFD).

    Raises:
      DataError: a JSONL line that is not a JSON object or lacks `field`, a Parquet file without the column,
        or an unknown format.
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown input format {fmt!r}; choose one of {FORMATS}")
    for root, path in files:
        rel = os.path.relpath(path, root)
        kind = _format_of(path, fmt)
        if kind == "text":
            yield Document(rel, Path(path).read_bytes().decode("utf-8", errors="replace"))
        elif kind == "jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}, line {n + 1}: not JSON ({e}); give JSONL, one object per line") from e
                    if not isinstance(record, dict) or field not in record:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise DataError(f"{path}, line {n + 1}: no field {field!r} (it has {keys}); name the text's "
                                        "field with --field")
                    yield Document(f"{rel}:{n}", "" if record[field] is None else str(record[field]))
        else:
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
            if field not in names:
                raise DataError(f"{path}: no column {field!r} (it has {names}); name the text's column with --field")
            for n, text in enumerate(pq.read_table(path, columns=[field]).column(field).to_pylist()):
                yield Document(f"{rel}:{n}", "" if text is None else str(text))


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


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One shard to make: its file name, its split, and its documents' texts in order."""

    name: str
    split: str
    texts: tuple[str, ...]


def plan_shards(documents: Sequence[Document], eval_fraction: float, shard_bytes: int) -> list[ShardPlan]:
    """The shards of both splits: consecutive documents of a split, a new shard once one holds `shard_bytes`
    of UTF-8 text."""
    shards: list[ShardPlan] = []
    for split in SPLITS:
        texts: list[str] = []
        size = 0
        for doc in documents:
            if split_of(doc.source, eval_fraction) != split:
                continue
            texts.append(doc.text)
            size += len(doc.text.encode("utf-8"))
            if size >= shard_bytes:
                shards.append(ShardPlan(f"{split}-{sum(s.split == split for s in shards):05d}.array_record", split,
                                        tuple(texts)))
                texts, size = [], 0
        if texts:
            shards.append(ShardPlan(f"{split}-{sum(s.split == split for s in shards):05d}.array_record", split,
                                    tuple(texts)))
    return shards


_WORKER: dict = {}


def _start_worker(kind: str, path: str, eos_token: str, tiktoken_name: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel over processes instead
    _WORKER["tokenizer"] = tokenizer_lib.load(kind, path, eos_token=eos_token, tiktoken_name=tiktoken_name)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_shard(plan: ShardPlan, out: str, seq_len: int) -> dict:
    """Tokenizes, packs and writes one shard; returns its `.done.json` entry."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tok = _WORKER["tokenizer"]
    dtype = _token_dtype(tok.vocab_size)
    identity = _identity(plan, tok.hash)
    docs = [tok.encode_document(t) for t in plan.texts]
    tokens, segments = pack(docs, seq_len, dtype)
    path, tmp = os.path.join(out, plan.name), os.path.join(out, plan.name + ".tmp")
    writer = ArrayRecordWriter(tmp, "group_size:1")
    for t, s in zip(tokens, segments):
        writer.write(encode_record(t, s))
    writer.close()
    os.replace(tmp, path)
    entry = dict(file=plan.name, split=plan.split, identity=identity, documents=len(docs), tokens=int(sum(len(d) for d in docs)),
                 records=len(tokens), bytes=sum(len(t.encode("utf-8")) for t in plan.texts), sha256=_file_sha256(path))
    write_json(os.path.join(out, plan.name + ".done.json"), entry)
    return entry


def _identity(plan: ShardPlan, tokenizer_hash: str) -> str:
    """16 hex digits of a SHA-256 over a shard's name, its documents' texts and the tokenizer's hash."""
    h = hashlib.sha256(f"{plan.name}|{tokenizer_hash}|{len(plan.texts)}".encode())
    for text in plan.texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _finished(out: str, plan: ShardPlan, tokenizer_hash: str) -> dict | None:
    """The `.done.json` entry of a shard an earlier run wrote from the same documents with the same tokenizer,
    whose file is intact; else None (it is made again)."""
    done = os.path.join(out, plan.name + ".done.json")
    path = os.path.join(out, plan.name)
    if not (os.path.exists(done) and os.path.exists(path)):
        return None
    with open(done, encoding="utf-8") as f:
        entry = json.load(f)
    if entry.get("identity") != _identity(plan, tokenizer_hash):
        return None
    return entry if entry.get("sha256") == _file_sha256(path) else None


def prepare(
    inputs: Sequence[str],
    out: str,
    *,
    tokenizer: str = "bpe",
    vocab_size: int = 8192,
    tokenizer_path: str = "",
    eos_token: str = tokenizer_lib.EOS_TEXT,
    tiktoken_name: str = "cl100k_base",
    fmt: str = "auto",
    field: str = "text",
    seq_len: int = 1024,
    eval_fraction: float = 0.02,
    shard_bytes: int = 64 << 20,
    workers: int = 0,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Prepares `inputs` (files, folders or globs of local text, JSONL or Parquet) into the folder `out`.

    Args:
      tokenizer, vocab_size, tokenizer_path, eos_token, tiktoken_name: the tokenizer (`island_jax.tokenizer`;
        `vocab_size` for "bpe", trained here; `tokenizer_path` for the kinds read from a file).
      fmt, field: the inputs' format ("auto": by suffix) and the JSONL field or Parquet column of the text.
      seq_len: predictions per record (a record holds seq_len + 1 tokens): the model.seq_len that trains on it.
      eval_fraction: the share of documents held out (`SPLIT_RULE`), in [0, 1).
      shard_bytes: UTF-8 bytes of text per shard (about).
      workers: processes that tokenize (0: one per CPU; 1: this process).
      progress: called after each shard with its entry (what a progress bar shows).

    Returns:
      The manifest (also `out/manifest.json`).

    Raises:
      DataError: missing inputs, a bad field, no documents or no training documents, a bad tokenizer file
        (`tokenizer.TokenizerError`), or a folder prepared with other settings.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction is {eval_fraction}; use a value in [0, 1)")
    if seq_len < 2:
        raise DataError(f"seq_len is {seq_len}; records need at least 2 tokens")
    start = time.perf_counter()
    inside = os.path.abspath(out) + os.sep  # the output folder is never its own input
    files = [(r, p) for r, p in input_files(inputs) if not p.startswith(inside)]
    documents = list(read_documents(files, fmt, field))
    if not documents:
        raise DataError(f"the inputs {list(inputs)} hold no document; give files with text in them")
    os.makedirs(out, exist_ok=True)
    settings = dict(format_version=FORMAT_VERSION, seq_len=seq_len, eval_fraction=eval_fraction, shard_bytes=shard_bytes, format=fmt, field=field,
                    tokenizer=tokenizer, vocab_size=vocab_size if tokenizer == "bpe" else None, eos_token=eos_token,
                    tokenizer_path=os.path.abspath(tokenizer_path) if tokenizer_path else "",
                    tiktoken_name=tiktoken_name if tokenizer == "tiktoken" else None,
                    inputs=[os.path.relpath(p, r) for r, p in files])
    _check_settings(out, settings)
    shards = plan_shards(documents, eval_fraction, shard_bytes)
    if not any(s.split == "train" for s in shards):
        raise DataError(f"every one of the {len(documents)} documents went to eval (eval_fraction={eval_fraction}); "
                        "give more documents or a smaller eval_fraction")
    tok_path = tokenizer_path
    if tokenizer == "bpe":
        tok_path = os.path.join(out, TOKENIZER_FILE)
        if not os.path.exists(tok_path):  # trained once; a resumed run keeps it
            logging.info("training a byte-level BPE of %d tokens on %.1f MB of training text", vocab_size,
                         sum(len(t.encode("utf-8")) for s in shards if s.split == "train" for t in s.texts) / 1e6)
            trained = tokenizer_lib.train_bpe((t for s in shards if s.split == "train" for t in s.texts), vocab_size)
            trained.save(tok_path + ".tmp")
            os.replace(tok_path + ".tmp", tok_path)
    tok = tokenizer_lib.load(tokenizer, tok_path, eos_token=eos_token, tiktoken_name=tiktoken_name)
    _check_settings(out, dict(settings, tokenizer_hash=tok.hash))  # a tokenizer file changed since: refused
    np.save(os.path.join(out, TOKEN_BYTES_FILE), tok.token_bytes())
    entries: dict[str, dict] = {}
    todo = []
    for plan in shards:
        entry = _finished(out, plan, tok.hash)
        if entry is None:
            todo.append(plan)
        else:
            entries[plan.name] = entry
            if progress:
                progress(entry)
    args = (tokenizer, tok_path, eos_token, tiktoken_name)
    workers = workers or os.cpu_count() or 1
    logging.info("tokenizing %d of %d shards in %d process(es); %d kept from an earlier run", len(todo), len(shards),
                 1 if workers == 1 or len(todo) <= 1 else min(workers, len(todo)), len(entries))
    if workers == 1 or len(todo) <= 1:
        _start_worker(*args)
        for plan in todo:
            entries[plan.name] = _write_shard(plan, out, seq_len)
            if progress:
                progress(entries[plan.name])
    else:
        ctx = multiprocessing.get_context("spawn")  # the tokenizers' thread pools do not survive a fork
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx, initializer=_start_worker,
                                                    initargs=args) as pool:
            for plan, entry in zip(todo, pool.map(_write_shard, todo, [out] * len(todo), [seq_len] * len(todo))):
                entries[plan.name] = entry
                if progress:
                    progress(entry)
    manifest = dict(
        format_version=FORMAT_VERSION, settings=settings, split_rule=SPLIT_RULE,
        tokenizer=dict(kind=tok.kind, hash=tok.hash, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                       file=os.path.basename(tok_path) if tok_path else ""),
        token_dtype=_token_dtype(tok.vocab_size), token_bytes=TOKEN_BYTES_FILE,
        eval_files=sorted({os.path.relpath(p, r) for r, p in files if _format_of(p, fmt) == "text"
                           and split_of(os.path.relpath(p, r), eval_fraction) == "eval"}),
        splits={split: dict(
            shards=[entries[s.name] for s in shards if s.split == split],
            documents=sum(entries[s.name]["documents"] for s in shards if s.split == split),
            tokens=sum(entries[s.name]["tokens"] for s in shards if s.split == split),
            bytes=sum(entries[s.name]["bytes"] for s in shards if s.split == split),
        ) for split in SPLITS},
        seconds=time.perf_counter() - start,
    )
    write_json(os.path.join(out, MANIFEST), manifest)
    return manifest


def _check_settings(out: str, settings: dict) -> None:
    """Records the settings of a preparation in `out`, or refuses to continue one made with others."""
    path = os.path.join(out, "settings.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
        if "tokenizer_hash" in settings and "tokenizer_hash" not in earlier:  # recorded once the tokenizer exists
            write_json(path, settings)
            earlier = settings
        keys = (set(earlier) | set(settings)) - ({"tokenizer_hash"} - set(settings))
        changed = sorted(k for k in keys if earlier.get(k) != settings.get(k))
        if "format_version" in changed:
            raise DataError(f"{out} was prepared by another version of island_jax (format "
                            f"{earlier.get('format_version', 1)}, this one writes {settings['format_version']}); "
                            "give a new output folder")
        if changed:
            raise DataError(f"{out} was prepared with other settings ({', '.join(changed)} differ); give a new output "
                            "folder, or the settings it was made with")
        return
    write_json(path, settings)


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
      vocab_size, eos_id, tokenizer_hash: the tokenizer's (`island_jax.tokenizer`).
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
