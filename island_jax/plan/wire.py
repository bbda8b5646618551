"""The exchange's wire: each island's link, the bytes a codec puts on it, and the seconds they take.

A link carries min(Gbit/s, connections x one window per RTT) (`comm.link.steady_gbps`, the link emulator's
model); P bytes over r Gbit/s take P x 8 / (r x 1e9) seconds; a pipelined exchange overlaps its stages chunk
by chunk (`pipelined_seconds`). The equations: docs/planner.md#the-model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from island_jax.comm.link import steady_gbps
from island_jax.outer import codec as codec_lib

if TYPE_CHECKING:
    from island_jax.plan.compute import IslandSpec

SECONDS_PER_DAY = 86400.0
TOPOLOGIES = ("coordinator", "ring")  # values of OuterSpec.topology
GBPS_RANGE = (1e-6, 1e9)  # Gbit/s searched for a required rate


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One island's path to the coordinator.

    Attributes:
      gbps: rate each way, Gbit/s (`math.inf`: not a constraint).
      rtt_ms: round trip, ms.
      connections: parallel connections (gRPC channels) the exchange streams over.
      window_bytes: bytes in flight per connection, like a TCP window (0: no window).
    """

    gbps: float = 25.0
    rtt_ms: float = 0.0
    connections: int = 16
    window_bytes: int = 0

    def rate_gbps(self) -> float:
        """The steady rate its connections reach, Gbit/s (`comm.link.steady_gbps`)."""
        return steady_gbps(self.gbps, self.rtt_ms / 1e3, self.window_bytes, self.connections)


@dataclasses.dataclass(frozen=True)
class OuterSpec:
    """The outer loop and the exchange.

    Attributes:
      codec: `codec.kind` (none, bf16, int8, int4, topk); block_size: elements per scale.
      update_codec: `codec.update_kind`, the update's codec ("": `codec`'s).
      topk_group, topk_k: topk's group and values kept per group (`codec.topk_group`, `codec.topk_k`).
      bytes_per_param: bytes on the wire per parameter up (0: from the codec: int8 1 + 4 / block);
        update_bytes_per_param: down (0: from the update's codec, or `bytes_per_param` when it is the same).
        The coordinator's merge constants were measured for int8; other codecs use them as they are.
      sync: "steps" (each island's H), "auto" (H scaled by step time from the reference island's), "time".
      reference_island: under "auto", the island whose H is kept ("": the first).
      round_seconds: with sync "time", the wall-clock seconds of every round (the exchange's exposed
        seconds come out of its steps).
      fragments: F (Streaming DiLoCo); overlap_steps: tau, an int or "auto".
      pipeline: `comm.pipeline` (the update flows back while contributions arrive).
      chunk_bytes: `comm.chunk_bytes`, the largest chunk of a payload: a pipelined exchange
        overlaps its stages chunk by chunk (`pipelined_seconds`).
      shared_link: the islands share one link (each island's rate is divided among the K).
      fragment_overhead_seconds: training-thread seconds per fragment exchanged (its pseudo-gradient,
        the update's placement and mixing), added per fragment whatever tau hides.
      backward_overlap: steps (a fraction) that hide an exchange before tau's: 2/3 where the exchange
        starts with the backward pass of the step it follows, as the published simulators assume; 0 for
        island_jax, whose islands contribute after the step.
      topology: "coordinator" (island_jax: every island sends its payload up and takes the update down)
        or "ring" (an all-reduce among the islands, no coordinator: each moves 2 (K - 1) / K of the
        payload each way and waits 2 (K - 1) one-way latencies, as DiLoCo's papers and INTELLECT-1 do).
    """

    codec: str = "int8"
    block_size: int = 256
    bytes_per_param: float = 0.0
    update_codec: str = ""
    topk_group: int = 4096
    topk_k: int = 64
    update_bytes_per_param: float = 0.0
    sync: str = "steps"
    reference_island: str = ""
    round_seconds: float = 0.0
    fragments: int = 1
    overlap_steps: int | str = 0
    pipeline: bool = True
    chunk_bytes: int = 1 << 20
    shared_link: bool = False
    fragment_overhead_seconds: float = 0.0
    backward_overlap: float = 0.0
    topology: str = "coordinator"

    def _codec(self, kind: str) -> "codec_lib.Codec":
        return codec_lib.Codec(kind, self.block_size, self.topk_group, self.topk_k)

    def wire_bytes_per_param(self) -> float:
        """Bytes per parameter of a contribution (`bytes_per_param`, else the codec's for a long leaf)."""
        if self.bytes_per_param > 0:
            return self.bytes_per_param
        return codec_lib.bytes_per_element(self._codec(self.codec))

    def update_wire_bytes_per_param(self) -> float:
        """Bytes per parameter of an update (`update_bytes_per_param`, else the update codec's for a long leaf, or
        the contribution's when the two codecs are one)."""
        if self.update_bytes_per_param > 0:
            return self.update_bytes_per_param
        if self.update_codec in ("", self.codec):
            return self.wire_bytes_per_param()
        return codec_lib.bytes_per_element(self._codec(self.update_codec))

    @property
    def codecs(self) -> str:
        """The codecs both ways, e.g. "topk" or "topk up, int8 down"."""
        down = self.update_codec or self.codec
        return self.codec if down == self.codec else f"{self.codec} up, {down} down"


def pipelined_seconds(stages: Sequence[float], chunks: int) -> float:
    """Seconds for `chunks` equal chunks to pass stages that each take `stages[s]` seconds for the whole
    payload, one chunk per stage at a time: the slowest stage's whole time, plus the other stages' time for
    one chunk (the pipeline filling and draining). 1 chunk: the stages one after the other."""
    slowest = max(stages)
    return slowest + (sum(stages) - slowest) / max(chunks, 1)


def links_at(islands: Sequence[IslandSpec], gbps: float | None) -> list[LinkSpec]:
    """The islands' links, each at `gbps` when given."""
    return [i.link if gbps is None else dataclasses.replace(i.link, gbps=gbps) for i in islands]


def transfer_seconds(nbytes: float, gbps: float) -> float:
    """Seconds to move `nbytes` at `gbps` (0 at an unlimited rate)."""
    return nbytes * 8 / (gbps * 1e9) if math.isfinite(gbps) else 0.0


def required_gbps(utilization, target: float) -> float | None:
    """The lowest Gbit/s at which `utilization(gbps)` reaches `target`, by bisection in log rate: 0.0 where
    even the lowest rate searched (1e-6 Gbit/s) does, None where no rate does."""
    lo, hi = GBPS_RANGE
    if utilization(hi) < target:
        return None
    if utilization(lo) >= target:
        return 0.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if utilization(mid) < target else (lo, mid)
        if hi / lo < 1 + 1e-6:
            break
    return hi
