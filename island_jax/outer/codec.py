"""Wire codecs for pseudo-gradients.

A payload is the concatenation, in pytree-flatten order, of each leaf's encoding;
the shapes and dtypes are not sent, since both ends know the model. Kinds:

  none  float32 little-endian, 4 bytes per element.
  bf16  bfloat16, 2 bytes per element.
  int8  blockwise absmax quantization (as in 8-bit optimizers, Dettmers et al.,
        arXiv 2110.02861; used for DiLoCo pseudo-gradients by INTELLECT-1, arXiv
        2412.01152): each leaf is flattened and cut into blocks of `block_size`
        elements (the last block may be short); a block's float32 scale is
        absmax / 127 and its codes are round(x / scale) clipped to [-127, 127].
        A leaf of n elements costs n + 4 * ceil(n / block_size) bytes, so a
        model of P parameters costs about P * (1 + 4 / block_size) bytes. An
        all-zero block has scale 0 and decodes to exact zeros.
  int4  the same blockwise scheme with codes in [-7, 7] (scale = absmax / 7),
        two codes a byte (code + 8 in the low nibble for even positions, the
        high nibble for odd ones): ceil(n / 2) + 4 * ceil(n / block_size) bytes.

`encode_with_feedback` adds error feedback (as in MuLoCo and SparseLoCo): what
the codec lost last round is added to this round's tree before encoding, and
what it loses now is kept for the next round, so quantization error is
delayed, never dropped.

`encode` runs with jax.numpy (on device for an island, on the CPU for the
coordinator) and returns host bytes; `decode` and `decode_and_apply` run in
NumPy on the host, so every process that applies the same bytes to the same
parameters gets the same bits, whatever its accelerator.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

KINDS = ("none", "bf16", "int8", "int4")
_MAX_CODE = {"int8": 127, "int4": 7}


class CodecError(ValueError):
    """A payload does not match what the codec expects (size, kind)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CodecError(f"unknown codec kind {kind!r}; choose one of {KINDS}")


def leaf_bytes(size: int, kind: str, block_size: int) -> int:
    """Bytes on the wire for one leaf of `size` elements."""
    _check_kind(kind)
    if kind == "none":
        return 4 * size
    if kind == "bf16":
        return 2 * size
    code_bytes = size if kind == "int8" else (size + 1) // 2
    return code_bytes + 4 * math.ceil(size / block_size)


def payload_bytes(like: Any, kind: str, block_size: int) -> int:
    """Bytes of a whole payload for a pytree shaped like `like` (arrays or ShapeDtypeStructs)."""
    return sum(leaf_bytes(int(np.prod(x.shape)), kind, block_size) for x in jax.tree.leaves(like))


def layout(like: Any, kind: str, block_size: int) -> str:
    """SHA-256 prefix (16 hex digits) of a payload's layout: leaf paths, shapes, kind, block size.

    Two ends whose layouts agree read each other's payloads element for element;
    the gRPC exchange refuses a payload whose layout differs from the round's.
    """
    import hashlib

    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    text = repr([(jax.tree_util.keystr(path), tuple(x.shape)) for path, x in leaves]) + f"|{kind}|{block_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _quantize_leaf(x: jax.Array, block_size: int, max_code: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Blockwise absmax codes (int8 in [-max_code, max_code]) [n], float32 scales [blocks], dequantized [shape]."""
    flat = x.astype(jnp.float32).reshape(-1)
    n = flat.shape[0]
    num_blocks = -(-n // block_size)
    blocks = jnp.pad(flat, (0, num_blocks * block_size - n)).reshape(num_blocks, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    scale = absmax / max_code
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(blocks / safe[:, None]), -max_code, max_code)
    dequantized = (codes * scale[:, None]).reshape(-1)[:n].reshape(x.shape)
    return codes.astype(jnp.int8).reshape(-1)[:n], scale, dequantized


def _pack_int4(codes: np.ndarray) -> bytes:
    nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def _unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    codes = np.empty(2 * packed.size, np.int8)
    codes[0::2] = (packed & 0x0F).astype(np.int8) - 8
    codes[1::2] = (packed >> 4).astype(np.int8) - 8
    return codes[:n]


@functools.partial(jax.jit, static_argnames=("kind", "block_size"))
def _encode_tree(leaves, residuals, kind, block_size):
    """One program for the whole tree (on the leaves' devices, sharded or not).

    Returns (per leaf: the arrays to put on the wire), the new residuals
    (intended - sent, float32), ||intended|| and ||intended - sent||.
    """
    wire, new_residuals, intended_sq, lost_sq = [], [], 0.0, 0.0
    for i, x in enumerate(leaves):
        intended = x.astype(jnp.float32) if residuals is None else x.astype(jnp.float32) + residuals[i]
        if kind == "none":
            parts, sent = (intended,), intended
        elif kind == "bf16":
            b = intended.astype(jnp.bfloat16)
            parts, sent = (b,), b.astype(jnp.float32)
        else:
            codes, scale, sent = _quantize_leaf(intended, block_size, _MAX_CODE[kind])
            parts = (codes, scale)
        lost = intended - sent
        wire.append(parts)
        new_residuals.append(lost)
        intended_sq += jnp.sum(intended * intended)
        lost_sq += jnp.sum(lost * lost)
    return wire, new_residuals, jnp.sqrt(intended_sq), jnp.sqrt(lost_sq)


def _wire_bytes(parts, kind: str) -> bytes:
    if kind == "none":
        return np.asarray(parts[0]).astype("<f4").tobytes()
    if kind == "bf16":
        return np.asarray(parts[0]).tobytes()
    codes, scale = (np.asarray(p) for p in parts)
    code_bytes = codes.tobytes() if kind == "int8" else _pack_int4(codes)
    return code_bytes + scale.astype("<f4").tobytes()


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise CodecError(f"block_size is {block_size}; it must be a positive number of elements")


def encode_and_measure(
    tree: Any, residual: Any, kind: str, block_size: int
) -> tuple[bytes, Any, float]:
    """Encodes `tree` (+ `residual`, for error feedback) in one program on the tree's devices.

    Args:
      tree: pytree of float arrays of any rank and size (scalars, bfloat16
        included); values must be finite. Sharded arrays stay sharded: the
        quantization runs where they live and only the encoded bytes come to
        the host.
      residual: None, or a float32 pytree like `tree` added before encoding.
      kind: "none", "bf16", "int8" or "int4".
      block_size: elements per scale of int8 / int4 (ignored by the other kinds).

    Returns:
      (payload of `payload_bytes(tree, kind, block_size)` bytes, the new
      residual (intended - sent, float32 jax arrays like `tree`), the relative
      error ||intended - sent|| / ||intended||).

    Raises:
      CodecError: on an unknown kind or a block_size <= 0.
    """
    _check_kind(kind)
    _check_block_size(block_size)
    leaves, treedef = jax.tree.flatten(tree)
    residuals = None if residual is None else jax.tree.leaves(residual)
    wire, new_residuals, intended, lost = _encode_tree(leaves, residuals, kind, block_size)
    wire, intended, lost = jax.device_get((wire, intended, lost))  # waits for the one program
    payload = b"".join(_wire_bytes(parts, kind) for parts in wire)
    return payload, jax.tree.unflatten(treedef, new_residuals), float(lost / max(float(intended), 1e-30))


def encode(tree: Any, kind: str, block_size: int) -> bytes:
    """Encodes a pytree of floating arrays into one payload (see `encode_and_measure`).

    Returns:
      The payload: `payload_bytes(tree, kind, block_size)` bytes.

    Raises:
      CodecError: on an unknown kind or a block_size <= 0.
    """
    return encode_and_measure(tree, None, kind, block_size)[0]


def encode_with_feedback(tree: Any, residual: Any, kind: str, block_size: int) -> tuple[bytes, Any]:
    """Error-feedback encoding: sends tree + residual, keeps what the codec lost.

    Args:
      tree: pytree of float arrays (this round's pseudo-gradient).
      residual: float32 pytree like `tree` (zeros in the first round).
      kind, block_size: as for `encode`.

    Returns:
      (payload of `encode(tree + residual)`, new residual = tree + residual -
      decode(payload)) with the residual as float32 jax arrays.
    """
    payload, new_residual, _ = encode_and_measure(tree, residual, kind, block_size)
    return payload, new_residual


def decode(payload: bytes, like: Any, kind: str, block_size: int) -> Any:
    """Decodes a payload into float32 NumPy arrays shaped like `like`.

    Args:
      payload: bytes from `encode` for a pytree with `like`'s structure and shapes.
      like: pytree of arrays or ShapeDtypeStructs giving structure and shapes.
      kind, block_size: as given to `encode`.

    Returns:
      A pytree with `like`'s structure of float32 `np.ndarray`s.

    Raises:
      CodecError: if the payload's size differs from what `like` implies.
    """
    _check_kind(kind)
    expected = payload_bytes(like, kind, block_size)
    if len(payload) != expected:
        raise CodecError(
            f"payload is {len(payload)} bytes but a {kind} payload for these parameters is {expected} bytes; "
            "the sender uses a different model shape, codec or block_size"
        )
    buf = memoryview(payload)
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for leaf in leaves:
        shape = tuple(leaf.shape)
        n = int(np.prod(shape))
        if kind == "none":
            values = np.frombuffer(buf, "<f4", n, offset).astype(np.float32)
            offset += 4 * n
        elif kind == "bf16":
            values = np.frombuffer(buf, ml_dtypes.bfloat16, n, offset).astype(np.float32)
            offset += 2 * n
        else:
            num_blocks = math.ceil(n / block_size)
            code_bytes = n if kind == "int8" else (n + 1) // 2
            if kind == "int8":
                codes = np.frombuffer(buf, np.int8, n, offset)
            else:
                codes = _unpack_int4(np.frombuffer(buf, np.uint8, code_bytes, offset), n)
            scale = np.frombuffer(buf, "<f4", num_blocks, offset + code_bytes).astype(np.float32)
            offset += code_bytes + 4 * num_blocks
            padded = np.zeros(num_blocks * block_size, np.float32)
            padded[:n] = codes
            values = (padded.reshape(num_blocks, block_size) * scale[:, None]).reshape(-1)[:n]
        out.append(values.reshape(shape))
    return jax.tree.unflatten(treedef, out)


def decode_and_apply(params: Any, payload: bytes, kind: str, block_size: int) -> Any:
    """The one host-side update rule: `params + decode(payload)` in float32, cast back.

    The coordinator (for its island view) and every island call this with the
    same bytes and the same parameters, so all of them hold identical bits.

    Args:
      params: pytree of NumPy-convertible arrays (any float dtype).
      payload: an update encoded for `params`' structure.

    Returns:
      A pytree of NumPy arrays with `params`' dtypes.

    Raises:
      CodecError: if the payload's size does not fit `params`.
    """
    delta = decode(payload, params, kind, block_size)
    return jax.tree.map(
        lambda p, d: (np.asarray(p, np.float32) + d).astype(np.asarray(p).dtype), params, delta
    )


def decode_view(payload: bytes, like: Any) -> Any:
    """Parameters sent whole as a float32 "none" payload, cast back to `like`'s dtypes (NumPy).

    Raises:
      CodecError: if the payload's size does not fit `like`.
    """
    values = decode(payload, like, "none", 1)
    return jax.tree.map(lambda v, p: v.astype(np.asarray(p).dtype), values, like)


def all_finite(tree: Any) -> bool:
    """True if every element of every leaf is finite."""
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))
