"""One island's contribution to a fragment's round on the coordinator, held as its chunks arrive.

A contribution is the island's encoded pseudo-gradient (DiLoCo, arXiv 2311.08105) and the tokens it trained
on; it arrives as the chunks of the fragment's plan (`codec.chunk_plan`), in any order, each decoded to rows
as it comes, and is complete once every chunk is in and its stream ended well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from island_jax.protocol import ContributionError


@dataclass
class Contribution:
    """One island's contribution to the current round, as its chunks arrive.

    `chunks` maps a chunk index to its rows (`chunk_step.wire_to_rows`): values
    (codes) [R * W] and scales float32, or for topk its kept values and their positions (`FragmentState.decode`).
    """

    island: str
    tokens: int
    chunks: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    ended: bool = False  # its stream(s) ended well (`end_contribution`): nothing after its chunks was refused
    everywhere: bool = True  # on the leader of coordinator shards: complete on every other shard too
    tau: int | None = None  # the island's tau for this contribution when chosen by measurement (overlap "auto")
    digests: dict[int, str] = field(default_factory=dict)  # chunk index -> SHA-256 of its bytes (kept updates on)
    routed: np.ndarray | None = None  # int64 [MoE layers, experts]: its routed counts (`expert_merge`), None: not sent
    unrouted: int = 0  # of its tokens, those no router saw (padding), which `routed` does not cover
    probe: np.ndarray | None = None  # int64 [MoE layers, tokens, k]: its top-k choices on the routing probe
    post_sync: float | None = None  # its loss change over the first step after the previous update

    def has_chunks(self, num_chunks: int) -> bool:
        return len(self.chunks) == num_chunks

    def received(self, num_chunks: int) -> bool:
        """Every chunk is in and the contribution was closed (here: of a coordinator shard, its range's)."""
        return self.ended and self.has_chunks(num_chunks)

    def complete(self, num_chunks: int) -> bool:
        """`received`, and of the leader of coordinator shards on every shard: it may be merged into a finished
        round (the quorum counts it)."""
        return self.everywhere and self.received(num_chunks)

    def check_chunk(self, round: int, index: int, nbytes: int, plan: list) -> None:
        """Raises ContributionError for an index the plan lacks or this contribution has, or a size off the plan."""
        if not 0 <= index < len(plan) or index in self.chunks:
            raise ContributionError(
                f"island {self.island!r}, round {round}: chunk {index} is unknown or repeated ({len(plan)} chunks)"
            )
        if nbytes != plan[index].nbytes:
            raise ContributionError(
                f"island {self.island!r}, round {round}: chunk {index} is {nbytes} bytes, expected "
                f"{plan[index].nbytes}; the island's comm.chunk_bytes, model or codec differs"
            )
