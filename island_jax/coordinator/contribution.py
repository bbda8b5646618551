"""`ContributionHeader`: what travels with one island's encoded pseudo-gradient, on every transport."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContributionHeader:
    """One island's contribution to one round of one fragment, less its payload (DiLoCo, arXiv 2311.08105,
    Algorithm 1: the pseudo-gradient an island sends after its inner steps, weighted by its tokens).

    Attributes:
      round: the fragment's round the pseudo-gradient belongs to (0-based).
      island: the contributing island's name (a key of `config.islands`).
      tokens: tokens the island processed since its last contribution (> 0): its merge weight.
      params_checksum: `model.init.checksum` (16 hex digits) of the island's anchor of the fragment, which
        must equal the coordinator's view: proof that every island trained from the same bits (None: not
        checked).
      step_seconds: the island's median inner-step time (seconds), which plans later rounds under
        `outer.auto_from = "measured"` (None: not measured).
      fragment: the fragment the payload encodes (Streaming DiLoCo, arXiv 2501.18512; 0 with one fragment).
    """

    round: int
    island: str
    tokens: int
    params_checksum: str | None = None
    step_seconds: float | None = None
    fragment: int = 0
