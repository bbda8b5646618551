"""The island <-> coordinator interface, and its in-process implementation.

An island sees three calls (the gRPC client implements the same ones):

  join(island, config_fingerprint, params_checksum, round) -> {"round", "checksum"}
  contribute(round, island, tokens, payload, params_checksum, step_seconds, fragment)
                                                     -> "accepted" | "discarded"
  fetch_update(round, island, fragment)              -> payload bytes
  fetch_view(island)                                 -> (round, the view as a float32 payload)
  planned_inner_steps(island)                        -> inner steps per round planned from measured
                                                        step times (after round 0's update), or None

`fragment` names the parameter group a payload encodes (Streaming DiLoCo,
`outer.fragments`; 0 for plain DiLoCo), and rounds are counted per fragment.
`config_fingerprint` is `config.fingerprint_fields(config)`, so a mismatch can be
named field by field; `params_checksum` is `params.checksum` of the island's
global parameters (at the start of the round, for `contribute`).

The in-process transport calls the coordinator directly, so notebooks and tests
run the same island, codec, merge and outer step as a multi-process launch.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from island_jax.comm.link import LinkEmulator
from island_jax.coordinator import Coordinator, FragmentedCoordinator, UpdateNotReady


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
        fragment: int = 0,
    ) -> str: ...

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes: ...

    def fetch_view(self, island: str) -> tuple[int, bytes]: ...

    def planned_inner_steps(self, island: str) -> int | None: ...


class IslandAborted(RuntimeError):
    """Another island of the same process failed; this one stops waiting for the merge."""


class InProcessTransport:
    """Transport that calls a coordinator in the same process.

    Payloads are passed as immutable bytes, so nothing is shared by reference
    that a real wire would copy. With `links` ({island: LinkEmulator}), each
    payload's chunks are booked on that island's emulated link (chunk k on
    connection k % `connections`) and the call returns when the last one would
    have arrived, so a notebook sees what the link costs.

    Islands may call from threads of their own (one per island, and the
    background exchanges of Streaming DiLoCo): the coordinator is called under
    one lock, and `fetch_update` waits (up to `timeout` seconds) until the
    fragment's round is merged.

    Args:
      coordinator: a `FragmentedCoordinator` (a single `Coordinator` is one fragment).
      links: {island: LinkEmulator} (None: no emulated link).
      connections: `comm.connections`.
      timeout: seconds `fetch_update` waits for a merge before raising `UpdateNotReady`.
    """

    def __init__(
        self,
        coordinator: FragmentedCoordinator | Coordinator,
        links: dict[str, LinkEmulator] | None = None,
        connections: int = 1,
        timeout: float = 3600.0,
    ):
        if not isinstance(coordinator, FragmentedCoordinator):
            coordinator = FragmentedCoordinator.wrap(coordinator)
        self.coordinator = coordinator
        self.links, self.connections, self.timeout = links or {}, connections, timeout
        self._changed = threading.Condition()
        self._aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Makes every waiting and later `fetch_update` raise `IslandAborted(reason)`."""
        with self._changed:
            self._aborted = reason
            self._changed.notify_all()

    def _carry(self, island: str, direction: str, fragment: int) -> None:
        link = self.links.get(island)
        if link is None:
            return
        now = link.clock()
        plan = self.coordinator.fragments[fragment].plan
        last = max((link.arrival(direction, c.index % self.connections, c.nbytes, now=now) for c in plan), default=now)
        link.sleep(max(0.0, last - link.clock()))

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        with self._changed:
            return self.coordinator.join(island, dict(config_fingerprint), params_checksum, round)

    def contribute(
        self,
        round: int,
        island: str,
        tokens: int,
        payload: bytes,
        params_checksum: str | None = None,
        step_seconds: float | None = None,
        fragment: int = 0,
    ) -> str:
        self._carry(island, "up", fragment)
        payload = bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else payload.tobytes()
        with self._changed:
            try:
                return self.coordinator.contribute(
                    round, island, tokens, payload, params_checksum, step_seconds, fragment=fragment
                )
            finally:
                self._changed.notify_all()

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while True:
                try:
                    update = bytes(self.coordinator.fetch_update(round, island, fragment))
                    break
                except UpdateNotReady:
                    if self._aborted is not None:
                        raise IslandAborted(self._aborted) from None
                    if time.monotonic() >= deadline:
                        raise
                    # a quorum's grace window closes the round only when polled
                    if self.coordinator.poll():
                        self._changed.notify_all()
                    else:
                        self._changed.wait(timeout=0.5)
        self._carry(island, "down", fragment)
        return update

    def fetch_view(self, island: str) -> tuple[int, bytes]:
        with self._changed:
            round, payload = self.coordinator.fetch_view()
        return round, bytes(payload)

    def planned_inner_steps(self, island: str) -> int | None:
        with self._changed:
            return self.coordinator.planned_inner_steps(island)
