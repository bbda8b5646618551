"""The handshake: an island joins only with the coordinator's fingerprint, round and initial parameters.

Every island must hold bit-identical global parameters (DiLoCo, arXiv
2311.08105, starts every replica from the same theta(0)); the checks here name
what differs, so a misconfigured island fails at join rather than after a
round of training.
"""

from __future__ import annotations

from typing import Sequence

from island_jax.config import fingerprint_differences
from island_jax.protocol import CORPUS, HandshakeError


def check_island(island: str, islands: Sequence[str], ours: dict, theirs: dict) -> None:
    """Checks an island's name and `config.fingerprint_fields` against the coordinator's.

    Args:
      island: the joining island's name.
      islands: the run's island names (`config.islands`).
      ours, theirs: the coordinator's and the island's `fingerprint_fields` (the island's may also hold its
        `CORPUS`, checked by `check_corpus`).

    Raises:
      HandshakeError: an unknown island, or fingerprint fields that differ (each named with both values).
    """
    if island not in islands:
        raise HandshakeError(f"island {island!r} is not in this run's config (islands: {list(islands)})")
    differences = fingerprint_differences(ours, {k: v for k, v in dict(theirs).items() if k != CORPUS})
    if differences:
        raise HandshakeError(
            f"island {island!r} differs from the coordinator in {', '.join(differences)}; model shapes, "
            "codec, block_size, chunk_bytes and seed must match: run every role with the same config and overrides"
        )


def check_corpus(island: str, theirs: dict | None, joined: dict[str, dict]) -> None:
    """Checks the corpus an island trains on (its fingerprint's `CORPUS`: file count, bytes and the hashes of
    the relative paths and contents, `data.load_corpus`; or the shared prepared dataset's
    `PreparedDataset.fingerprint`) against those of the other islands that joined, and
    notes it in `joined` ({island: corpus fingerprint}, the coordinator's, kept while it runs).

    Islands shard one corpus by index, so an island that reads another file list or other bytes (another
    Python's standard library, a changed copy) would train on data no other island holds out or skips. An
    island that rejoins is checked against the others again, so a restart on a host with another copy is
    refused too.

    Args:
      island: the joining island's name.
      theirs: its corpus fingerprint (None: it sent none, which is not checked).
      joined: the corpus fingerprints of the islands that joined so far; `island`'s is set when it passes.

    Raises:
      HandshakeError: naming both islands and every field of the two fingerprints that differs.
    """
    if theirs is None:
        return
    for other, ours in joined.items():
        if other == island:
            continue
        differences = [f"{k} ({other}: {ours.get(k)!r}, {island}: {theirs.get(k)!r})"
                       for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        if differences:
            raise HandshakeError(
                f"island {island!r} trains on another corpus than island {other!r}: {', '.join(differences)}; give "
                "every island the same files (data.files), with the same relative paths and bytes, or the same "
                "prepared dataset (data.prepared, a copy of the whole folder)"
            )
    joined[island] = dict(theirs)


def check_round(island: str, round: int, our_round: int) -> None:
    """Checks that an island joins one fragment at the fragment's round (`round`: the one it trains next).

    Raises:
      HandshakeError: another round.
    """
    if round != our_round:
        raise HandshakeError(
            f"island {island!r} joins at round {round} but the coordinator is at round {our_round}; restart "
            "every role from the same workdir so they resume from checkpoints of the same round"
        )


def check_params_checksum(island: str, theirs: str, ours: str) -> None:
    """Checks an island's `model.init.checksum` (16 hex digits) against the coordinator's island view.

    Raises:
      HandshakeError: the checksums differ.
    """
    if theirs != ours:
        raise HandshakeError(
            f"island {island!r} has parameter checksum {theirs} but the coordinator has "
            f"{ours}; both must initialise from the same config.seed and model on the CPU backend"
        )
