"""Text from a run's model: autoregressive sampling with a KV cache (docs/workdir.md, "The model").

  python -m island_jax.sample --workdir=DIR --prompt="def " [--round=R] [--temperature=0.8] [--top_k=0]
      [--top_p=1.0] [--max_new_tokens=64] [--seed=0] [--num_samples=1] [--export=DIR] [--mesh=DATA,EXPERT]

loads the run's global parameters (its newest checkpoint or round R's, `model.load.from_workdir`; or an export,
`model.load.from_export`) and prints each sample; `continue_text` (and `experiment.Result.sample`) does the same
in a notebook. The prompt is encoded with the run's tokenizer (`run_tokenizer`), and its ids and the drawn ones
are decoded together. Each step feeds one token through `Transformer.decode`, which keeps every block's keys and
values (at most `model.seq_len` positions in all), with no router jitter and no capacity drops, on one device or
a (data, expert) mesh (`--mesh`). Temperature 0 is greedy; otherwise the logits / temperature are cut to the
`top_k` most likely tokens (0: all) and to the smallest set of probability `top_p` (nucleus sampling, Holtzman
et al., arXiv 1904.09751), and a token is drawn with the PRNG key of `seed` folded with its position.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from island_jax.config import BYTE_SYMBOLS

EXPORT_TOKENIZER_KEY = "tokenizer"  # the safetensors header entry of an export that describes its tokenizer (JSON)
EXPORT_TOKENIZER_FILES = {"bpe": "tokenizer.json", "tokenizer_json": "tokenizer.json",
                          "sentencepiece": "tokenizer.model", "tiktoken": "tokenizer.tiktoken"}


class SampleError(ValueError):
    """A sampling request the model cannot serve (too long, an empty prompt, bad settings, no tokenizer); says
    what to change."""


def tokenizer_record(config: ml_collections.ConfigDict) -> dict:
    """Where the tokenizer of the run of `config` lives: {"kind", "path" (its file; "" for bytes), "eos_token",
    "tiktoken_name", "hash" (`Tokenizer.hash`), "vocab_size" (the ids the run trained on)}.

    The byte corpus (no `data.prepared`) is UTF-8 bytes, ids 0..255 (`BYTE_SYMBOLS`); a prepared dataset's is
    the tokenizer its manifest names: a BPE trained there (its tokenizer.json beside the shards), or the file it
    was prepared with.

    Raises:
      SampleError: `data.prepared` names a folder that is not a prepared dataset (`data.records.PreparedDataset`).
    """
    from island_jax.data import tokenizer as tokenizer_lib
    from island_jax.data.errors import DataError
    from island_jax.data.records import TOKENIZER_FILE, PreparedDataset

    prepared = config.data.get("prepared", "")
    if not prepared:
        return dict(kind="bytes", path="", eos_token="", tiktoken_name="", hash=tokenizer_lib.ByteTokenizer.hash,
                    vocab_size=BYTE_SYMBOLS)
    try:
        dataset = PreparedDataset(prepared)
    except DataError as e:
        raise SampleError(f"the run's tokenizer is that of data.prepared, and {e}") from e
    settings, tok = dataset.manifest["settings"], dataset.manifest["tokenizer"]
    path = os.path.join(dataset.path, TOKENIZER_FILE) if tok["kind"] == "bpe" else settings["tokenizer_path"]
    return dict(kind=tok["kind"], path=path, eos_token=settings["eos_token"],
                tiktoken_name=settings.get("tiktoken_name") or "", hash=tok["hash"], vocab_size=int(tok["vocab_size"]))


def export_tokenizer_record(folder: str) -> dict | None:
    """The tokenizer an export in `folder` carries (`island_jax.export`; the record `tokenizer_record` gives, its
    path a file of `folder`), or None for an export written without one."""
    from safetensors import safe_open

    from island_jax.model.load import WEIGHTS_FILE

    with safe_open(os.path.join(folder, WEIGHTS_FILE), framework="numpy") as f:
        text = (f.metadata() or {}).get(EXPORT_TOKENIZER_KEY)
    if text is None:
        return None
    record = json.loads(text)
    record["path"] = os.path.join(folder, EXPORT_TOKENIZER_FILES[record["kind"]]) if record["kind"] != "bytes" else ""
    return record


def load_tokenizer(record: dict):
    """The `island_jax.data.tokenizer.Tokenizer` of a `tokenizer_record`, checked against the hash the run recorded.

    Raises:
      SampleError: its file is missing or unreadable, or is not the tokenizer the run trained with (another hash).
    """
    from island_jax.data import tokenizer as tokenizer_lib

    eos_token = record["eos_token"] or tokenizer_lib.EOS_TEXT
    try:
        tokenizer = tokenizer_lib.load(record["kind"], record["path"], eos_token=eos_token,
                                       tiktoken_name=record["tiktoken_name"])
    except tokenizer_lib.TokenizerError as e:
        raise SampleError(f"the run's tokenizer cannot be read: {e}") from e
    if tokenizer.hash != record["hash"]:
        raise SampleError(f"{record['path']} is tokenizer {tokenizer.hash}, but the run trained on tokenizer "
                          f"{record['hash']}; put back the file the data was prepared with")
    return tokenizer


def run_tokenizer(config: ml_collections.ConfigDict, export: str = ""):
    """The tokenizer of the run of `config`: the one the export in `export` carries, else `tokenizer_record`'s.

    Raises:
      SampleError: as `tokenizer_record` and `load_tokenizer`.
    """
    record = (export_tokenizer_record(export) if export else None) or tokenizer_record(config)
    return load_tokenizer(record)


def _vocabulary(config: ml_collections.ConfigDict, tokenizer) -> int:
    """The ids sampling draws from: the tokenizer's vocabulary (the byte corpus's 256 bytes), at most the model's."""
    from island_jax.data import tokenizer as tokenizer_lib

    if isinstance(tokenizer, tokenizer_lib.ByteTokenizer) and not config.data.get("prepared", ""):
        return BYTE_SYMBOLS  # the byte corpus has no end-of-document token
    return min(tokenizer.vocab_size, config.model.vocab_size)


def _sampling_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with no token dropped by expert capacity and no jitter (the graph only; parameters unchanged)."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.moe.capacity_factor = 0.0
    c.moe.jitter_noise = 0.0
    return c


def _laid_out(config: ml_collections.ConfigDict, params: dict) -> dict:
    """`params` (either layout) in the one `config`'s model takes (`model.scan_layers`)."""
    from island_jax.model import stacking

    return stacking.to_layout(params, config.model.get("scan_layers", False), config.moe.every_n_layers)


@functools.lru_cache(maxsize=8)
def _programs(graphdef):
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=(1,))  # the cache is updated in place
    def step(params, cache, tokens, pos):
        model = nnx.merge(graphdef, nnx.State(params))
        logits, cache = model.decode(tokens, pos, cache)
        return logits[:, 0], cache

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def empty(params, batch, length):
        return nnx.merge(graphdef, nnx.State(params)).init_cache(batch, length)

    @jax.jit
    def full(params, tokens):
        logits, _ = nnx.merge(graphdef, nnx.State(params))(tokens)
        return logits

    return step, empty, full


def _choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, key, vocab_size: int) -> np.ndarray:
    """The next token of each row of float32 logits [B, V] (ids below `vocab_size` only), as int32 [B]."""
    logits = np.asarray(logits, np.float64)[:, :vocab_size]
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int32)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    if top_p < 1.0:
        order = np.argsort(-logits, axis=-1)
        probs = np.take_along_axis(np.exp(logits - logits.max(-1, keepdims=True)), order, axis=-1)
        probs /= probs.sum(-1, keepdims=True)
        keep_sorted = np.cumsum(probs, axis=-1) - probs < top_p  # the tokens before the set reaches top_p, and it
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        logits = np.where(keep, logits, -np.inf)
    return np.asarray(jax.random.categorical(key, jnp.asarray(logits, jnp.float32), axis=-1), np.int32)


def _prompt_ids(prompt, max_new_tokens: int, seq_len: int) -> np.ndarray:
    """`prompt`'s ids as int32 [P]; raises SampleError for an empty prompt, or one that with `max_new_tokens`
    passes the learned positions."""
    ids = np.asarray(prompt, np.int32).reshape(-1)
    if not len(ids):
        raise SampleError("the prompt is empty; give at least one token to continue")
    if len(ids) + max_new_tokens > seq_len:
        raise SampleError(
            f"a prompt of {len(ids)} tokens and {max_new_tokens} new tokens make {len(ids) + max_new_tokens} "
            f"positions, but the model learned {seq_len} (model.seq_len); shorten the prompt or max_new_tokens"
        )
    return ids


def generate(
    config: ml_collections.ConfigDict, params: dict, prompt: Sequence[int] | np.ndarray, max_new_tokens: int = 64,
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
    mesh: tuple[int, int] | None = None, vocab_size: int | None = None,
) -> np.ndarray:
    """Continues the token ids `prompt` `num_samples` times, each by `max_new_tokens` tokens.

    Args:
      config: the run's config (its model and MoE shapes).
      params: the parameters (`init_params`' pure dict; `model.load`), in either layout: they are laid out as
        `config`'s model takes them (`model.scan_layers`, `model.stacking.to_layout`).
      prompt: the ids to continue (at least one), int [P].
      max_new_tokens: tokens generated per sample.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of tokens whose probability reaches p (1.0: all).
      seed: the PRNG seed of the draws (folded with each step).
      num_samples: continuations, decoded together as one batch.
      mesh: (data, expert) sizes of a mesh of this process's first data x expert devices; None: one device.
        `num_samples` must be a multiple of data x expert, and `moe.num_experts` of expert.
      vocab_size: draw only ids below it (the tokenizer's vocabulary; rows beyond are padding); None:
        `model.vocab_size`.

    Returns:
      int32 [num_samples, max_new_tokens]: the new ids, the prompt's left out.

    Raises:
      SampleError: an empty prompt, prompt + max_new_tokens beyond `model.seq_len`, a temperature below 0,
        top_p outside (0, 1], or a mesh the samples or experts do not divide.
    """
    from island_jax.mesh import island_mesh
    from island_jax.model.init import abstract_params

    seq_len = config.model.seq_len
    tokens = _prompt_ids(prompt, max_new_tokens, seq_len)
    if num_samples < 1:
        raise SampleError(f"num_samples is {num_samples}; ask for at least one sample")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise SampleError(f"temperature {temperature}, top_k {top_k}, top_p {top_p}, max_new_tokens {max_new_tokens}: "
                          "use a temperature >= 0 (0: greedy), top_k >= 0 (0: all), top_p in (0, 1], tokens >= 0")
    data, expert = mesh or (1, 1)
    if num_samples % (data * expert) or config.moe.num_experts % expert:
        raise SampleError(f"a mesh of data={data} x expert={expert} needs num_samples ({num_samples}) divisible by "
                          f"{data * expert} and moe.num_experts ({config.moe.num_experts}) by {expert}")
    vocab_size = config.model.vocab_size if vocab_size is None else vocab_size
    graphdef, _, _ = abstract_params(_sampling_config(config))
    params = _laid_out(config, params)
    step, empty, _ = _programs(graphdef)
    devices = jax.devices()[: data * expert]
    with jax.set_mesh(island_mesh(data, expert, devices)):
        params = jax.device_put(params)  # once, not at every step
        cache = empty(params, num_samples, seq_len)
        rows = np.tile(tokens, (num_samples, 1))
        key = jax.random.key(seed)
        out = []
        for pos in range(len(tokens) + max_new_tokens - 1):
            logits, cache = step(params, cache, jnp.asarray(rows[:, pos : pos + 1]), jnp.int32(pos))
            if pos + 1 < len(tokens):
                continue  # the prompt: its keys and values go into the cache
            nxt = _choose(np.asarray(logits), temperature, top_k, top_p, jax.random.fold_in(key, pos), vocab_size)
            out.append(nxt)
            rows = np.concatenate([rows, nxt[:, None]], axis=1)
    if not out:
        return np.zeros((num_samples, 0), np.int32)
    return np.stack(out, axis=1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Continuation:
    """One sample of `continue_text`.

    Attributes:
      prompt_ids: int32 [P], the prompt's ids.
      ids: int32 [max_new_tokens], the ids drawn.
      text: the tokenizer's decoding of `prompt_ids` followed by `ids`, whole (the prompt's text first).
      new_text: the text after the prompt's: `text` past the decoding of `prompt_ids` alone, or, for a
        tokenizer whose decoding of the whole does not begin with it, the decoding of `ids` alone.
    """

    prompt_ids: np.ndarray
    ids: np.ndarray
    text: str
    new_text: str


def continue_text(
    config: ml_collections.ConfigDict, params: dict, prompt: str, tokenizer=None, max_new_tokens: int = 64,
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
    mesh: tuple[int, int] | None = None,
) -> list[Continuation]:
    """Continues the text `prompt` in the run's tokenizer: encodes it, `generate`s over the tokenizer's whole
    vocabulary, and decodes each sample's ids after the prompt's in one call, so a character split over tokens
    (or a token that is no text alone) decodes as the tokenizer library decodes it.

    Args:
      config, params: the run's config and parameters (`model.load`).
      prompt: the text to continue.
      tokenizer: an `island_jax.data.tokenizer.Tokenizer`; None: `run_tokenizer(config)`.
      max_new_tokens, temperature, top_k, top_p, seed, num_samples, mesh: as `generate`.

    Returns:
      `num_samples` `Continuation`s.

    Raises:
      SampleError: as `generate` (the prompt's length in tokens), and as `run_tokenizer`.
    """
    tokenizer = run_tokenizer(config) if tokenizer is None else tokenizer
    ids = np.asarray(tokenizer.encode(prompt), np.int32)
    if not len(ids):
        raise SampleError("the prompt is empty; give at least one character to continue")
    drawn = generate(config, params, ids, max_new_tokens, temperature, top_k, top_p, seed, num_samples, mesh,
                     _vocabulary(config, tokenizer))
    head = tokenizer.decode(ids)
    out = []
    for row in drawn:
        whole = tokenizer.decode(np.concatenate([ids, row]))
        new = whole[len(head):] if whole.startswith(head) else tokenizer.decode(row)
        out.append(Continuation(ids, row, whole, new))
    return out


def logits(config: ml_collections.ConfigDict, params: dict, tokens: np.ndarray) -> np.ndarray:
    """The model's logits over whole sequences, as a sampler sees them (no capacity drops, no router jitter,
    `_sampling_config`), on one device: float32 [B, S, vocab] of int32 tokens [B, S]; `params` in either layout.
    What a transformers export computes (docs/interop.md)."""
    from island_jax.mesh import island_mesh
    from island_jax.model.init import abstract_params

    graphdef, _, _ = abstract_params(_sampling_config(config))
    _, _, full = _programs(graphdef)
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        return np.asarray(full(_laid_out(config, params), jnp.asarray(tokens, jnp.int32)))


def greedy_without_cache(config: ml_collections.ConfigDict, params: dict, prompt: Sequence[int] | np.ndarray,
                         max_new_tokens: int, vocab_size: int | None = None) -> np.ndarray:
    """Greedy decoding the slow way, the reference `generate` is checked against: the whole sequence through the
    model (`Transformer.__call__`, causal attention, no cache) for every new token, on one device. The sequence
    is padded to `model.seq_len` (one program for every length); causal attention and no capacity drops keep
    the padding out of the positions read. `params` may be in either layout (as `generate`'s). Returns the
    `max_new_tokens` new ids, int32 [max_new_tokens], drawn below `vocab_size` (None: `model.vocab_size`).

    Raises:
      SampleError: as `generate`, for an empty prompt or one too long for `model.seq_len`.
    """
    ids = _prompt_ids(prompt, max_new_tokens, config.model.seq_len)
    from island_jax.mesh import island_mesh
    from island_jax.model.init import abstract_params

    vocab_size = config.model.vocab_size if vocab_size is None else vocab_size
    graphdef, _, _ = abstract_params(_sampling_config(config))
    params = _laid_out(config, params)
    _, _, full = _programs(graphdef)
    tokens = np.zeros((1, config.model.seq_len), np.int32)
    tokens[0, : len(ids)] = ids
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        for t in range(len(ids), len(ids) + max_new_tokens):
            logits = np.asarray(full(params, jnp.asarray(tokens)))[0, t - 1, :vocab_size]
            tokens[0, t] = int(np.argmax(logits))
    return tokens[0, len(ids) : len(ids) + max_new_tokens].copy()


def _main(argv: Sequence[str]) -> int:
    from absl import flags

    from island_jax.logs import quiet_libraries
    from island_jax.model import load

    f = flags.FLAGS
    del argv
    try:
        with quiet_libraries():
            if f.export:
                config, params = load.from_export(f.export)
                where = f.export
            elif f.workdir:
                config, params, round = load.from_workdir(f.workdir, f.round)
                where = f"{f.workdir}, round {round}"
            else:
                raise SampleError("give --workdir=DIR (a run) or --export=DIR (python -m island_jax.export)")
            mesh = tuple(int(x) for x in f.mesh.split(",")) if f.mesh else None
            if mesh is not None and len(mesh) != 2:
                raise SampleError(f"--mesh={f.mesh}: give DATA,EXPERT, e.g. 1,2")
            samples = continue_text(config, params, f.prompt, run_tokenizer(config, f.export), f.max_new_tokens,
                                    f.temperature, f.top_k, f.top_p, f.seed, f.num_samples, mesh)
    except (SampleError, load.LoadError, FileNotFoundError, ValueError) as e:
        sys.exit(f"island_jax.sample: {e}")
    for i, sample in enumerate(samples):
        print(f"--- sample {i} ({where}, temperature {f.temperature}, seed {f.seed})")
        print(sample.text)
    return 0


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", "", "A run's folder (finished or running).")
    flags.DEFINE_string("export", "", "An export's folder (python -m island_jax.export), instead of --workdir.")
    flags.DEFINE_integer("round", None, "With --workdir: the checkpoint of this round (default: the newest).")
    flags.DEFINE_string("prompt", "\n", "The text to continue (in the run's tokenizer).")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0: greedy.")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0: all.")
    flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens whose probability reaches p; 1: all.")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per sample.")
    flags.DEFINE_integer("seed", 0, "PRNG seed of the draws.")
    flags.DEFINE_integer("num_samples", 1, "Samples, decoded as one batch.")
    flags.DEFINE_string("mesh", "", "DATA,EXPERT: sample on a mesh of this many CPU devices (default: one).")


if __name__ == "__main__":
    from absl import app

    from island_jax.cli import parse_flags

    _define_flags()
    if "--mesh" in " ".join(sys.argv):  # virtual CPU devices for the mesh, before JAX starts its backend
        for arg in sys.argv:
            if arg.startswith("--mesh="):
                from island_jax.mesh import use_cpu_devices

                data, _, expert = arg.split("=", 1)[1].partition(",")
                use_cpu_devices(int(data) * int(expert or 1))
    app.run(_main, flags_parser=parse_flags)
