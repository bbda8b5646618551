"""Tokenizers: text to token ids and back, from local files only; nothing is downloaded.

Five kinds, one interface (`Tokenizer`): `bytes` (each UTF-8 byte a token, 0..255, and 256 ends a document),
`bpe` (a byte-level BPE trained here with Hugging Face `tokenizers` on the run's training files, `train_bpe`,
deterministically, saved as a tokenizer.json), `tokenizer_json` (any Hugging Face tokenizer.json),
`sentencepiece` (a SentencePiece model file) and `tiktoken` (an encoding of tiktoken's whose ranks are read
from a local `.tiktoken` file and checked against the hash tiktoken expects, or ranks of one's own).

Every tokenizer has an end-of-document token (`eos_id`) that packing puts after each document, and a `hash`
(16 hex digits of a SHA-256 over the bytes that define it) that a prepared dataset records, so that a model
is never fed ids of another tokenizer. Token ids are int32. `decode(encode(text)) == text` for every string
with the bytes, BPE and tiktoken kinds; SentencePiece and other tokenizer.json files normalize text as their
authors chose.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from island_jax.data.errors import DataError

KINDS = ("bytes", "bpe", "tokenizer_json", "sentencepiece", "tiktoken")
EOS_TEXT = "<|endoftext|>"  # the end-of-document token of the BPE trained here and of tiktoken's encodings
BYTE_EOS = 256  # the bytes tokenizer's end of document
MIN_BPE_VOCAB = 256 + 1  # a byte-level BPE holds every byte and the end-of-document token


class TokenizerError(DataError):
    """A tokenizer cannot be made or read: a missing or unreadable file, a wrong kind, no end-of-document token."""


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


class Tokenizer:
    """Text <-> token ids.

    Attributes:
      kind: one of `KINDS`.
      vocab_size: ids are in [0, vocab_size), the end-of-document token included.
      eos_id: the end-of-document token's id.
      hash: 16 hex digits of a SHA-256 over the bytes that define the tokenizer (and its family: bytes,
        tokenizer.json, SentencePiece, tiktoken): a BPE trained here and its tokenizer.json read back are one.
    """

    kind: str
    vocab_size: int
    eos_id: int
    hash: str

    def encode(self, text: str) -> np.ndarray:
        """int32 [tokens]: `text`'s ids, without the end-of-document token."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids` (an end-of-document id decodes to nothing)."""
        raise NotImplementedError

    def encode_document(self, text: str) -> np.ndarray:
        """int32 [tokens + 1]: `text`'s ids followed by the end-of-document token."""
        return np.append(self.encode(text), np.int32(self.eos_id)).astype(np.int32)

    def token_bytes(self) -> np.ndarray:
        """int32 [vocab_size]: the UTF-8 bytes of text each token stands for (0 for the end of document and other
        special tokens), so that the bytes of a text are the sum over its tokens: bits per byte
        (`data.bits_per_byte`) of a tokenized evaluation set. Exact for the bytes, BPE and tiktoken kinds. For
        SentencePiece and other tokenizer.json files it is each piece's own text, its word-boundary mark a
        space and a byte-fallback piece one byte: a normalizer's changes are not undone, and the space such a
        tokenizer adds before a document's first word counts one byte more per document than the text has."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, hash={self.hash!r})"


class ByteTokenizer(Tokenizer):
    """Each UTF-8 byte of the text is a token; 256 ends a document (vocabulary 257)."""

    kind, vocab_size, eos_id = "bytes", BYTE_EOS + 1, BYTE_EOS
    hash = _digest(b"bytes")

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, np.int64)
        return bytes(ids[ids != BYTE_EOS].astype(np.uint8)).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.append(np.ones(BYTE_EOS, np.int32), np.int32(0))


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (a tokenizer.json file, or a BPE trained by `train_bpe`).

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      kind: "bpe" or "tokenizer_json".
      eos_token: the end-of-document token's text.

    Raises:
      TokenizerError: the vocabulary has no `eos_token`.
    """

    def __init__(self, tokenizer, kind: str, eos_token: str = EOS_TEXT):
        self._tokenizer = tokenizer
        # a special token's text inside a document is text: only `encode_document` ends a document
        self._tokenizer.encode_special_tokens = True
        self.kind = kind
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise TokenizerError(f"the tokenizer has no end-of-document token {eos_token!r}; name the one it has "
                                 "(for example '</s>' or '<eos>') as its eos_token")
        self.eos_id = eos
        self.hash = _digest(b"tokenizer.json", tokenizer.to_str().encode())  # one file, one hash, whichever kind read it

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids if int(i) != self.eos_id], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        from tokenizers import decoders, pre_tokenizers

        special = {t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special}
        # GPT-2's byte-level alphabet: one character per byte
        byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        sizes = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            token = self._tokenizer.id_to_token(i)
            if token is None or i == self.eos_id:
                continue
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):  # a byte-fallback piece
                sizes[i] = 1
            elif token in special:
                continue
            elif byte_level and all(c in alphabet for c in token):
                sizes[i] = len(token)
            else:  # a piece's own text, its word boundary "\u2581" a space (Metaspace, as SentencePiece's)
                sizes[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return sizes

    def save(self, path: str) -> None:
        """Writes the tokenizer as a tokenizer.json file at `path`."""
        self._tokenizer.save(path)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file.

    Raises:
      TokenizerError: the model has no end-of-sentence piece.
    """

    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece

        with open(path, "rb") as f:
            proto = f.read()
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"{path} is not a SentencePiece model ({e}); give the .model file it trained") from e
        self.vocab_size, self.eos_id = self._sp.get_piece_size(), self._sp.eos_id()
        if self.eos_id < 0:
            raise TokenizerError(f"the SentencePiece model {path} has no end-of-sentence piece (train it with eos_id "
                                 "set)")
        self.hash = _digest(b"sentencepiece", proto)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self.eos_id])

    def token_bytes(self) -> np.ndarray:
        sizes = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_byte(i):
                sizes[i] = 1
            elif not (self._sp.is_control(i) or self._sp.is_unknown(i)):
                sizes[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return sizes


_TIKTOKEN_LOCK = threading.Lock()  # tiktoken's constructors are pointed at the local ranks one at a time


class TiktokenTokenizer(Tokenizer):
    """tiktoken's encoding `name` with its ranks from the local file `path` (never downloaded).

    The encoding is made by tiktoken's own constructor of `name` (tiktoken_ext.openai_public), which would
    download its ranks; it is given the file's ranks instead, after checking them against the SHA-256 that
    tiktoken expects of them. With `name` "", the file holds ranks of one's own, pre-tokenized with GPT-2's
    pattern (`r50k_pat_str`), and `EOS_TEXT` follows the last rank.

    Raises:
      TokenizerError: an unknown encoding name, or a file that is not that encoding's ranks.
    """

    kind = "tiktoken"

    def __init__(self, path: str, name: str = "cl100k_base"):
        import tiktoken
        from tiktoken_ext import openai_public

        with open(path, "rb") as f:
            contents = f.read()
        ranks = _ranks(contents, path)
        if not name:  # ranks of one's own: GPT-2's pre-tokenization pattern, and the end of document after them
            self._encoding = tiktoken.Encoding(
                name=os.path.basename(path), pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
                special_tokens={EOS_TEXT: max(ranks.values(), default=-1) + 1},
            )
            self._finish(name, contents)
            return
        if name not in _TIKTOKEN_NAMES:
            raise TokenizerError(f"tiktoken's encodings from a .tiktoken file are {sorted(_TIKTOKEN_NAMES)}; got "
                                 f"{name!r} (gpt2's ranks are r50k_base's)")

        def local_ranks(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
            found = hashlib.sha256(contents).hexdigest()
            if expected_hash is not None and found != expected_hash:
                raise TokenizerError(f"{path} is not the ranks of tiktoken's {name} (SHA-256 {found}, expected "
                                     f"{expected_hash}, from {url}); give the file of that encoding")
            return ranks

        with _TIKTOKEN_LOCK:
            load_ranks = openai_public.load_tiktoken_bpe
            openai_public.load_tiktoken_bpe = local_ranks
            try:
                params = openai_public.ENCODING_CONSTRUCTORS[name]()
            finally:
                openai_public.load_tiktoken_bpe = load_ranks
        self._encoding = tiktoken.Encoding(**params)
        self._finish(name, contents)

    def _finish(self, name: str, contents: bytes) -> None:
        if EOS_TEXT not in self._encoding.special_tokens_set:
            raise TokenizerError(f"tiktoken's {name} has no {EOS_TEXT} token")
        self.eos_id = self._encoding.encode_single_token(EOS_TEXT)
        self.vocab_size = self._encoding.n_vocab
        self.hash = _digest(b"tiktoken", name.encode(), contents)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), np.int32)

    def decode(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids if int(i) != self.eos_id])

    def token_bytes(self) -> np.ndarray:
        sizes = np.zeros(self.vocab_size, np.int32)
        special = set(self._encoding._special_tokens.values())  # noqa: SLF001 - tiktoken has no public list of ids
        for i in range(self.vocab_size):
            if i not in special:
                try:
                    sizes[i] = len(self._encoding.decode_single_token_bytes(i))
                except KeyError:  # a hole in the ranks
                    pass
        return sizes


_TIKTOKEN_NAMES = ("cl100k_base", "o200k_base", "o200k_harmony", "p50k_base", "p50k_edit", "r50k_base")


def _ranks(contents: bytes, path: str) -> dict[bytes, int]:
    """A .tiktoken file's ranks (a base64 token and its rank per line), read here rather than by tiktoken, whose
    reader keeps a cached copy of every path it reads and would serve it after the file changed."""
    import base64
    import binascii

    ranks = {}
    for n, line in enumerate(contents.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}, line {n}: not a base64 token and its rank ({e}); give a .tiktoken "
                                 "file") from e
    return ranks


def train_bpe(texts: Iterable[str], vocab_size: int) -> HuggingFaceTokenizer:
    """A byte-level BPE of `vocab_size` tokens (every byte, `EOS_TEXT` and the merges) trained on `texts`
    with Hugging Face `tokenizers` (its BPE trainer, Sennrich et al., arXiv 1508.07909, over GPT-2's byte-level
    alphabet). The same texts in the same order give the same tokenizer and hash.

    Raises:
      TokenizerError: `vocab_size` below `MIN_BPE_VOCAB`, or no text.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(f"a byte-level BPE needs a vocabulary of at least {MIN_BPE_VOCAB} tokens (every byte "
                             f"and the end of document); got {vocab_size}")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False,
    )
    seen = [0]

    def counted():
        for text in texts:
            seen[0] += 1
            yield text

    tokenizer.train_from_iterator(counted(), trainer)
    if not seen[0]:
        raise TokenizerError("no text to train the BPE on; give the files of the training split")
    return HuggingFaceTokenizer(tokenizer, "bpe")


def _byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet (Radford et al. 2019), the one `tokenizers.pre_tokenizers.ByteLevel` maps to:
    character of byte b, for b in 0..255 (printable Latin-1 bytes stand for themselves, the others for
    U+0100 onwards in byte order)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_level_json(with_eos: bool = False) -> str:
    """The `bytes` kind as a Hugging Face tokenizer.json: a byte-level BPE with no merges whose id b is byte b
    (0..255), so that `transformers.AutoTokenizer` encodes text to its UTF-8 bytes and decodes them back; with
    `with_eos`, id 256 is the special `EOS_TEXT` (`BYTE_EOS`)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {c: b for b, c in enumerate(_byte_characters())}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if with_eos:
        tokenizer.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
    return tokenizer.to_str()


def is_byte_level(path: str) -> bool:
    """Whether the tokenizer.json at `path` is `byte_level_json`'s (with or without its end-of-document token):
    the ids of the `bytes` kind."""
    from tokenizers import Tokenizer as HFTokenizer

    text = HFTokenizer.from_file(path).to_str()
    return text in (HFTokenizer.from_str(byte_level_json(e)).to_str() for e in (False, True))


def load(kind: str, path: str = "", *, eos_token: str = EOS_TEXT, tiktoken_name: str = "cl100k_base") -> Tokenizer:
    """The tokenizer of `kind` (one of `KINDS`) from its file `path` (none for "bytes"; a tokenizer.json for
    "bpe" and "tokenizer_json"; a .model for "sentencepiece"; a .tiktoken for "tiktoken").

    Raises:
      TokenizerError: an unknown kind, a missing or unreadable file, or one of another kind.
    """
    if kind not in KINDS:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose one of {KINDS}")
    if kind == "bytes":
        return ByteTokenizer()
    if not path or not os.path.isfile(path):
        raise TokenizerError(f"the {kind} tokenizer's file {path!r} does not exist; give the path of "
                             f"{'its .model file' if kind == 'sentencepiece' else 'its .tiktoken file' if kind == 'tiktoken' else 'its tokenizer.json'}")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    if kind == "tiktoken":
        return TiktokenTokenizer(path, tiktoken_name)
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tokenizer = HFTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type for a malformed file
        raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json ({e})") from e
    return HuggingFaceTokenizer(tokenizer, kind, eos_token)
