"""The coordinator: float32 master parameters, the outer optimizer, the island view.

  handshake.py    the checks an island passes to join
  state.py        FragmentState: one fragment's master, outer optimizer state and view, in chunk rows
  merge.py        Coordinator: one fragment's rounds (contributions, quorum, chunk-wise merge, update)
  coordinator.py  FragmentedCoordinator: the run's coordinator, one Coordinator per fragment

What it raises and the ContributionHeader it reads live in `island_jax.protocol`, the seam both sides
speak (re-exported here). It knows no transport: the in-process transport and the gRPC service call the
plain methods of `FragmentedCoordinator` and of its fragments.
"""

from island_jax.coordinator.coordinator import FragmentedCoordinator
from island_jax.coordinator.merge import Coordinator, RoundRecord
from island_jax.protocol import ContributionError, ContributionHeader, HandshakeError, StaleRoundError, UpdateNotReady

__all__ = [
    "ContributionError",
    "ContributionHeader",
    "Coordinator",
    "FragmentedCoordinator",
    "HandshakeError",
    "RoundRecord",
    "StaleRoundError",
    "UpdateNotReady",
]
