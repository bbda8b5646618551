"""The codec kinds, a direction's wire format (`Codec`), and the bytes each kind costs.

  none  float32 little-endian: 4 bytes per element.
  bf16  bfloat16: 2 bytes per element.
  int8  blockwise absmax codes in [-127, 127] and one float32 scale per `block_size` elements (`blocks.py`):
        n + 4 * ceil(n / block_size) bytes for a leaf of n elements.
  int4  the same with codes in [-7, 7], two a byte: ceil(n / 2) + 4 * ceil(n / block_size) bytes.
  topk  SparseLoCo's top-k (arXiv 2508.15706, `topk.py`): 116 bytes per full group of 4096 with k = 64.

A leaf longer than a piece (`piece_elements`: about 64 KiB of codes or values, `PIECE_BYTES`) is encoded as
consecutive pieces, each a whole number of blocks or top-k groups, so these sizes hold piece by piece too.
A `Codec` names one direction's kind and its parameters (`Codec.of(config.codec)` for contributions,
`Codec.of(config.codec, update=True)` for the coordinator's update); when the two directions differ, each is
`paired` with the other, so that both payloads' pieces start at the same elements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from island_jax.config import CODEC_KINDS as KINDS  # every codec kind (`codec.kind` in the config)
from island_jax.config import update_kind
from island_jax.outer.codec import topk

MAX_CODE = {"int8": 127, "int4": 7}  # the blockwise kinds: largest code magnitude (scale = absmax / MAX_CODE)
QUANTIZED_KINDS = tuple(MAX_CODE)  # kinds sent as codes and float32 scales
PIECE_BYTES = 1 << 16  # a full piece carries about this many bytes of codes or values
PIECE_ELEMENTS = {"none": PIECE_BYTES // 4, "bf16": PIECE_BYTES // 2, "int8": PIECE_BYTES, "int4": 2 * PIECE_BYTES}


class CodecError(ValueError):
    """A payload does not match what the codec expects (size, kind)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise CodecError(f"unknown codec kind {kind!r}; choose one of {KINDS}")


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise CodecError(f"block_size is {block_size}; it must be a positive number of elements")


@dataclasses.dataclass(frozen=True)
class Codec:
    """One direction's wire format: a kind and its parameters.

    Attributes:
      kind: one of `KINDS`.
      block_size: elements per float32 scale of int8 / int4 (and the coordinator's row width for none / bf16).
      topk_group, topk_k: topk's group length and values kept per group (elements).
      piece: elements of a full piece where the other direction's codec differs (`paired`): the pieces of both
        directions' payloads then start at the same elements; 0: the kind's own (`piece_elements`).

    Raises:
      CodecError: an unknown kind, or a size below 1.
    """

    kind: str
    block_size: int = 256
    topk_group: int = 4096
    topk_k: int = 64
    piece: int = 0

    def __post_init__(self):
        _check_kind(self.kind)
        _check_block_size(self.block_size)
        if self.topk_group < 1 or self.topk_k < 1:
            raise CodecError(f"topk group {self.topk_group} and k {self.topk_k}: both must be at least 1")

    @classmethod
    def of(cls, config: Any, update: bool = False) -> "Codec":
        """The contribution's codec of a config's `codec` section, or with `update` the update's
        (`codec.update_kind`, "" for the contribution's kind), each `paired` with the other."""
        group, k = config.get("topk_group", 4096), config.get("topk_k", 64)
        up, down = cls(config.kind, config.block_size, group, k), cls(update_kind(config), config.block_size, group, k)
        return down.paired(up) if update else up.paired(down)

    def own(self) -> "Codec":
        """This codec with its own pieces (unpaired)."""
        return dataclasses.replace(self, piece=0) if self.piece else self

    def paired(self, other: "Codec") -> "Codec":
        """This codec cut into the pieces it shares with `other`, the other direction's codec
        (`piece_elements(self, other=other)`); itself, with its own pieces, when the two are one codec."""
        mine, theirs = self.own(), other.own()
        if mine == theirs:
            return mine
        return dataclasses.replace(mine, piece=piece_elements(mine, other=theirs))

    @property
    def unit(self) -> int:
        """Elements a piece holds a whole number of: a block (an even count for int4), a top-k group, or 1."""
        if self.kind == "topk":
            return self.topk_group
        if self.kind in MAX_CODE:
            return self.block_size * 2 if self.kind == "int4" and self.block_size % 2 else self.block_size
        return 1

    @property
    def row_unit(self) -> int:
        """Elements the coordinator's rows (`chunk_step`) hold a whole number of: a top-k group, or a block."""
        return self.topk_group if self.kind == "topk" else self.block_size

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk (group {self.topk_group}, k {self.topk_k})"
        return f"{self.kind} (block {self.block_size})" if self.kind in MAX_CODE else self.kind


def as_codec(kind: "str | Codec", block_size: int | None = None) -> Codec:
    """`kind` itself when it is a `Codec`; else the `Codec` of that kind's name and `block_size` (topk with its
    default group and k).

    Raises:
      CodecError: an unknown kind or a block_size <= 0.
    """
    if isinstance(kind, Codec):
        return kind
    _check_kind(kind)
    return Codec(kind, 256 if block_size is None else block_size)


def leaf_bytes(size: int, kind: "str | Codec", block_size: int | None = None) -> int:
    """Bytes on the wire for one leaf (or piece) of `size` elements.

    Raises:
      CodecError: an unknown kind.
    """
    fmt = as_codec(kind, block_size)
    kind, block_size = fmt.kind, fmt.block_size
    if kind == "none":
        return 4 * size
    if kind == "bf16":
        return 2 * size
    if kind == "topk":
        return topk.leaf_bytes(size, fmt.topk_group, fmt.topk_k)
    code_bytes = size if kind == "int8" else (size + 1) // 2
    return code_bytes + 4 * math.ceil(size / block_size)


def piece_elements(kind: "str | Codec", block_size: int | None = None, other: "Codec | None" = None) -> int:
    """Elements of a full piece: about 64 KiB of codes or values, in whole blocks (for int4 an even count) or
    top-k groups; a paired codec's `piece`. With the other direction's codec `other`, when it differs, the
    smaller of the two pieces in whole units (`Codec.unit`) of both."""
    fmt = as_codec(kind, block_size)
    if other is not None and other.own() != fmt.own():
        mine, theirs = fmt.own(), other.own()
        unit = math.lcm(mine.unit, theirs.unit)
        return max(1, min(piece_elements(mine), piece_elements(theirs)) // unit) * unit
    if fmt.piece:
        return fmt.piece
    if fmt.kind == "topk":
        groups = PIECE_BYTES // topk.group_bytes(fmt.topk_group, fmt.topk_group, fmt.topk_k)
        return max(1, groups) * fmt.topk_group
    if fmt.kind not in MAX_CODE:
        return PIECE_ELEMENTS[fmt.kind]
    n = max(1, PIECE_ELEMENTS[fmt.kind] // fmt.block_size) * fmt.block_size
    return 2 * n if fmt.kind == "int4" and n % 2 else n


def bytes_per_element(fmt: Codec) -> float:
    """Bytes per parameter of a long leaf in `fmt`, scales included (int8 with blocks of 256: 1 + 4 / 256; topk
    with groups of 4096 and k = 64: 116 / 4096)."""
    n = math.lcm(fmt.unit, 2 * fmt.block_size) * 1024  # whole blocks, groups and bytes: the codec's rate exactly
    return leaf_bytes(n, fmt) / n


def row_elements(fmt: Codec, other: "Codec | None" = None) -> int:
    """Elements of one of the coordinator's rows (`chunk_step`) for a contribution codec `fmt` and update codec
    `other`: a whole number of both's `row_unit`s."""
    return fmt.row_unit if other is None else math.lcm(fmt.row_unit, other.row_unit)
