"""Prepares local text for training: tokenized, packed into records of --seq_len predictions, in ArrayRecord shards.

  python experiments/prepare_data.py --input=PATH [--input=PATH ...] --out=DIR [--tokenizer=bpe --vocab_size=8192]
      [--format=auto|text|jsonl|parquet --field=text] [--seq_len=1024 --eval_fraction=0.02] [--workers=0]

Each --input is a file, a folder (every file below it) or a glob: text files (a document each), JSONL (the
--field of each line) or Parquet (the --field column). Nothing is downloaded. The tokenizer is a byte-level
BPE trained on the training documents (--tokenizer=bpe, saved as DIR/tokenizer.json), the bytes themselves, or
one read from --tokenizer_path (tokenizer_json, sentencepiece, tiktoken with --tiktoken_name).

DIR gets the shards (train-NNNNN.array_record, eval-NNNNN.array_record), manifest.json (the tokenizer's hash,
documents, tokens and bytes per split, the text files held out and the split rule) and settings.json. Run the
same command again to resume an interrupted preparation: finished shards are kept. The last line is
`prepare_data: documents=D tokens=T megabytes=M seconds=S megabytes_per_second=R`, the text's UTF-8
megabytes (10^6 bytes) over the wall time. island_jax/data/records.py has the format. Train on DIR with
`--config.data.prepared=DIR` (docs/data.md).
"""

import sys

from absl import app, flags

from island_jax.data.preparation import FORMATS
from island_jax.data.tokenizer import KINDS

_INPUT = flags.DEFINE_multi_string("input", None, "A file, folder or glob of local text, JSONL or Parquet files.")
_OUT = flags.DEFINE_string("out", None, "The prepared dataset's folder (created; resumed when it exists).")
_TOKENIZER = flags.DEFINE_enum("tokenizer", "bpe", list(KINDS), "The tokenizer (island_jax/data/tokenizer.py).")
_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "With --tokenizer=bpe: the vocabulary to train, tokens.")
_TOKENIZER_PATH = flags.DEFINE_string("tokenizer_path", "", "The tokenizer's file, for the kinds read from one.")
_EOS = flags.DEFINE_string("eos_token", "<|endoftext|>", "With --tokenizer=tokenizer_json: its end-of-document token.")
_TIKTOKEN = flags.DEFINE_string("tiktoken_name", "cl100k_base", "With --tokenizer=tiktoken: tiktoken's encoding whose "
                                "ranks --tokenizer_path holds ('' for ranks of one's own).")
_FORMAT = flags.DEFINE_enum("format", "auto", list(FORMATS), "The inputs' format (auto: by suffix, .jsonl/.json and "
                            ".parquet, else text).")
_FIELD = flags.DEFINE_string("field", "text", "The JSONL field or Parquet column that holds the text.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Predictions per record, the model.seq_len that trains on it (a "
                                "record holds seq_len + 1 tokens).")
_EVAL = flags.DEFINE_float("eval_fraction", 0.02, "Share of documents held out for evaluation, in [0, 1).")
_SHARD_MB = flags.DEFINE_float("shard_megabytes", 64.0, "Megabytes of text per shard (about).")
_WORKERS = flags.DEFINE_integer("workers", 0, "Processes that tokenize (0: one per CPU).")
flags.mark_flags_as_required(["input", "out"])


def main(argv):
    del argv
    from tqdm import tqdm

    from island_jax.data.errors import DataError
    from island_jax.data.preparation import prepare

    bar = tqdm(unit="B", unit_scale=True, desc="tokenized", file=sys.stderr)
    try:
        manifest = prepare(
            _INPUT.value, _OUT.value, tokenizer=_TOKENIZER.value, vocab_size=_VOCAB.value,
            tokenizer_path=_TOKENIZER_PATH.value, eos_token=_EOS.value, tiktoken_name=_TIKTOKEN.value,
            fmt=_FORMAT.value, field=_FIELD.value, seq_len=_SEQ_LEN.value, eval_fraction=_EVAL.value,
            shard_bytes=int(_SHARD_MB.value * 1e6), workers=_WORKERS.value, progress=lambda e: bar.update(e["bytes"]),
        )
    except DataError as e:
        sys.exit(f"{type(e).__name__}: {e}")
    finally:
        bar.close()
    splits = manifest["splits"].values()
    documents, tokens = sum(s["documents"] for s in splits), sum(s["tokens"] for s in splits)
    megabytes, seconds = sum(s["bytes"] for s in splits) / 1e6, manifest["seconds"]
    for name, s in manifest["splits"].items():
        print(f"{name}: {s['documents']} documents, {s['tokens']} tokens, {s['bytes'] / 1e6:.1f} MB of text in "
              f"{len(s['shards'])} shards")
    print(f"tokenizer: {manifest['tokenizer']['kind']}, {manifest['tokenizer']['vocab_size']} tokens, hash "
          f"{manifest['tokenizer']['hash']}")
    print(f"prepare_data: documents={documents} tokens={tokens} megabytes={megabytes:.1f} seconds={seconds:.1f} "
          f"megabytes_per_second={megabytes / max(seconds, 1e-9):.2f}")


if __name__ == "__main__":
    app.run(main)
