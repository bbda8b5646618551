"""Wire codecs for pseudo-gradients and updates: `encode` a pytree into bytes, `decode` them back.

  kinds.py    the kinds (none, bf16, int8, int4, topk), a direction's `Codec`, bytes per element
  chunks.py   the payload's pieces and the chunk plan both directions share
  blocks.py   the blockwise absmax quantizer of int8 and int4 (one rule for NumPy and jax.numpy)
  topk.py     SparseLoCo's top-k by groups (arXiv 2508.15706)
  encoder.py  `ChunkEncoder`: a payload built chunk by chunk, with error feedback
  decoder.py  `decode`, and `decode_and_apply`, the one host-side update rule

`from island_jax.outer import codec` then `codec.encode(tree, codec.Codec("int8"))`: every public name of the
modules above is here.
"""

from island_jax.outer.codec import topk
from island_jax.outer.codec.blocks import (
    dequantize,
    dequantize_blocks,
    pack_int4,
    quantize,
    quantize_array,
    quantize_blocks,
    unpack_int4,
)
from island_jax.outer.codec.chunks import Chunk, Piece, chunk_plan, chunk_ranges, deal, layout, payload_bytes, pieces
from island_jax.outer.codec.decoder import decode, decode_and_apply, decode_piece, decode_view
from island_jax.outer.codec.encoder import ChunkEncoder, encode
from island_jax.outer.codec.kinds import (
    KINDS,
    MAX_CODE,
    PIECE_BYTES,
    PIECE_ELEMENTS,
    QUANTIZED_KINDS,
    Codec,
    CodecError,
    as_codec,
    bytes_per_element,
    leaf_bytes,
    piece_elements,
    row_elements,
    update_kind,
)

__all__ = [
    "KINDS",
    "MAX_CODE",
    "PIECE_BYTES",
    "PIECE_ELEMENTS",
    "QUANTIZED_KINDS",
    "Chunk",
    "ChunkEncoder",
    "Codec",
    "CodecError",
    "Piece",
    "as_codec",
    "bytes_per_element",
    "chunk_plan",
    "chunk_ranges",
    "deal",
    "decode",
    "decode_and_apply",
    "decode_piece",
    "decode_view",
    "dequantize",
    "dequantize_blocks",
    "encode",
    "layout",
    "leaf_bytes",
    "pack_int4",
    "payload_bytes",
    "piece_elements",
    "pieces",
    "quantize",
    "quantize_array",
    "quantize_blocks",
    "row_elements",
    "topk",
    "unpack_int4",
    "update_kind",
]
