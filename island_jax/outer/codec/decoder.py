"""Decoding payloads, and the one host-side update rule every process applies (`decode_and_apply`).

Decoding runs in NumPy on the host, piece by piece (`chunks.pieces`): float32 values for none, bf16 widened to
float32, code x scale for int8 / int4 (`blocks.dequantize_blocks`), and top-k's kept values with zeros between.
The coordinator (for its island view) and every island add the same update bytes to the same parameters with
`decode_and_apply`, `params + decode(payload)` in float32 cast back to each leaf's dtype, so all of them hold
the same bits whatever their accelerator.
"""

from __future__ import annotations

import bisect
from typing import Any

import jax
import ml_dtypes
import numpy as np

from island_jax.outer.codec import topk
from island_jax.outer.codec.blocks import dequantize_blocks, unpack_int4
from island_jax.outer.codec.chunks import Piece, payload_bytes, pieces
from island_jax.outer.codec.kinds import Codec, CodecError, as_codec


def _check_payload(payload, like: Any, kind: "str | Codec", block_size: int | None) -> None:
    expected = payload_bytes(like, kind, block_size)
    if len(payload) != expected:
        raise CodecError(
            f"payload is {len(payload)} bytes but a {as_codec(kind, block_size)} payload for these parameters is {expected} bytes; "
            "the sender uses a different model shape, codec or block_size"
        )


def decode(payload: bytes, like: Any, kind: "str | Codec", block_size: int | None = None) -> Any:
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
    _check_payload(payload, like, kind, block_size)
    buf = memoryview(payload)
    leaves, treedef = jax.tree.flatten(like)
    out = [np.empty(int(np.prod(x.shape)), np.float32) for x in leaves]
    for piece in pieces(like, kind, block_size):
        out[piece.leaf][piece.start : piece.stop] = decode_piece(buf, piece, kind, block_size)
    out = [values.reshape(tuple(x.shape)) for values, x in zip(out, leaves)]
    return jax.tree.unflatten(treedef, out)


def decode_piece(buf, piece: Piece, kind: "str | Codec", block_size: int | None = None) -> np.ndarray:
    """The float32 values [piece.stop - piece.start] of one piece, read from `buf` at `piece.offset`."""
    fmt = as_codec(kind, block_size)
    kind, block_size = fmt.kind, fmt.block_size
    n, offset = piece.stop - piece.start, piece.offset
    if kind == "topk":
        out = np.zeros(n, np.float32)
        positions, values = topk.decode_sparse(buf, n, fmt.topk_group, fmt.topk_k, offset)
        out[positions] = values
        return out
    if kind == "none":
        return np.frombuffer(buf, "<f4", n, offset).astype(np.float32)
    if kind == "bf16":
        return np.frombuffer(buf, ml_dtypes.bfloat16, n, offset).astype(np.float32)
    num_blocks = -(-n // block_size)
    code_bytes = n if kind == "int8" else (n + 1) // 2
    if kind == "int8":
        codes = np.frombuffer(buf, np.int8, n, offset)
    else:
        codes = unpack_int4(np.frombuffer(buf, np.uint8, code_bytes, offset), n)
    scale = np.frombuffer(buf, "<f4", num_blocks, offset + code_bytes).astype(np.float32)
    return dequantize_blocks(codes, scale, block_size)


def decode_and_apply(params: Any, payload: bytes, kind: "str | Codec", block_size: int | None = None,
                     out: Any = None) -> Any:
    """The one host-side update rule: `params + decode(payload)` in float32, cast back.

    The coordinator (for its island view) and every island call this with the
    same bytes and the same parameters, so all of them hold identical bits.

    Args:
      params: pytree of NumPy-convertible arrays (any float dtype).
      payload: an update encoded for `params`' structure.
      kind, block_size: as given to `encode`.
      out: a pytree like `params` of writable, C-contiguous float32 NumPy arrays of its shapes (`params` itself
        may be it, when float32) that receive the sums, so that a caller applying update after update reuses
        its buffers instead of touching fresh pages each time; default: new arrays. No two of its leaves may
        share memory, nor one of them with another leaf of `params`. Into `params` itself, a payload that
        fails to decode part way leaves `params` part updated.

    Returns:
      A pytree of NumPy arrays with `params`' dtypes (with `out` of float32 `params`, `out`'s own arrays).

    Raises:
      CodecError: if the payload's size does not fit `params`.
      ValueError: `out` of another structure, a leaf of it not a writable, C-contiguous float32 array of its
        leaf's shape, or leaves that share memory as above.
    """
    _check_payload(payload, params, kind, block_size)
    leaves, treedef = jax.tree.flatten(params)
    given = None
    if out is None:
        out = [np.array(p, np.float32, copy=True).reshape(-1) for p in leaves]
    else:
        given, out_def = jax.tree.flatten(out)
        out = _out_leaves(given, out_def, treedef, leaves)
        for o, g, p in zip(out, given, leaves):
            if g is not p:  # params' values first, unless out is params itself
                np.copyto(o, np.asarray(p).reshape(-1), casting="same_kind")
    buf = memoryview(payload)
    for piece in pieces(params, kind, block_size):
        flat = out[piece.leaf][piece.start : piece.stop]
        np.add(flat, decode_piece(buf, piece, kind, block_size), out=flat)
    shaped = given or [x.reshape(np.shape(p)) for x, p in zip(out, leaves)]
    return jax.tree.unflatten(treedef, [x.astype(np.asarray(p).dtype, copy=False) for x, p in zip(shaped, leaves)])


def _out_leaves(out_leaves: list, out_def, treedef, leaves: list) -> list[np.ndarray]:
    """`decode_and_apply`'s `out` (its leaves and structure) as flat float32 views, checked against `params`'
    leaves (ValueError)."""
    if out_def != treedef:
        raise ValueError(f"decode_and_apply: out has the structure {out_def}, params {treedef}; pass a pytree like params")
    flat = []
    for o, p in zip(out_leaves, leaves):
        if not (isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == np.shape(p)
                and o.flags.c_contiguous and o.flags.writeable):
            raise ValueError(
                f"decode_and_apply: an out leaf is {type(o).__name__} {getattr(o, 'dtype', '')} "
                f"{getattr(o, 'shape', '')}; each must be a writable, C-contiguous float32 NumPy array of its "
                f"parameter's shape {np.shape(p)}"
            )
        flat.append(o.reshape(-1))
    spans = sorted((_span(o), k) for k, o in enumerate(out_leaves))
    for (a, k), (b, j) in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise ValueError(f"decode_and_apply: out's leaves {k} and {j} share memory; give each its own array")
    starts = [span[0] for span, _ in spans]
    for j, p in enumerate(leaves):
        if isinstance(p, np.ndarray) and p is not out_leaves[j] and p.nbytes:
            lo, hi = _span(p)
            at = bisect.bisect_right(starts, hi - 1) - 1  # the last out leaf starting before p ends
            while at >= 0 and spans[at][0][1] > lo:  # out leaves are disjoint: those reaching into p come last
                if spans[at][1] != j:
                    raise ValueError(f"decode_and_apply: out's leaf {spans[at][1]} shares memory with params' "
                                     f"leaf {j}; give out arrays of its own, or params itself")
                at -= 1
    return flat


def _span(a: np.ndarray) -> tuple[int, int]:
    """The bytes [start, end) of a C-contiguous array's memory, as addresses."""
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def decode_view(payload: bytes, like: Any) -> Any:
    """Parameters sent whole as a float32 "none" payload, cast back to `like`'s dtypes (NumPy).

    Raises:
      CodecError: if the payload's size does not fit `like`.
    """
    values = decode(payload, like, "none", 1)
    return jax.tree.map(lambda v, p: v.astype(np.asarray(p).dtype), values, like)
