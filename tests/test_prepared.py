"""Prepared datasets (island_jax/data/preparation.py, records.py): JSONL and Parquet in, packed ArrayRecord shards and a manifest out."""

import json
import os

import numpy as np
import pytest

from island_jax.data import tokenizer as tok
from island_jax.data.errors import DataError
from island_jax.data.preparation import prepare, split_of
from island_jax.data.records import SPLITS, PreparedDataset, decode_record, encode_record, pack

SEQ_LEN = 64


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    words = ["def", "return", "island", "merge", "the", "a", "chunk", "round", "x", "=", "+", "\n", "naïve", "平"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 120)))) for _ in range(n)]


@pytest.fixture
def inputs(tmp_path):
    """A JSONL file (one field of its lines) and a Parquet file (one column), 60 documents each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "inputs"
    folder.mkdir()
    jsonl, parquet = _texts(60, 0), _texts(60, 1)
    with open(folder / "a.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(jsonl):
            f.write(json.dumps({"id": i, "body": t}) + "\n")
    pq.write_table(pa.table({"body": parquet, "n": list(range(60))}), folder / "b.parquet")
    return str(folder), jsonl + parquet


def _prepare(folder, out, **kw):
    kw = dict(tokenizer="bpe", vocab_size=300, field="body", seq_len=SEQ_LEN, eval_fraction=0.1, shard_bytes=2000,
              workers=1) | kw
    return prepare([folder], out, **kw)


def _documents_of(out, split, eos):
    """The token ids of every document of a split, from its records: each shard's records joined (consecutive
    records share one token) and cut at each end-of-document token."""
    from array_record.python.array_record_module import ArrayRecordReader

    dataset = PreparedDataset(out)
    docs, current = [], []
    for shard in dataset.manifest["splits"][split]["shards"]:
        reader = ArrayRecordReader(os.path.join(out, shard["file"]))
        records = [decode_record(r, SEQ_LEN, dataset.manifest["token_dtype"]) for r in reader.read_all()]
        reader.close()
        for i, (tokens, segments) in enumerate(records):
            for t, s in list(zip(tokens.tolist(), segments.tolist()))[1 if i else 0 :]:
                if s == 0:
                    continue
                current.append(t)
                if t == eos:
                    docs.append(current)
                    current = []
        assert current == []
    return docs


def test_every_document_is_in_one_split_once_with_the_token_counts_of_the_tokenizer_by_hand(inputs, tmp_path):
    folder, texts = inputs
    out = str(tmp_path / "prepared")
    manifest = _prepare(folder, out)
    t = tok.load("bpe", os.path.join(out, "tokenizer.json"))
    assert manifest["tokenizer"] == dict(kind="bpe", hash=t.hash, vocab_size=300, eos_id=0, file="tokenizer.json")
    sources = [f"a.jsonl:{i}" for i in range(60)] + [f"b.parquet:{i}" for i in range(60)]
    by_split = {s: [x for x, src in zip(texts, sources) if split_of(src, 0.1) == s] for s in SPLITS}
    assert len(by_split["eval"]) == 8 and len(by_split["train"]) == 112
    for split, split_texts in by_split.items():
        expected = [t.encode_document(x).tolist() for x in split_texts]
        assert manifest["splits"][split]["documents"] == len(split_texts)
        assert manifest["splits"][split]["tokens"] == sum(len(d) for d in expected)  # as the tokenizer by hand
        assert manifest["splits"][split]["bytes"] == sum(len(x.encode("utf-8")) for x in split_texts)
        assert _documents_of(out, split, t.eos_id) == expected  # every document once, in order
    assert len(manifest["splits"]["train"]["shards"]) > 3 and manifest["token_dtype"] == "uint16"
    assert manifest["eval_files"] == []  # records, not text files, were split


def test_packed_records_mark_each_documents_tokens_and_pad_the_last_record():
    docs = [np.array([5, 6, 7, 0]), np.array([8, 0]), np.array([9, 9, 9, 9, 9, 0])]
    tokens, segments = pack(docs, 5, "uint16")
    # records of 6 tokens (5 predictions each), the last token of one the first of the next
    assert tokens.tolist() == [[5, 6, 7, 0, 8, 0], [0, 9, 9, 9, 9, 9], [9, 0, 0, 0, 0, 0]]
    assert segments.tolist() == [[1, 1, 1, 1, 2, 2], [1, 2, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]]
    data = encode_record(tokens[1], segments[1])
    back = decode_record(data, 5, "uint16")
    assert [x.tolist() for x in back] == [tokens[1].tolist(), segments[1].tolist()] and len(data) == 24
    # 11 tokens fill two records exactly: the last token is the last record's last, with no padding
    tokens, segments = pack([np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0])], 5, "uint16")
    assert tokens.tolist() == [[1, 2, 3, 4, 5, 6], [6, 7, 8, 9, 10, 0]] and segments.min() == 1
    # a shard of one empty document: one record, its end-of-document token and padding
    tokens, segments = pack([np.array([0])], 5, "uint16")
    assert tokens.tolist() == [[0] * 6] and segments.tolist() == [[1, 0, 0, 0, 0, 0]]


def test_an_interrupted_preparation_resumes_to_the_same_shards_byte_for_byte(inputs, tmp_path):
    folder, _ = inputs
    whole = str(tmp_path / "whole")
    _prepare(folder, whole)
    out, seen = str(tmp_path / "resumed"), []

    def fail_after_one(entry):
        seen.append(entry["file"])
        raise KeyboardInterrupt("stopped after one shard")

    with pytest.raises(KeyboardInterrupt):
        _prepare(folder, out, progress=fail_after_one)
    assert seen == ["train-00000.array_record"] and not os.path.exists(os.path.join(out, "manifest.json"))
    kept = os.stat(os.path.join(out, seen[0])).st_mtime_ns
    again = []
    _prepare(folder, out, progress=lambda e: again.append(e["file"]))
    assert os.stat(os.path.join(out, seen[0])).st_mtime_ns == kept  # the finished shard was kept, not made again
    names = sorted(f for f in os.listdir(whole) if f.endswith(".array_record") or f == "tokenizer.json")
    assert names == sorted(f for f in os.listdir(out) if f.endswith(".array_record") or f == "tokenizer.json")
    for name in names:
        with open(os.path.join(whole, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    assert len(again) == len(names) - 1  # every shard reported once, the kept one included


def test_bad_input_is_refused_naming_the_file_and_the_fix(inputs, tmp_path):
    folder, _ = inputs
    with pytest.raises(DataError, match="a.jsonl, line 1: no field 'text' \\(it has \\['body', 'id'\\]\\); name the"):
        _prepare(os.path.join(folder, "a.jsonl"), str(tmp_path / "o1"), field="text")
    with pytest.raises(DataError, match="b.parquet: no column 'text' \\(it has \\['body', 'n'\\]\\)"):
        _prepare(os.path.join(folder, "b.parquet"), str(tmp_path / "o2"), field="text")
    with pytest.raises(DataError, match="'.*nowhere/\\*.txt' names no file; give a file, a folder or a glob"):
        _prepare(str(tmp_path / "nowhere" / "*.txt"), str(tmp_path / "o3"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="hold no document; give files with text in them"):
        _prepare(str(empty), str(tmp_path / "o4"))
    out = str(tmp_path / "o5")
    _prepare(folder, out)
    with pytest.raises(DataError, match="was prepared with other settings \\(seq_len differ\\); give a new output"):
        _prepare(folder, out, seq_len=32)
    with pytest.raises(tok.TokenizerError, match="file '' does not exist; give the path of its .model file"):
        _prepare(folder, str(tmp_path / "o6"), tokenizer="sentencepiece")
    path = str(tmp_path / "tokenizer.json")
    tok.train_bpe(iter(["one text", "two texts"]), 300).save(path)
    _prepare(folder, str(tmp_path / "o7"), tokenizer="tokenizer_json", tokenizer_path=path)
    tok.train_bpe(iter(["other texts", "make another"]), 300).save(path)  # the same file, another tokenizer
    with pytest.raises(DataError, match="was prepared with other settings \\(tokenizer_hash differ\\)"):
        _prepare(folder, str(tmp_path / "o7"), tokenizer="tokenizer_json", tokenizer_path=path)


def test_an_output_folder_inside_an_input_folder_is_not_read_as_input(inputs):
    folder, texts = inputs
    out = os.path.join(folder, "prepared")
    first = _prepare(folder, out)
    again = _prepare(folder, out)  # its shards, manifest and tokenizer are not documents
    assert first["splits"]["train"]["documents"] + first["splits"]["eval"]["documents"] == len(texts)
    assert again["splits"] == first["splits"]
