"""Tokenizers from local files (island_jax/data/tokenizer.py): every kind's round trip, a deterministic BPE, refusals."""

import base64
import hashlib

import numpy as np
import pytest

from island_jax.data import DataError, find_files
from island_jax.data import tokenizer as tok

TEXT = "def f(x):\n    return x ** 2  # naïve — 平方\n\tprint('ok')\r\n"


def _documents(limit=40):
    """Standard-library sources: the same ones, in the same order, on every call."""
    _, files = find_files("")
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[:limit]]


def test_bytes_are_the_byte_level_models_symbols_and_256_ends_a_document():
    t = tok.load("bytes")
    ids = t.encode(TEXT)
    assert ids.dtype == np.int32 and ids.tolist() == list(TEXT.encode("utf-8"))
    doc = t.encode_document(TEXT)
    assert doc.tolist() == ids.tolist() + [256] and (t.vocab_size, t.eos_id) == (257, 256)
    assert t.decode(doc) == TEXT
    assert t.token_bytes().tolist() == [1] * 256 + [0]


def test_a_bpe_trained_twice_on_the_same_files_is_the_same_and_gives_documents_back_exactly(tmp_path):
    docs = _documents()
    first, second = tok.train_bpe(iter(docs), 1024), tok.train_bpe(iter(docs), 1024)
    assert first.hash == second.hash and first.vocab_size == second.vocab_size == 1024
    assert first.eos_id == 0 and first.kind == "bpe"
    assert tok.train_bpe(iter(docs[:-1]), 1024).hash != first.hash  # other text, another tokenizer
    for text in (TEXT, docs[3], "", "\x00\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
                 "a document that mentions <|endoftext|> in its text"):
        ids = first.encode(text)
        assert first.decode(ids) == text
        assert first.decode(first.encode_document(text)) == text
    assert len(first.encode(docs[3])) < len(docs[3].encode("utf-8")) / 2  # the merges compress source code
    assert first.eos_id not in first.encode("x<|endoftext|>y").tolist()  # the text of a special token is text
    path = str(tmp_path / "tokenizer.json")
    first.save(path)
    again = tok.load("bpe", path)
    assert (again.hash, again.vocab_size, again.eos_id) == (first.hash, first.vocab_size, first.eos_id)
    assert tok.load("tokenizer_json", path).hash == first.hash  # one file, one tokenizer, whichever kind reads it
    sizes = first.token_bytes()  # bytes of text per token: a document's sum is its UTF-8 length
    assert sizes[first.eos_id] == 0
    for text in (TEXT, docs[3], "a document that mentions <|endoftext|> in its text"):
        assert sizes[first.encode_document(text)].sum() == len(text.encode("utf-8"))
    assert again.encode(docs[5]).tolist() == first.encode(docs[5]).tolist()


def test_a_tokenizer_json_file_names_its_end_of_document_token(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    tok.train_bpe(iter(_documents(10)), 400).save(path)
    t = tok.load("tokenizer_json", path)
    assert (t.kind, t.eos_id) == ("tokenizer_json", 0) and t.decode(t.encode(TEXT)) == TEXT
    with pytest.raises(tok.TokenizerError, match="no end-of-document token '</s>'; name the one it has"):
        tok.load("tokenizer_json", path, eos_token="</s>")


def test_a_sentencepiece_model_round_trips_its_text(tmp_path):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(line for d in _documents(20) for line in d.splitlines() if line.strip()))
    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=500, model_type="bpe", byte_fallback=True,
        num_threads=1, minloglevel=2,
    )
    t = tok.load("sentencepiece", prefix + ".model")
    assert (t.kind, t.vocab_size, t.eos_id) == ("sentencepiece", 500, 2)
    assert t.decode(t.encode_document("return x + 1")) == "return x + 1"
    assert t.hash == tok.load("sentencepiece", prefix + ".model").hash
    # each piece's own text: a word's piece counts its leading space, so the space the model adds before a
    # document's first word counts one byte more than the text has (token_bytes' documented bias)
    sizes = t.token_bytes()
    assert sizes[t.eos_id] == 0 and sizes[t.encode("平")].tolist() == [1] * 4  # "▁" (a piece), then 3 byte pieces
    assert sizes[t.encode_document("return x + 1")].sum() == len(" return x + 1")


def _tiktoken_file(path, merges=(b"re", b"ret", b"retu", b"return", b"  ", b"    ")):
    """A .tiktoken file: every byte, then `merges` (each made of two earlier tokens), a base64 token and its rank
    per line."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))
    return str(path)


def test_tiktoken_ranks_of_ones_own_round_trip_and_a_named_encoding_checks_its_file(tmp_path):
    path = _tiktoken_file(tmp_path / "own.tiktoken")
    t = tok.load("tiktoken", path, tiktoken_name="")
    assert (t.vocab_size, t.eos_id) == (263, 262)
    assert t.encode("return").tolist() == [259]  # a piece that is a token is that token
    assert t.encode("re").tolist() == [256] and t.encode("ret").tolist() == [257]  # the merges apply
    assert t.decode(t.encode_document(TEXT)) == TEXT
    assert t.token_bytes()[t.encode_document(TEXT)].sum() == len(TEXT.encode("utf-8"))
    assert t.token_bytes()[[259, 262]].tolist() == [6, 0]  # "return", the end of document
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with pytest.raises(tok.TokenizerError, match=f"is not the ranks of tiktoken's cl100k_base \\(SHA-256 {digest}"):
        tok.load("tiktoken", path, tiktoken_name="cl100k_base")
    for name in ("cl99k", "gpt2"):
        with pytest.raises(tok.TokenizerError, match=f"encodings from a .tiktoken file are .*; got '{name}'"):
            tok.load("tiktoken", path, tiktoken_name=name)
    (tmp_path / "own.tiktoken").write_bytes(b"cmU= 0\nnot-base64 1\n")  # read again, not from a cached copy
    with pytest.raises(tok.TokenizerError, match="own.tiktoken, line 2: not a base64 token and its rank"):
        tok.load("tiktoken", path, tiktoken_name="")


def test_bad_tokenizer_input_is_refused_naming_the_file_and_the_fix(tmp_path):
    with pytest.raises(tok.TokenizerError, match="unknown tokenizer kind 'wordpiece'; choose one of"):
        tok.load("wordpiece")
    missing = str(tmp_path / "none.json")
    with pytest.raises(tok.TokenizerError, match=f"file '{missing}' does not exist; give the path of its tokenizer.json"):
        tok.load("tokenizer_json", missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(tok.TokenizerError, match="garbage.model is not a SentencePiece model"):
        tok.load("sentencepiece", str(garbage))
    garbage_json = tmp_path / "garbage.json"
    garbage_json.write_text("{")
    with pytest.raises(tok.TokenizerError, match="garbage.json is not a Hugging Face tokenizer.json"):
        tok.load("bpe", str(garbage_json))
    with pytest.raises(tok.TokenizerError, match="at least 257 tokens .* got 200"):
        tok.train_bpe(iter(["abc"]), 200)
    with pytest.raises(tok.TokenizerError, match="no text to train the BPE on"):
        tok.train_bpe(iter([]), 300)
    assert issubclass(tok.TokenizerError, DataError)


def test_the_text_bytes_of_a_metaspace_tokenizer_json_count_its_byte_pieces_and_the_added_space():
    """A tokenizer.json in the style of SentencePiece's (Metaspace word boundaries, byte fallback): each piece
    counts its text with the boundary as a space, a byte piece one byte, the end of document none; the space
    the pre-tokenizer adds before a document's first word counts one byte more than the text has."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = HFTokenizer(models.BPE(byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_pieces = [f"<0x{b:02X}>" for b in range(256)]
    raw.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[tok.EOS_TEXT, *bytes_pieces], show_progress=False))
    t = tok.HuggingFaceTokenizer(raw, "tokenizer_json")
    sizes = t.token_bytes()
    assert [raw.id_to_token(int(i)) for i in t.encode("the é")] == ["\u2581the", "\u2581", "<0xC3>", "<0xA9>"]
    for text in ("the the", "é", "the cat é"):
        assert sizes[t.encode_document(text)].sum() == len(text.encode("utf-8")) + 1
