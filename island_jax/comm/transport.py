"""The island <-> coordinator interface, and its in-process implementation.

An island sees three calls (the gRPC client implements the same ones):

  join(island, config_fingerprint, params_checksum, round) -> {"round", "checksum"}
  contribute(round, island, tokens, payload, params_checksum) -> "accepted" | "discarded"
  fetch_update(round, island)                        -> payload bytes
  fetch_view(island)                                 -> (round, the view as a float32 payload)
  planned_inner_steps(island)                        -> inner steps per round planned from measured
                                                        step times (after round 0's update), or None

`config_fingerprint` is `config.fingerprint_fields(config)`, so a mismatch can be
named field by field; `params_checksum` is `params.checksum` of the island's
global parameters (at the start of the round, for `contribute`).

The in-process transport calls the coordinator directly, so notebooks and tests
run the same island, codec, merge and outer step as a multi-process launch.
"""

from __future__ import annotations

from typing import Protocol

from island_jax.comm.link import LinkEmulator
from island_jax.coordinator import Coordinator


class Transport(Protocol):
    """What an island needs from the path to the coordinator."""

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict: ...

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str: ...

    def fetch_update(self, round: int, island: str) -> bytes: ...

    def fetch_view(self, island: str) -> tuple[int, bytes]: ...

    def planned_inner_steps(self, island: str) -> int | None: ...


class InProcessTransport:
    """Transport that calls a `Coordinator` in the same process.

    Payloads are passed as immutable bytes, so nothing is shared by reference
    that a real wire would copy. With `links` ({island: LinkEmulator}), each
    payload's chunks are booked on that island's emulated link (chunk k on
    connection k % `connections`) and the call returns when the last one would
    have arrived, so a notebook sees what the link costs.
    """

    def __init__(self, coordinator: Coordinator, links: dict[str, LinkEmulator] | None = None, connections: int = 1):
        self.coordinator = coordinator
        self.links, self.connections = links or {}, connections

    def _carry(self, island: str, direction: str) -> None:
        link = self.links.get(island)
        if link is None:
            return
        now = link.clock()
        plan = self.coordinator.plan
        last = max((link.arrival(direction, c.index % self.connections, c.nbytes, now=now) for c in plan), default=now)
        link.sleep(max(0.0, last - link.clock()))

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        return self.coordinator.join(island, dict(config_fingerprint), params_checksum, round)

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
    ) -> str:
        self._carry(island, "up")
        payload = bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else payload.tobytes()
        return self.coordinator.contribute(round, island, tokens, payload, params_checksum, step_seconds)

    def fetch_update(self, round: int, island: str) -> bytes:
        update = bytes(self.coordinator.fetch_update(round, island))
        self._carry(island, "down")
        return update

    def fetch_view(self, island: str) -> tuple[int, bytes]:
        round, payload = self.coordinator.fetch_view()
        return round, bytes(payload)

    def planned_inner_steps(self, island: str) -> int | None:
        return self.coordinator.planned_inner_steps(island)
