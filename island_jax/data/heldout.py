"""Held-out sets and their scores: a fixed sample of held-out windows, its batches, and the losses' units.

The held-out set is `eval_windows`: windows of the held-out bytes (or a prepared dataset's eval records)
chosen by `eval.seed` alone, the same for every config that scores the same corpus. A window's loss is in
nats per byte on bytes and nats per token on prepared records; `bits_per_byte` makes runs of different
tokenizers compare.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from island_jax.data.pipeline import Windows


def scored(windows: np.ndarray, token_bytes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(targets, bytes of text) each window of a held-out set predicts: int64 [n] each.

    Args:
      windows: `eval_windows`' array: uint8 [n, S + 1] byte windows (S targets of one byte each), or int32
        [n, 2, S + 1] packed records (the targets whose segment is not 0, and their tokens' bytes).
      token_bytes: `Corpus.token_bytes` (needed for records).
    """
    if windows.ndim == 2:
        count = np.full(len(windows), windows.shape[1] - 1, np.int64)
        return count, count
    real = windows[:, 1, 1:] != 0
    return real.sum(axis=1).astype(np.int64), np.where(real, token_bytes[windows[:, 0, 1:]], 0).sum(axis=1).astype(np.int64)


def eval_windows(data, seq_len: int, num_windows: int, seed: int = 0) -> np.ndarray:
    """The held-out set: `num_windows` distinct windows of the held-out bytes, chosen by `seed` alone.

    The windows are `Windows(data, seq_len)`'s items at the first `num_windows` places of a permutation seeded by
    `seed` (`eval.seed`, not the run's seed, so that runs of every seed score one set), in that order: every
    config that evaluates the same corpus at the same `seq_len` and `eval.num_windows` scores the same windows,
    whatever its batch size or devices, and the set's first and second halves are two random halves.

    Args:
      data: uint8 [n], the held-out bytes (`Corpus.eval`), or a `grain.MapDataset` of packed records (each
        one a window).
      seq_len: tokens per input sequence; a window is seq_len + 1 tokens.
      num_windows: how many; when the held-out data hold fewer windows, all of them (in the seeded order).
      seed: `eval.seed`.

    Returns:
      uint8 [min(num_windows, len(Windows(data, seq_len))), seq_len + 1], or int32 [n, 2, seq_len + 1] records.

    Raises:
      DataError: fewer than seq_len + 1 bytes.
    """
    source = Windows(data, seq_len) if isinstance(data, np.ndarray) else data
    order = np.random.default_rng(seed).permutation(len(source))[:num_windows]
    return np.stack([source[i] for i in order])


def windows_sha256(windows: np.ndarray) -> str:
    """The first 16 hex digits of the SHA-256 of a held-out set (`eval_windows`'s array, its shape included)."""
    digest = hashlib.sha256(str(windows.shape).encode())
    digest.update(np.ascontiguousarray(windows, np.uint8 if windows.ndim == 2 else np.int32).tobytes())
    return digest.hexdigest()[:16]


def eval_batches(windows: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, int]]:
    """The held-out set in batches of `batch_size` windows, the last one padded with zero windows.

    Args:
      windows: uint8 [n, seq_len + 1] or int32 [n, 2, seq_len + 1] (`eval_windows`).
      batch_size: windows per batch (`eval.batch_size`, a multiple of the island's devices).

    Returns:
      [(windows' dtype [batch_size, ...], how many of its rows are windows)], ceil(n / batch_size) of them;
      padded rows come last and are left out of every loss (`Island.evaluate`).
    """
    batches = []
    for start in range(0, len(windows), batch_size):
        part = windows[start : start + batch_size]
        real = len(part)
        if real < batch_size:
            part = np.concatenate([part, np.zeros((batch_size - real, *windows.shape[1:]), windows.dtype)])
        batches.append((part, real))
    return batches


def mean_and_stderr(losses: np.ndarray) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-window losses (float [n], nats per byte): the standard error is
    the sample standard deviation (ddof 1) over sqrt(n); NaN for one window."""
    losses = np.asarray(losses, np.float64)
    stderr = float(np.std(losses, ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return float(np.mean(losses)), stderr


def loss_unit(config, bits_per_byte: float | None = None) -> str:
    """The unit of the run's losses in log lines: "nats/byte" on bytes; "nats/token" on prepared records, with
    `bits_per_byte` of the text beside it when given."""
    if not config.data.get("prepared", ""):
        return "nats/byte"
    return "nats/token" + ("" if bits_per_byte is None else f" ({bits_per_byte:.4f} bits per byte)")


def bits_per_byte(loss: float, tokens: int, text_bytes: int) -> float:
    """Bits per byte of the underlying text: `loss` (nats per token, a mean over `tokens` tokens) x tokens, over
    the text's `text_bytes` UTF-8 bytes and ln 2. Runs of different tokenizers compare by it; on bytes (tokens
    == text_bytes) it is loss / ln 2 exactly.

    Raises:
      ValueError: `text_bytes` is not positive.
    """
    if text_bytes <= 0:
        raise ValueError(f"bits per byte of {text_bytes} bytes of text; score at least one byte")
    return loss / math.log(2) * (tokens / text_bytes)
