"""An island's transport to a coordinator of several shards (`coordinator.shards`): one transport per shard.

Shard k of K owns range k of every fragment's chunk plan (`codec.chunk_ranges`). `ShardedTransport` holds one
transport per shard (gRPC or in process, each made with `shard=(k, K)`, so it sends and fetches only its
range's chunks) and implements `protocol.Transport` over them:

  join            the leader (shard 0) admits the island and answers; then every other shard learns it
  start_together  the leader's start barrier
  contribute      every shard's range at once, on threads of its own (one header per shard carries the tokens)
  fetch_update    every shard's range at once; the chunks put together into the whole update
  fetch_view      every shard's part of the view (zeros elsewhere), put together; again if the shards' rounds differ
"""

from __future__ import annotations

import time
from concurrent import futures

import numpy as np

from island_jax.protocol import ContributionHeader, SyncStats

VIEW_RETRY_SECONDS = 0.1  # between fetches of a view whose parts the shards served at different rounds


def _joined(payloads: list) -> bytes:
    """The payloads of every shard's range (each zero outside its own chunks), as one: their bytes OR-ed."""
    out = np.frombuffer(bytes(payloads[0]), np.uint8).copy()
    for p in payloads[1:]:
        out |= np.frombuffer(p, np.uint8)
    return out.tobytes()


class ShardedTransport:
    """`protocol.Transport` to a coordinator of K shards, over one transport per shard.

    Args:
      transports: shard k's transport at index k (each made with `shard=(k, K)`).
      encoded_once: the transports read a `codec.ChunkEncoder` chunk by chunk (gRPC: each shard's senders take
        their range's chunks of one encoder); False: the payload is encoded once into bytes first (in process).
    """

    def __init__(self, transports: list, encoded_once: bool = False):
        self.transports, self.encoded_once = transports, encoded_once
        self.leader = transports[0]
        self.link = self.leader.link
        self.pipelined = self.leader.pipelined
        self.pool = futures.ThreadPoolExecutor(max_workers=4 * len(transports), thread_name_prefix="shards")

    def _each(self, call) -> list:
        """`call(transport)` for every shard's transport at once; their results in shard order (the first error
        raised, once every call ended)."""
        done = [self.pool.submit(call, t) for t in self.transports]
        futures.wait(done)
        return [f.result() for f in done]

    def join(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> dict:
        """The leader's `join` (it admits the island: {"round", "checksum", "rejoin", "kept"}), then every other
        shard's; "kept" holds every shard's digests of its range, round by round."""
        reply = self.leader.join(island, config_fingerprint, params_checksum, round)
        others = [t.join(island, config_fingerprint, params_checksum, round) for t in self.transports[1:]]
        if reply.get("kept"):
            kept = {(k["round"], k["fragment"]): k for k in reply["kept"]}
            for other in others:
                found = {(k["round"], k["fragment"]): k for k in other.get("kept", [])}
                for key in list(kept):
                    if key not in found:  # not kept on every shard: not replayable from here on
                        del kept[key]
                    else:
                        kept[key] = dict(kept[key], chunks={**kept[key]["chunks"], **found[key]["chunks"]},
                                         merged_with=kept[key]["merged_with"] and found[key]["merged_with"])
            reply = dict(reply, kept=[kept[k] for k in sorted(kept)])
        return reply

    def replaying(self, island: str, round: int) -> None:
        """Every shard's `replaying`."""
        for t in self.transports:
            t.replaying(island, round)

    def start_together(self, island: str, config_fingerprint: dict, params_checksum: str, round: int = 0) -> None:
        self.leader.start_together(island, config_fingerprint, params_checksum, round)

    def contribute(self, header: ContributionHeader, payload) -> str:
        """Every shard's range of the payload at once; "discarded" if a shard discarded it (the round closed
        without it), else "accepted". Raises the first shard's error."""
        if not isinstance(payload, (bytes, bytearray, memoryview)) and not self.encoded_once:
            payload = payload.tobytes()
        statuses = self._each(lambda t: t.contribute(header, payload))
        return "discarded" if "discarded" in statuses else "accepted"

    def fetch_update(self, round: int, island: str, fragment: int = 0) -> bytes:
        """The whole update of `round` of `fragment`, its chunks from the shards that own them."""
        return _joined(self._each(lambda t: t.fetch_update(round, island, fragment)))

    def fetch_view(self, island: str, min_round: int = 0, needed=None) -> tuple[list[int], bytes]:
        """The island view from every shard's part, once all shards serve the same rounds."""
        while True:
            replies = self._each(lambda t: t.fetch_view(island, min_round, needed))
            rounds = [r for r, _ in replies]
            if all(r == rounds[0] for r in rounds):
                return rounds[0], _joined([p for _, p in replies])
            time.sleep(VIEW_RETRY_SECONDS)  # a shard merged a round the others are merging: again, once they have

    def planned_inner_steps(self, island: str) -> int | None:
        return self.leader.planned_inner_steps(island)

    def stats(self, round: int, fragment: int = 0) -> SyncStats:
        """The exchange of `round` of `fragment` over every shard: bytes summed, seconds the longest shard's."""
        each = [t.stats(round, fragment) for t in self.transports]
        out = SyncStats()
        for field in ("bytes_sent", "bytes_received"):
            setattr(out, field, sum(getattr(s, field) for s in each))
        for field in ("seconds_sending", "seconds_overlapped", "seconds_transferring"):
            setattr(out, field, max(getattr(s, field) for s in each))
        return out

    def close(self) -> None:
        for t in self.transports:
            t.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
