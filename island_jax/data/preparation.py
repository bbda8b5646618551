"""Preparing a dataset: local documents tokenized and packed into ArrayRecord shards, with a manifest.

`prepare(inputs, out, ...)` (the library behind experiments/prepare_data.py; docs/data.md):
1. reads documents from local files only: text files (a document each), JSONL (one field of each line) or
   Parquet (one column, with pyarrow), in the sorted order of the paths;
2. splits them into `train` and `eval` by a hash of where each came from, never by chance (`split_of`);
3. makes the tokenizer (`island_jax.data.tokenizer`): a byte-level BPE trained on the training documents in
   order, or one read from its file;
4. cuts each split into shards of about `shard_bytes` of text and tokenizes them in parallel processes, each
   shard packed into records (`records.pack`);
5. writes each shard under a temporary name and renames it when complete, with a `.done.json` beside it, so
   that an interrupted preparation resumes to the same bytes; the manifest is written last.
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

from island_jax.data import tokenizer as tokenizer_lib
from island_jax.data.errors import DataError
from island_jax.data.records import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TOKEN_BYTES_FILE,
    TOKENIZER_FILE,
    encode_record,
    pack,
    token_dtype_for,
)
from island_jax.metrics import write_json

FORMATS = ("auto", "text", "jsonl", "parquet")
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
    dtype = token_dtype_for(tok.vocab_size)
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
      tokenizer, vocab_size, tokenizer_path, eos_token, tiktoken_name: the tokenizer (`island_jax.data.tokenizer`;
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
        token_dtype=token_dtype_for(tok.vocab_size), token_bytes=TOKEN_BYTES_FILE,
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
