"""The coordinator: float32 master parameters, the outer optimizer, the island view.

  errors.py       what it raises (HandshakeError, ContributionError, StaleRoundError, UpdateNotReady)
  contribution.py ContributionHeader: what travels with an island's encoded pseudo-gradient
  handshake.py    the checks an island passes to join
  state.py        FragmentState: one fragment's master, outer optimizer state and view, in chunk rows
  merge.py        Coordinator: one fragment's rounds (contributions, quorum, chunk-wise merge, update)
  coordinator.py  FragmentedCoordinator: the run's coordinator, one Coordinator per fragment

It knows no transport: the in-process transport and the gRPC service call the
plain methods of `FragmentedCoordinator` and of its fragments.
"""

from island_jax.coordinator.contribution import ContributionHeader
from island_jax.coordinator.coordinator import FragmentedCoordinator
from island_jax.coordinator.errors import ContributionError, HandshakeError, StaleRoundError, UpdateNotReady
from island_jax.coordinator.merge import Coordinator, RoundRecord

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
