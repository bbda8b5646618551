"""Blockwise absmax quantization: the one rule of the int8 and int4 codecs, on the host and in XLA programs.

A flat float32 array of n elements is cut into blocks of `block_size` (the last may be short: it is padded
with zeros). A block's scale is absmax / max_code in float32 (0 for an all-zero block, which decodes to exact
zeros), and its codes are x / scale rounded half to even and clipped to [-max_code, max_code] (127 for int8,
7 for int4); a code stands for code x scale. This is 8-bit optimizers' blockwise quantization (Dettmers et
al., arXiv 2110.02861), used for DiLoCo pseudo-gradients by INTELLECT-1 (arXiv 2412.01152).

`quantize` is written once over an array namespace: NumPy on the host (an island's encoder), jax.numpy inside
the encoder's device program and the coordinator's chunk program (`chunk_step.py`): the same operations in the
same order, except that XLA computes absmax / max_code as absmax x float32(1 / max_code), so a scale from an
XLA program may be one ulp off the host's. int4 codes travel two a byte (`pack_int4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def quantize(blocks, max_code: int, xp=np, out=None):
    """The rule: float32 `blocks` [B, L] -> (codes [B, L] float32 whole numbers in [-max_code, max_code],
    scales [B] float32, absmax / max_code).

    Args:
      xp: the array namespace, `numpy` or `jax.numpy`.
      out: NumPy only: a float32 [B, L] work array that receives the codes (no temporaries of that size).
    """
    into = {} if out is None else dict(out=out)
    magnitude = xp.abs(blocks, **into)
    scales = xp.max(magnitude, axis=1) / xp.float32(max_code)
    safe = xp.where(scales > 0, scales, xp.float32(1.0))
    codes = xp.divide(blocks, safe[:, None], **into)
    codes = xp.rint(codes, **into)
    return xp.clip(codes, -max_code, max_code, **into), scales


def dequantize(codes, scales):
    """What codes [..., B, L] stand for: codes x scales [..., B], block by block (NumPy or jax.numpy arrays)."""
    return codes * scales[..., None]


def quantize_blocks(
    x: np.ndarray, block_size: int, max_code: int, scratch: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax quantization of float32 `x` [n] (NumPy): int8 codes [n] in [-max_code, max_code], float32
    scales [ceil(n / block_size)] (absmax / max_code; 0 for an all-zero block).

    `scratch`: optional float32 work space of at least n elements, reused instead of allocating.
    """
    n = x.size
    num_blocks = -(-n // block_size)
    if n % block_size:
        padded = np.zeros(num_blocks * block_size, np.float32)
        padded[:n] = x
        x = padded
    blocks = x.reshape(num_blocks, block_size)
    if scratch is not None and scratch.size >= blocks.size:
        work = scratch[: blocks.size].reshape(blocks.shape)
    else:
        work = np.empty_like(blocks)
    codes, scale = quantize(blocks, max_code, np, out=work)
    return codes.astype(np.int8).reshape(-1)[:n], scale


def quantize_array(x: jax.Array, block_size: int, max_code: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`quantize_blocks` in jax.numpy, of an array of any shape flattened: codes (int8) [n], float32 scales
    [blocks], and what they stand for (float32, `x`'s shape)."""
    flat = x.astype(jnp.float32).reshape(-1)
    n = flat.shape[0]
    num_blocks = -(-n // block_size)
    blocks = jnp.pad(flat, (0, num_blocks * block_size - n)).reshape(num_blocks, block_size)
    codes, scale = quantize(blocks, max_code, jnp)
    dequantized = dequantize(codes, scale).reshape(-1)[:n].reshape(x.shape)
    return codes.astype(jnp.int8).reshape(-1)[:n], scale, dequantized


def dequantize_blocks(codes: np.ndarray, scale: np.ndarray, block_size: int) -> np.ndarray:
    """float32 codes x scale [n], block by block (the last block may be short): what the codes stand for (NumPy)."""
    n = codes.size
    full = n // block_size * block_size
    values = np.empty(n, np.float32)
    np.multiply(codes[:full].reshape(-1, block_size), scale[: full // block_size, None], out=values[:full].reshape(-1, block_size))
    if full < n:
        np.multiply(codes[full:], scale[-1], out=values[full:])
    return values


def pack_int4(codes: np.ndarray) -> bytes:
    """int4 codes [n] in [-7, 7] as ceil(n / 2) bytes: code + 8 in the low nibble for even positions, the high
    nibble for odd ones (a last odd code is paired with a zero code)."""
    nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """The n int8 codes of `pack_int4`'s bytes (uint8 [ceil(n / 2)])."""
    codes = np.empty(2 * packed.size, np.int8)
    codes[0::2] = (packed & 0x0F).astype(np.int8) - 8
    codes[1::2] = (packed >> 4).astype(np.int8) - 8
    return codes[:n]
