"""Text from a run's model: autoregressive sampling with a KV cache.

  python -m island_jax.sample --workdir=DIR --prompt="def " [--round=R] [--temperature=0.8] [--top_k=0]
      [--top_p=1.0] [--max_new_tokens=64] [--seed=0] [--num_samples=1] [--export=DIR] [--mesh=DATA,EXPERT]

loads the global parameters of the run in DIR (finished or running: its
newest checkpoint, or round R's; `model.load.from_workdir`), or of an export
(`--export`, `model.load.from_export`), and prints each sample. The same is
`experiment.Result.sample(...)` in a notebook, or `generate` here.

The prompt is bytes (UTF-8), as the model's tokens are; each step feeds one
token through `Transformer.decode`, which keeps every block's keys and values
(a KV cache), so a step costs one position, not the whole sequence. The model
trained on positions 0..model.seq_len-1 (learned positions stop there, and
rotary ones are kept to them), so the prompt and the new tokens together are
at most seq_len bytes. Sampling runs with no router jitter and
no token dropped by expert capacity (`moe.capacity_factor` 0), on this
process's first device, or on a (data, expert) mesh of its devices (`--mesh`:
the KV cache and the MoE layers' tokens split over it, the experts over
`expert`).

temperature 0 is greedy decoding (the argmax at each step). Otherwise the
logits are divided by the temperature, cut to the `top_k` most likely tokens
(0: all) and to the smallest set whose probability reaches `top_p` (nucleus
sampling, Holtzman et al., arXiv 1904.09751; 1.0: all), and a token is drawn
with the PRNG key of `seed` folded with the position it is drawn for.
"""

from __future__ import annotations

import functools
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from island_jax.config import BYTE_SYMBOLS


class SampleError(ValueError):
    """A sampling request the model cannot serve (too long, an empty prompt, bad settings); says what to change."""


def _sampling_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with no token dropped by expert capacity and no jitter (the graph only; parameters unchanged)."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.moe.capacity_factor = 0.0
    c.moe.jitter_noise = 0.0
    return c


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


def _choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, key) -> np.ndarray:
    """The next token of each row of float32 logits [B, V] (the byte symbols only), as int32 [B]."""
    logits = np.asarray(logits, np.float64)[:, :BYTE_SYMBOLS]
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


def _check_length(prompt: bytes, max_new_tokens: int, seq_len: int) -> None:
    """Raises SampleError for an empty prompt, or one that with `max_new_tokens` passes the learned positions."""
    if not prompt:
        raise SampleError("the prompt is empty; give at least one byte to continue")
    if len(prompt) + max_new_tokens > seq_len:
        raise SampleError(
            f"a prompt of {len(prompt)} bytes and {max_new_tokens} new tokens make {len(prompt) + max_new_tokens} "
            f"positions, but the model learned {seq_len} (model.seq_len); shorten the prompt or max_new_tokens"
        )


def generate(
    config: ml_collections.ConfigDict, params: dict, prompt: bytes, max_new_tokens: int = 64,
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1,
    mesh: tuple[int, int] | None = None,
) -> list[bytes]:
    """Continues `prompt` `num_samples` times, each by `max_new_tokens` bytes.

    Args:
      config: the run's config (its model and MoE shapes).
      params: the parameters (`init_params`' pure dict; `model.load`).
      prompt: the bytes to continue (at least one).
      max_new_tokens: bytes generated per sample.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of tokens whose probability reaches p (1.0: all).
      seed: the PRNG seed of the draws (folded with each step).
      num_samples: continuations, decoded together as one batch.
      mesh: (data, expert) sizes of a mesh of this process's first data x expert devices; None: one device.
        `num_samples` must be a multiple of data x expert, and `moe.num_experts` of expert.

    Returns:
      `num_samples` continuations, the prompt's bytes left out.

    Raises:
      SampleError: an empty prompt, prompt + max_new_tokens beyond `model.seq_len`, a temperature below 0,
        top_p outside (0, 1], or a mesh the samples or experts do not divide.
    """
    from island_jax.mesh import island_mesh
    from island_jax.model.init import init_params

    seq_len = config.model.seq_len
    _check_length(prompt, max_new_tokens, seq_len)
    if num_samples < 1:
        raise SampleError(f"num_samples is {num_samples}; ask for at least one sample")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise SampleError(f"temperature {temperature}, top_k {top_k}, top_p {top_p}, max_new_tokens {max_new_tokens}: "
                          "use a temperature >= 0 (0: greedy), top_k >= 0 (0: all), top_p in (0, 1], tokens >= 0")
    data, expert = mesh or (1, 1)
    if num_samples % (data * expert) or config.moe.num_experts % expert:
        raise SampleError(f"a mesh of data={data} x expert={expert} needs num_samples ({num_samples}) divisible by "
                          f"{data * expert} and moe.num_experts ({config.moe.num_experts}) by {expert}")
    graphdef, _, _ = init_params(_sampling_config(config))
    step, empty, _ = _programs(graphdef)
    devices = jax.devices()[: data * expert]
    with jax.set_mesh(island_mesh(data, expert, devices)):
        params = jax.device_put(params)  # once, not at every step
        cache = empty(params, num_samples, seq_len)
        tokens = np.frombuffer(prompt, np.uint8).astype(np.int32)
        rows = np.tile(tokens, (num_samples, 1))
        key = jax.random.key(seed)
        out = []
        for pos in range(len(prompt) + max_new_tokens - 1):
            logits, cache = step(params, cache, jnp.asarray(rows[:, pos : pos + 1]), jnp.int32(pos))
            if pos + 1 < len(prompt):
                continue  # the prompt: its keys and values go into the cache
            nxt = _choose(np.asarray(logits), temperature, top_k, top_p, jax.random.fold_in(key, pos))
            out.append(nxt)
            rows = np.concatenate([rows, nxt[:, None]], axis=1)
    if not out:
        return [b""] * num_samples
    return [bytes(np.stack(out, axis=1)[i].astype(np.uint8).tolist()) for i in range(num_samples)]


def greedy_without_cache(config: ml_collections.ConfigDict, params: dict, prompt: bytes, max_new_tokens: int) -> bytes:
    """Greedy decoding the slow way, the reference `generate` is checked against: the whole sequence through the
    model (`Transformer.__call__`, causal attention, no cache) for every new token, on one device. The sequence
    is padded to `model.seq_len` (one program for every length); causal attention and no capacity drops keep
    the padding out of the positions read. Returns the `max_new_tokens` new bytes.

    Raises:
      SampleError: as `generate`, for an empty prompt or one too long for `model.seq_len`.
    """
    _check_length(prompt, max_new_tokens, config.model.seq_len)
    from island_jax.mesh import island_mesh
    from island_jax.model.init import init_params

    graphdef, _, _ = init_params(_sampling_config(config))
    _, _, full = _programs(graphdef)
    tokens = np.zeros((1, config.model.seq_len), np.int32)
    tokens[0, : len(prompt)] = np.frombuffer(prompt, np.uint8)
    with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
        for t in range(len(prompt), len(prompt) + max_new_tokens):
            logits = np.asarray(full(params, jnp.asarray(tokens)))[0, t - 1, :BYTE_SYMBOLS]
            tokens[0, t] = int(np.argmax(logits))
    return bytes(tokens[0, len(prompt) : len(prompt) + max_new_tokens].astype(np.uint8).tolist())


def text(sample: bytes) -> str:
    """A sample's bytes as text (UTF-8; a byte sequence that is not UTF-8 shows as U+FFFD)."""
    return sample.decode("utf-8", errors="replace")


def _main(argv: Sequence[str]) -> int:
    from absl import flags

    from island_jax.model import load

    f = flags.FLAGS
    del argv
    try:
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
        samples = generate(config, params, f.prompt.encode("utf-8"), f.max_new_tokens, f.temperature, f.top_k,
                           f.top_p, f.seed, f.num_samples, mesh)
    except (SampleError, load.LoadError, FileNotFoundError, ValueError) as e:
        sys.exit(f"island_jax.sample: {e}")
    for i, sample in enumerate(samples):
        print(f"--- sample {i} ({where}, temperature {f.temperature}, seed {f.seed})")
        print(f.prompt + text(sample))
    return 0


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", "", "A run's folder (finished or running).")
    flags.DEFINE_string("export", "", "An export's folder (python -m island_jax.export), instead of --workdir.")
    flags.DEFINE_integer("round", None, "With --workdir: the checkpoint of this round (default: the newest).")
    flags.DEFINE_string("prompt", "\n", "The text to continue (UTF-8 bytes).")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0: greedy.")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0: all.")
    flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens whose probability reaches p; 1: all.")
    flags.DEFINE_integer("max_new_tokens", 64, "Bytes to generate per sample.")
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
