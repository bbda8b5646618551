"""The island <-> coordinator interface, and its in-process implementation.

An island sees three calls (the gRPC client implements the same ones):

  join(island, config_fingerprint, initial_checksum) -> {"round", "checksum"}
  contribute(round, island, tokens, payload)         -> None
  fetch_update(round, island)                        -> payload bytes

The in-process transport calls the coordinator directly, so notebooks and tests
run the same island, codec, merge and outer step as a multi-process launch.
"""

from __future__ import annotations

from typing import Protocol

from island_jax.coordinator import Coordinator


class Transport(Protocol):
    """What an island needs from the path to the coordinator."""

    def join(self, island: str, config_fingerprint: str, initial_checksum: str) -> dict: ...

    def contribute(self, round: int, island: str, tokens: int, payload: bytes) -> None: ...

    def fetch_update(self, round: int, island: str) -> bytes: ...


class InProcessTransport:
    """Transport that calls a `Coordinator` in the same process.

    Payloads are passed as immutable bytes, so nothing is shared by reference
    that a real wire would copy.
    """

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    def join(self, island: str, config_fingerprint: str, initial_checksum: str) -> dict:
        return self.coordinator.join(island, config_fingerprint, initial_checksum)

    def contribute(self, round: int, island: str, tokens: int, payload: bytes) -> None:
        self.coordinator.contribute(round, island, tokens, bytes(payload))

    def fetch_update(self, round: int, island: str) -> bytes:
        return bytes(self.coordinator.fetch_update(round, island))
