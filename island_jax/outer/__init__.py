"""The outer loop's math both sides share, as pure functions on pytrees, rows and bytes.

  codec/         wire codecs: kinds, the chunk plan, the blockwise quantizer, encoder, decoder, top-k
  optimizer.py   the outer optimizer: SGD with Nesterov momentum, warmed up by round (optax)
  fragments.py   Streaming DiLoCo's fragments and their schedule
  inner_steps.py each island's inner steps per round (outer.sync)
  chunk_step.py  the coordinator's merge, outer step and update encoding for one chunk, in rows
  reference.py   DiLoCo's outer step over whole pytrees: the page the chunked path is tested against
"""
