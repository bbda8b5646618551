"""The coordinator: float32 master parameters, the outer optimizer, the island view.

  handshake.py    the checks an island passes to join
  state.py        FragmentState: one fragment's master, outer optimizer state and view, in chunk rows
  contribution.py Contribution: one island's contribution to a round, as its chunks arrive
  partial_merge.py PartialMerge: a round's chunk-wise weighted merge and outer step; RoundRecord, what it logs
  quorum.py       RoundState, Quorum: when a round may close without the islands still missing
  fragment.py     FragmentCoordinator: one fragment's rounds (contributions, quorum, merge, update)
  coordinator.py  Coordinator: the run's coordinator, one FragmentCoordinator per fragment

What it raises and the ContributionHeader it reads live in `island_jax.protocol`, the seam both sides
speak (re-exported here). It knows no transport: the in-process transport and the gRPC service call the
plain methods of `Coordinator` and of its fragments.
"""

from island_jax.coordinator.coordinator import Coordinator
from island_jax.coordinator.fragment import FragmentCoordinator
from island_jax.coordinator.partial_merge import RoundRecord
from island_jax.protocol import ContributionError, ContributionHeader, HandshakeError, StaleRoundError, UpdateNotReady

__all__ = [
    "ContributionError",
    "ContributionHeader",
    "FragmentCoordinator",
    "Coordinator",
    "HandshakeError",
    "RoundRecord",
    "StaleRoundError",
    "UpdateNotReady",
]
