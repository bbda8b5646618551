"""A coordinator of several processes: who owns which chunks, and how the shards agree on each round.

With `coordinator.shards = K > 1` the coordinator is K processes ("shards"). Each fragment's chunk plan is cut
into K contiguous ranges of near-equal bytes (`codec.chunk_ranges`); shard k holds the master, outer optimizer
state and island view of range k of every fragment, merges them, runs the outer step, encodes the update and
checkpoints them. The outer step is elementwise and the per-chunk program is the one of a single coordinator
(same padded rows), so every bit is the same as with one process.

The shards agree through a key-value store (`Bus`): in one process a dict (`LocalBus`, tests and notebooks);
across processes the coordination service of the shards' `jax.distributed` job (`ServiceBus`), the engine a
multi-process island already uses. Per fragment and round:

  every shard   publishes each island whose contribution is complete on it ("complete"), or refused ("refused")
  shard 0       closes the round by the quorum on the islands complete on every shard, publishes the set ("set")
  every shard   merges exactly that set (none merges a chunk before it holds it), then publishes its part of
                the view's checksum ("parts", `model.init.checksum_parts`) and of the round's statistics ("stats")

and per checkpoint round R: each shard publishes "saved/R/k" once its part is durable; shard 0 writes the
commit marker (`COMMITTED`) once all K are, and publishes "committed/R".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from typing import Any, Protocol

import ml_collections

from island_jax.outer import codec


class ShardError(ValueError):
    """A shard's settings disagree: its index, the shard count or the address list (named in the message)."""


def parse_addresses(text: str) -> list[str]:
    """"HOST:PORT,HOST:PORT,..." as a list (empty items dropped)."""
    return [a.strip() for a in text.split(",") if a.strip()]


def shard_address(config: ml_collections.ConfigDict, addresses: str, shard: int) -> str:
    """The address shard `shard` listens on: item `shard` of the --coordinator list `addresses`.

    Raises:
      ShardError: the list's length is not `coordinator.shards`, or `shard` is not below it.
    """
    shards = config.coordinator.shards if "coordinator" in config else 1
    listed = parse_addresses(addresses)
    if len(listed) != shards:
        raise ShardError(
            f"--coordinator lists {len(listed)} addresses ({addresses}) but coordinator.shards is {shards}; give one "
            "HOST:PORT per shard, shard 0 first, or set coordinator.shards to the list's length")
    if not 0 <= shard < shards:
        raise ShardError(f"--shard={shard} but coordinator.shards is {shards}; give a shard from 0 to {shards - 1}")
    return listed[shard]


class Bus(Protocol):
    """The shards' key-value store: values are strings, each key is set once."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None: ...

    def wait(self, key: str, timeout: float) -> str: ...

    def listing(self, prefix: str) -> dict[str, str]: ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...


class LocalBus:
    """The `Bus` of K shards in one process: a dict under a condition variable."""

    def __init__(self):
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str) -> str | None:
        with self._changed:
            return self._values.get(key)

    def wait(self, key: str, timeout: float) -> str:
        """The value of `key` once set. Raises TimeoutError after `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout):
                raise TimeoutError(f"no coordinator shard set {key} within {timeout:g} s")
            return self._values[key]

    def listing(self, prefix: str) -> dict[str, str]:
        with self._changed:
            return {k: v for k, v in self._values.items() if k.startswith(prefix)}

    def delete(self, key: str) -> None:
        """Deletes `key` and every key under `key/`."""
        with self._changed:
            for k in [k for k in self._values if k == key or k.startswith(key + "/")]:
                del self._values[k]

    def close(self) -> None:
        """Nothing to leave: the shards of one process share the dict."""


class ServiceBus:
    """The `Bus` of K shard processes: the key-value store of the coordination service that `jax.distributed`
    runs for a job (XLA's, with heartbeats: a process whose peer died ends with an error), started by shard 0.

    jax 0.10.2 reaches the service only through `jax._src` (`jax.distributed.initialize` would also make the
    shards one JAX job, whose processes orbax would then checkpoint as one: from process 0 alone), so this class
    starts the service and its clients itself, as `jax._src.distributed.State.initialize` does, and nothing
    else of jax's knows of them.

    The store has no credentials of its own. With `secret` (the run's tokens file: one credential set), every
    value carries an HMAC-SHA256 of its key and itself, and a value without the right one is refused, so that a
    process without the run's credentials that reaches the port cannot forge a contributor set or a commit.

    Args:
      address: HOST:PORT of the service (shard 0 listens on every address at its port).
      count, index: K and this shard.
      timeouts: `config.distributed` (initialization, heartbeat and shutdown seconds).
      secret: the key values are signed with (None: unsigned).
    """

    def __init__(self, address: str, count: int, index: int, timeouts, secret: bytes | None = None):
        from jax._src.lib import _jax

        self._secret = secret
        self._service = None
        if index == 0:
            self._service = _jax.get_distributed_runtime_service(
                "[::]:" + address.rsplit(":", 1)[1], count,
                heartbeat_timeout=int(timeouts.heartbeat_timeout_seconds),
                shutdown_timeout=int(timeouts.shutdown_timeout_seconds))
        self._client = _jax.get_distributed_runtime_client(
            address, index, init_timeout=int(timeouts.initialization_timeout_seconds), use_compression=True,
            heartbeat_timeout=int(timeouts.heartbeat_timeout_seconds))
        self._client.connect()

    def close(self) -> None:
        """Leaves the service at the end of the run (a barrier of every shard), and stops it on shard 0."""
        self._client.shutdown()
        if self._service is not None:
            self._service.shutdown()

    def _sign(self, key: str, value: str) -> str:
        if self._secret is None:
            return value
        return hmac.new(self._secret, f"{key}\n{value}".encode(), hashlib.sha256).hexdigest() + value

    def _open(self, key: str, signed: str) -> str:
        """`signed`'s value, once its HMAC is checked. Raises ShardError for a value not signed with the secret."""
        if self._secret is None:
            return signed
        mac, value = signed[:64], signed[64:]
        if not hmac.compare_digest(mac, self._sign(key, value)[:64]):
            raise ShardError(f"the shards' coordination service holds {key} without this run's signature: another "
                             "process reached its port, or the shards were started with different comm.auth.tokens_file; "
                             "keep --shard_service inside the cluster and give every shard the same tokens file")
        return value

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, self._sign(key, value), allow_overwrite=True)

    def get(self, key: str) -> str | None:
        try:
            signed = self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND comes as the runtime's error type
            return None
        return self._open(key, signed)

    def wait(self, key: str, timeout: float) -> str:
        """The value of `key` once set, asked for a second at a time (so that the process still takes signals:
        a stop while a peer is gone). Raises TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                signed = self._client.blocking_key_value_get(key, max(1, int(min(left, 1.0) * 1000)))
                return self._open(key, signed)
            except ShardError:
                raise
            except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED comes as the runtime's error type
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no coordinator shard set {key} within {timeout:g} s ({e})") from None

    def listing(self, prefix: str) -> dict[str, str]:
        return {k: self._open(k, v) for k, v in self._client.key_value_dir_get(prefix.rstrip("/"))}

    def delete(self, key: str) -> None:
        """Deletes `key` and every key under `key/`."""
        self._client.key_value_delete(key)


class Shard:
    """One shard of a coordinator of `count`: its index, its `Bus`, and the agreement on each round.

    Args:
      index: k, 0..count - 1 (0 leads: it closes each round's quorum and commits checkpoints).
      count: K, `coordinator.shards`.
      bus: the shards' `Bus`.
      timeout: seconds to wait for another shard's part of a round (`comm.round_timeout_seconds`).
    """

    def __init__(self, index: int, count: int, bus: Bus, timeout: float = 3600.0):
        self.index, self.count, self.bus, self.timeout = index, count, bus, timeout

    @property
    def leader(self) -> bool:
        return self.index == 0

    def owned(self, plan: list[codec.Chunk]) -> range:
        """The chunk indices of `plan` this shard owns (`codec.chunk_ranges`)."""
        return codec.chunk_ranges(plan, self.count)[self.index]

    def check_settings(self, settings: dict[str, Any], timeout: float) -> None:
        """Compares this shard's `settings` ({setting: value}, e.g. `coordinator.shards` and the `--coordinator`
        list) with shard 0's, before serving.

        Raises:
          ShardError: a setting that differs, named with both values.
          TimeoutError: shard 0 published none within `timeout` seconds.
        """
        self.bus.set(f"ij/settings/{self.index}", json.dumps(settings))
        leader = json.loads(self.bus.wait("ij/settings/0", timeout))
        differ = [f"{k} is {settings.get(k)!r} here but {leader.get(k)!r} on shard 0" for k in sorted(set(settings) | set(leader))
                  if settings.get(k) != leader.get(k)]
        if differ:
            raise ShardError(f"shard {self.index} disagrees with shard 0: {'; '.join(differ)}; start every shard with "
                             "the same config and --coordinator list")

    # -- a round's contributor set ---------------------------------------------------------------------

    def completed(self, fragment: int, round: int, island: str) -> None:
        """Says `island`'s contribution to the round is complete on this shard."""
        self.bus.set(f"ij/complete/{fragment}/{round}/{island}/{self.index}", "1")

    def refused(self, fragment: int, round: int, island: str) -> None:
        """Says this shard refused `island`'s contribution to the round (NaN, ...): it is out on every shard."""
        self.bus.set(f"ij/refused/{fragment}/{round}/{island}/{self.index}", "1")

    def others_complete(self, fragment: int, round: int) -> tuple[set[str], set[str]]:
        """(islands complete on every other shard, islands some shard refused) of the round."""
        complete = self.bus.listing(f"ij/complete/{fragment}/{round}/")
        seen: dict[str, set[int]] = {}
        for key in complete:
            island, shard = key.rsplit("/", 2)[-2:]
            seen.setdefault(island, set()).add(int(shard))
        others = set(range(self.count)) - {self.index}
        refused = {key.rsplit("/", 2)[-2] for key in self.bus.listing(f"ij/refused/{fragment}/{round}/")}
        return {n for n, on in seen.items() if others <= on}, refused

    def decide(self, fragment: int, round: int, contributors: list[str]) -> None:
        """The leader's contributor set of the round, for every shard to merge."""
        self.bus.set(f"ij/set/{fragment}/{round}", json.dumps(contributors))

    def decided(self, fragment: int, round: int) -> list[str] | None:
        """The leader's contributor set of the round, or None before it closed."""
        value = self.bus.get(f"ij/set/{fragment}/{round}")
        return None if value is None else json.loads(value)

    # -- what a merged round leaves ----------------------------------------------------------------------

    def merged(self, fragment: int, round: int, parts: dict, stats: dict) -> None:
        """Publishes this shard's `model.init.checksum_parts` of its view after `round` rounds of the fragment, and
        its partial statistics of the round that led there (None for the view a shard starts from)."""
        self.bus.set(f"ij/parts/{fragment}/{round}/{self.index}", json.dumps(parts))
        if stats is not None:
            self.bus.set(f"ij/stats/{fragment}/{round}/{self.index}", json.dumps(stats))
        if round >= 3:  # what no shard asks for any more (none is a round ahead of the leader's set)
            for what in ("complete", "refused", "parts", "stats", "set"):
                self.bus.delete(f"ij/{what}/{fragment}/{round - 3}")

    def gather(self, what: str, fragment: int, round: int) -> list[dict]:
        """Every shard's "parts" or "stats" of the fragment's round, in shard order (waits for them).

        Raises:
          TimeoutError: a shard published nothing within `timeout` seconds.
        """
        return [json.loads(self.bus.wait(f"ij/{what}/{fragment}/{round}/{k}", self.timeout)) for k in range(self.count)]

    # -- checkpoints -------------------------------------------------------------------------------------

    def saved(self, round: int) -> None:
        """Says this shard's checkpoint of `round` is durable."""
        self.bus.set(f"ij/saved/{round}/{self.index}", "1")

    def skipped(self, round: int) -> None:
        """Says this shard took no checkpoint of `round` (a fragment moved on first): the set is not committed."""
        self.bus.set(f"ij/skipped/{round}/{self.index}", "1")

    def any_skipped(self, round: int) -> bool:
        return bool(self.bus.listing(f"ij/skipped/{round}/"))

    def all_saved(self, round: int) -> bool:
        return len(self.bus.listing(f"ij/saved/{round}/")) >= self.count

    def committed(self, round: int) -> None:
        self.bus.set(f"ij/committed/{round}", "1")

    def is_committed(self, round: int) -> bool:
        return self.bus.get(f"ij/committed/{round}") is not None

    def agree_on_restore(self, mine: list[int], timeout: float) -> int | None:
        """The newest round every shard can restore (`mine`: this shard's committed, intact rounds), or None."""
        self.bus.set(f"ij/restorable/{self.index}", json.dumps(sorted(mine)))
        common = set(mine)
        for k in range(self.count):
            common &= set(json.loads(self.bus.wait(f"ij/restorable/{k}", timeout)))
        return max(common) if common else None


def combine_stats(stats: list[dict]) -> dict[str, Any]:
    """The round's statistics from every shard's partial sums (in shard order): `dots` [K, K], `intended_sq`,
    `lost_sq`, `update_bytes`, `router_norm_sq` and each island's `router_sq` summed."""
    import numpy as np

    router_sq: dict[str, float] = {}
    for s in stats:
        for name, value in s.get("router_sq", {}).items():
            router_sq[name] = router_sq.get(name, 0.0) + value
    return dict(
        dots=sum(np.asarray(s["dots"], np.float64) for s in stats),
        intended_sq=sum(s["intended_sq"] for s in stats),
        lost_sq=sum(s["lost_sq"] for s in stats),
        update_bytes=sum(s["update_bytes"] for s in stats),
        router_sq=router_sq,
        router_norm_sq=sum(s.get("router_norm_sq", 0.0) for s in stats),
    )
