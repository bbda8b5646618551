"""`run_coordinator`: the coordinator role's one round loop, over gRPC or in process.

A cluster launch (or `launch/local.py`) runs it in a process of its own,
serving gRPC on an address; the in-process run (`island_jax.run`) runs it on a
thread, serving an `InProcessExchange`. Everything else is the same: the
coordinator's state, its metrics and checkpoints under `WORKDIR/coordinator`,
and resume from the newest checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import ml_collections
from absl import logging

from island_jax import allocator
from island_jax import config as config_lib
from island_jax.comm.inprocess import InProcessExchange
from island_jax.coordinator import Coordinator, RoundRecord
from island_jax.coordinator.replay import KEPT, KeptUpdates
from island_jax.coordinator.shards import ServiceBus, Shard, ShardError, parse_addresses, shard_address
from island_jax.metrics import write_json
from island_jax.model.init import checksum, count, init_params
from island_jax.model.load import check_init_from
from island_jax.protocol import Endpoint
from island_jax.roles.checkpoint_sets import SHARD_POLL_SECONDS, CheckpointSets, restorable
from island_jax.roles.checkpoint_sets import hold as hold_past
from island_jax.workdir import RoleFolder, coordinator_dir, due, island_dir, open_role, set_aside_summary


class _GrpcEndpoint:
    """The gRPC server and its service's `ExchangeSession` as the `protocol.Endpoint` the round loop serves."""

    def __init__(self, coordinator: Coordinator, address: str, config, insecure: bool):
        from island_jax.comm.grpc_server import serve

        c = config.comm
        self.server, service, self.port = serve(
            coordinator, address, c.chunk_bytes, tls=c.tls, tokens_file=c.auth.tokens_file, insecure=insecure,
            keepalive_seconds=c.keepalive_seconds,
        )
        self.session = session = service.session
        self.lock, self.wire_bytes, self.payload_received = session.lock, session.wire_bytes, session.payload_received
        self.payload_bytes, self.update_bytes = session.payload_bytes, session.update_bytes
        self.where = f"{address.rsplit(':', 1)[0]}:{self.port}"

    def notify(self) -> None:
        self.session.notify()

    def check(self) -> None:
        """Nothing aborts a gRPC exchange from outside: islands that fail stop contributing."""

    def wait_until_fetched(self, round: int, islands, timeout: float) -> bool:
        return self.session.wait_until_fetched(round, islands, timeout)

    def fetched_by(self, fragment: int, round: int) -> set[str]:
        return self.session.fetched_by(fragment, round)

    def stop(self, grace: float) -> None:
        self.server.stop(grace=grace)


def _serve(coordinator: Coordinator, exchange, config: ml_collections.ConfigDict, insecure: bool) -> Endpoint:
    """The endpoint islands reach: gRPC on `exchange` ("HOST:PORT") or the given `InProcessExchange`."""
    if isinstance(exchange, InProcessExchange):
        return exchange.serve(coordinator)
    return _GrpcEndpoint(coordinator, exchange, config, insecure)


def _leave(spec: Shard | None) -> None:
    """A shard at the end of its run leaves the shards' coordination service with the others (a barrier)."""
    if spec is not None:
        spec.bus.close()


def _shard(config, exchange, shard: int, shard_service: str | None, bus) -> tuple[Shard | None, Any]:
    """Of a coordinator of `coordinator.shards` > 1: this process's `Shard` and the exchange it serves (its own
    address of the --coordinator list, or the given `InProcessExchange`); (None, exchange) for one process.

    Raises:
      ShardError: an address list of another length than `coordinator.shards`, or `shard` not below it, or no
        `shard_service` for shards in processes of their own.
    """
    count = config.coordinator.shards
    if count == 1 and shard == 0:
        return None, exchange
    addresses = exchange
    if isinstance(exchange, str):
        exchange = shard_address(config, exchange, shard)
    elif not 0 <= shard < count:
        raise ShardError(f"shard {shard} but coordinator.shards is {count}; give a shard from 0 to {count - 1}")
    if bus is None:
        if not shard_service:
            raise ShardError("coordinator.shards is %d: give --shard_service=HOST:PORT, where shard 0 runs the shards' "
                             "jax.distributed coordination service" % count)
        secret = None
        if config.comm.auth.tokens_file:  # the run's one credential set signs what the shards say to each other
            with open(config.comm.auth.tokens_file, "rb") as f:
                secret = hashlib.sha256(b"island_jax shards\n" + f.read()).digest()
        bus = ServiceBus(shard_service, count, shard, config.distributed, secret)
    spec = Shard(shard, count, bus, config.comm.round_timeout_seconds)
    listed = parse_addresses(addresses) if isinstance(addresses, str) else []
    spec.check_settings({"coordinator.shards": count, "--coordinator": listed},
                        config.distributed.initialization_timeout_seconds)
    return spec, exchange


def run_coordinator(
    config: ml_collections.ConfigDict, workdir: str, exchange: str | InProcessExchange, insecure: bool = False,
    allow_config_change: bool = False, shard: int = 0, shard_service: str | None = None, bus=None,
) -> dict:
    """Serves the exchange until every island has the last round's update.

    Per round and fragment it waits for the merge (a quorum's grace window is
    closed by polling), logs the round record, and checkpoints when due
    (`checkpoint.coordinator_every_rounds`, or `every_rounds`, and after the
    last round). While the checkpoint of round R is written, the update of
    round R + 2 is held back, so islands never get more than two rounds past
    the coordinator's newest complete checkpoint: a restarted coordinator
    resumes from it and islands roll back to their own checkpoint of it.

    Args:
      config: the run's config (validated here).
      workdir: the run's folder; this role writes under `workdir/coordinator`.
      exchange: HOST:PORT to serve gRPC on (port 0: any free port, logged), or
        the `InProcessExchange` the islands of this process use.
      insecure: serve gRPC off loopback without TLS and tokens (`security.check_exposure`).
      allow_config_change: resume under a config that differs from the one the coordinator started with
        (`workdir.open_role`); otherwise that is refused.
      shard: of a coordinator of `coordinator.shards` processes, the shard this one is (`coordinator/shards.py`);
        `exchange` is then the list of every shard's HOST:PORT (this one listens on item `shard`), or shard
        `shard`'s `InProcessExchange`. It writes under `workdir/coordinator-shard-K` (shard 0 under
        `workdir/coordinator`).
      shard_service: HOST:PORT of the shards' jax.distributed coordination service (shard 0 runs it), through
        which they agree (`shards.ServiceBus`); not needed with `bus`.
      bus: the shards' `shards.Bus` when they run in one process (`shards.LocalBus`).

    Returns:
      The role's summary (also `coordinator/summary.json`): `rounds`, `params`,
      `codec`, `block_size`, `update_codec` (`codec.update_kind`), `contribution_bytes` (one island's payload
      bytes per round), `update_bytes` (the update's payload bytes per round),
      `wire_bytes.NAME.{sent, received}` (frame bytes, handshake excluded), `payload_bytes_received.NAME` (the
      chunk bytes of its contributions: of a coordinator shard, those of its range),
      `checksum` (of the view), `initial_checksum` (of the initial parameters: the seed's, or
      `model.init_from`'s), `wall_seconds`. Empty if the run was complete.

    Raises:
      ConfigError (ConfigChangeError: resumed under another config), FileExistsError, CheckpointError, SecurityError (off loopback without TLS and tokens, or
      unreadable credentials); TimeoutError if a round is
      not merged within `comm.round_timeout_seconds`, or waits for missing islands
      (its quorum not reached) for `outer.rejoin_timeout_seconds` after its first
      contribution; RunAborted when an in-process exchange is aborted.
    """
    config_lib.validate(config)
    if config.codec.kind == "topk" and config.outer.momentum > 0:
        logging.warning(
            "codec.kind is topk with outer.momentum %g: the islands' error feedback and the outer momentum together "
            "trained badly or diverged in docs/results.md (section 9); SparseLoCo's outer step is "
            "outer.momentum=0, outer.learning_rate=1, codec.error_feedback_decay=0.95", config.outer.momentum)
    check_init_from(config)  # model.init_from: its tensors fit the model, before anything is written
    start = time.perf_counter()
    spec, exchange = _shard(config, exchange, shard, shard_service, bus)  # before the folder: bad input changes nothing
    role = open_role(config, coordinator_dir(workdir, shard), coordinator=True, allow_config_change=allow_config_change)
    names, rounds = list(config.islands.keys()), config.outer.rounds
    try:
        _, params, _ = init_params(config)
        num_params, initial = count(params), checksum(params)  # the seed's draw, or model.init_from's tensors
        coordinator = Coordinator(config, params, names, shard=spec)
        del params  # the coordinator holds them in its rows from here on
        if spec is None:
            latest = role.checkpoints.latest_round()
        else:  # the newest set committed and held by every shard
            latest = restorable(spec, role, workdir, config.distributed.initialization_timeout_seconds)
        if latest is not None and latest >= rounds and os.path.exists(os.path.join(role.path, "summary.json")):
            logging.info("the run is complete (%d of %d rounds); nothing to do", latest, rounds)
            _leave(spec)
            return {}
        if latest is not None and spec is not None:
            coordinator.load_state(role.checkpoints.restore(coordinator.state(), round=latest))
            logging.info("shard %d of %d resumed from the checkpoint set of round %d", shard, spec.count, latest)
            if coordinator.round < rounds:
                set_aside_summary(role.path, latest)
        elif latest is not None:
            coordinator.load_state(role.checkpoints.restore(coordinator.state()))  # the newest intact one
            logging.info("resumed from the checkpoint of round %d (view checksum %s); islands past it roll back",
                         coordinator.round, coordinator.checksum)
            if coordinator.round < rounds:  # a finished run extended (outer.rounds raised), or a fallback
                set_aside_summary(role.path, latest)
        if config.outer.get("rejoin", "replay") == "replay":  # restarted islands replay the rounds they missed with these
            coordinator.keep_updates(KeptUpdates(os.path.join(role.path, KEPT), config))
        finished = coordinator.round >= rounds
        endpoint = _serve(coordinator, exchange, config, insecure)
        role.begin()  # the config and the port are checked: the run has started (config.json, run_info.json)
        # so that a coordinator that dies early can restart too (shards start again from the seed: nothing commits
        # a round-0 set)
        if spec is None and role.checkpoints.latest_round() is None:
            with endpoint.lock:  # taken before any merge can change it
                state = coordinator.state()
            role.checkpoints.save(0, state, force=True, frozen_numpy=True)
            del state
        logging.info(
            "coordinator serving on %s for islands %s (%d parameters; per island and round, %s contributions of "
            "%d bytes and %s updates of %d bytes)", endpoint.where, names, num_params, coordinator.fragments[0].codec,
            endpoint.payload_bytes, coordinator.fragments[0].update_codec, endpoint.update_bytes,
        )
        try:
            if finished:  # it died after its last checkpoint: islands still waiting take the final view
                _serve_final_view(config, coordinator, endpoint, workdir)
            else:
                _serve_rounds(config, coordinator, endpoint, role, workdir)
        finally:
            endpoint.stop(grace=5.0)
    finally:
        role.close()
    summary = dict(
        rounds=rounds, params=num_params, codec=config.codec.kind, block_size=config.codec.block_size,
        update_codec=config_lib.update_kind(config.codec), contribution_bytes=endpoint.payload_bytes,
        update_bytes=endpoint.update_bytes, wire_bytes=endpoint.wire_bytes,
        payload_bytes_received=dict(endpoint.payload_received), checksum=coordinator.checksum,
        initial_checksum=initial, wall_seconds=time.perf_counter() - start,
    )
    write_json(os.path.join(role.path, "summary.json"), summary)
    _leave(spec)
    logging.info("coordinator done after %d rounds in %.1f s", rounds, summary["wall_seconds"])
    return summary


def _serve_rounds(config, coordinator: Coordinator, endpoint, role: RoleFolder, workdir: str) -> None:
    """The round loop: every fragment's merge of every round, logged and checkpointed."""
    rounds, names = config.outer.rounds, list(config.islands.keys())
    every = role.checkpoints.every_rounds  # checkpoint.coordinator_every_rounds (or every_rounds)
    saving: set[int] = set()  # rounds whose checkpoint is being written (their updates + 2 are held)
    sets = None if coordinator.shard is None else CheckpointSets(coordinator.shard, workdir, coordinator, saving)
    last = time.perf_counter()
    for r in range(coordinator.round, rounds):
        for p in range(len(coordinator.fragments)):
            rec, received = _wait_for_merge(config, coordinator, endpoint, r, p, role, sets)
            rec = coordinator.complete_record(rec, p)  # of the leader of shards: every shard's sums
            now = time.perf_counter()
            role.metrics.write(_round_record(rec, r, p, received, now - last, coordinator.shard))
            last = now
            logging.info(
                "round %d/%d%s merged | weights %s | pseudo-gradient norms %s | cosine %s",
                r + 1, rounds, f" fragment {p}" if len(coordinator) > 1 else "",
                " ".join(f"{k}={v:.3f}" for k, v in rec.weights.items()),
                " ".join(f"{k}={v:.4f}" for k, v in rec.pseudo_gradient_norm.items()),
                " ".join(f"{k}={v:.3f}" for k, v in rec.cosine_similarity.items()) or "-",
            )
        allocator.trim()  # the merge's old state and the round's contributions go back to the kernel
        if due(r + 1, every, rounds):
            _checkpoint(coordinator, endpoint, role, r + 1, force=r + 1 == rounds, saving=saving, sets=sets)
    if sets is not None:  # the last set is committed before any shard stops
        sets.finish(rounds, config.comm.round_timeout_seconds, endpoint)
    # Every island that contributed to the last round receives its update (a quorum may have left some out).
    last_contributors = {n for f in coordinator.fragments for n in f.history[-1].contributors}
    if not endpoint.wait_until_fetched(rounds - 1, last_contributors, timeout=config.comm.round_timeout_seconds):
        missing = sorted(last_contributors - set.intersection(
            *(endpoint.fetched_by(p, rounds - 1) for p in range(len(coordinator.fragments)))))
        raise TimeoutError(
            f"islands {missing} did not fetch the update of round {rounds} within comm.round_timeout_seconds="
            f"{config.comm.round_timeout_seconds}; see their logs (of {names})"
        )
    # Islands the quorum left out of the last round (slow, or rejoining) get a grace window to fetch it too.
    joined = set().union(*(f.joined for f in coordinator.fragments)) - last_contributors
    if joined and not endpoint.wait_until_fetched(rounds - 1, joined, timeout=config.outer.grace_seconds):
        logging.warning("islands %s did not fetch the last update within outer.grace_seconds=%s; stopping",
                        sorted(joined - endpoint.fetched_by(0, rounds - 1)), config.outer.grace_seconds)


def _serve_final_view(config, coordinator: Coordinator, endpoint, workdir: str) -> None:
    """A coordinator restarted after its last checkpoint: the last update is gone with the process, so islands
    still waiting for it take the final view (`fetch_view`). Serves until every island took it or finished
    (its summary is in the workdir), for up to `comm.reconnect_seconds`."""
    names = list(config.islands.keys())

    def done() -> bool:
        return all(n in coordinator.viewed or os.path.exists(os.path.join(island_dir(workdir, n), "summary.json"))
                   for n in names)

    logging.info("the last round was merged before a restart; serving the final view to islands that need it")
    deadline = time.monotonic() + config.comm.reconnect_seconds
    with endpoint.lock:
        while not done() and time.monotonic() < deadline:
            endpoint.lock.wait(timeout=1.0)  # woken by a view served; summaries are looked for every second
        if not done():
            logging.warning("islands %s neither took the final view nor finished within comm.reconnect_seconds=%g",
                            sorted(n for n in names if n not in coordinator.viewed), config.comm.reconnect_seconds)


def _wait_for_merge(config, coordinator, endpoint, r: int, p: int, role: RoleFolder,
                    sets: CheckpointSets | None = None) -> tuple[RoundRecord, dict]:
    """Waits until fragment `p` merged round `r` (0-based); its record and the frame bytes received so far.

    Raises:
      TimeoutError: not merged within `comm.round_timeout_seconds`.
    """
    fragment = coordinator.fragments[p]
    with endpoint.lock:
        deadline = time.monotonic() + config.comm.round_timeout_seconds
        while fragment.round <= r and time.monotonic() < deadline:
            endpoint.check()
            if coordinator.poll():  # closes a round once a quorum's grace window has passed
                endpoint.notify()
            else:  # shards poll the others' progress, which wakes nobody here
                endpoint.lock.wait(timeout=0.5 if sets is None else SHARD_POLL_SECONDS)
            if sets is not None and sets.poll():
                endpoint.notify()
            _check_stalled(config, coordinator)
            role.checkpoints.check()  # a failed save ends the role now (its updates stay held)
        endpoint.check()
        if fragment.round <= r:
            raise TimeoutError(
                f"round {r + 1} of fragment {p} was not merged within comm.round_timeout_seconds="
                f"{config.comm.round_timeout_seconds}; contributions came from {sorted(fragment.pending)} of "
                f"{list(config.islands.keys())}"
            )
        rec = next(h for h in reversed(fragment.history) if h.round == r)
        return rec, {k: v["received"] for k, v in endpoint.wire_bytes.items()}


def _check_stalled(config, coordinator: Coordinator) -> None:
    """Raises TimeoutError once a round without its quorum has waited `outer.rejoin_timeout_seconds` for
    missing islands since its first contribution."""
    seconds, waiting, p = coordinator.stalled()
    limit = config.outer.rejoin_timeout_seconds
    if seconds <= limit:
        return
    n = len(config.islands)
    quorum = f"outer.min_islands={config.outer.min_islands or n}"
    raise TimeoutError(
        f"round {coordinator.fragments[p].round + 1}{f' fragment {p}' if len(coordinator) > 1 else ''} waited "
        f"{seconds:.0f} s for islands "
        f"{waiting} after the first contribution (outer.rejoin_timeout_seconds={limit:g}): they may have died. "
        f"Restart them with the same workdir (they rejoin the run), raise outer.rejoin_timeout_seconds, or lower "
        f"{quorum} (of {n} islands) so that the run goes on without them"
    )


def _round_record(rec: RoundRecord, r: int, p: int, received: dict, seconds: float, shard: Shard | None = None) -> dict:
    """The coordinator's metrics record of round `r` (0-based) of fragment `p`. Of a coordinator shard, it says
    which (`shard`, `shards`): shard 0's statistics are the whole round's, another's those of its range alone."""
    return dict(
        kind="round", round=r + 1, fragment=p, contributors=rec.contributors, tokens=rec.tokens, weights=rec.weights,
        pseudo_gradient_norm=rec.pseudo_gradient_norm, cosine_similarity=rec.cosine_similarity,
        update_bytes=rec.update_bytes, update_codec_relative_error=rec.update_codec_relative_error,
        outer_learning_rate=rec.outer_learning_rate, outer_momentum=rec.outer_momentum,
        wire_bytes_received=received, checksum=rec.checksum, seconds=seconds,
        **({} if rec.expert_weights is None else dict(expert_weights=rec.expert_weights)),
        **({} if rec.routing is None else dict(routing=rec.routing)),
        **({} if shard is None else dict(shard=shard.index, shards=shard.count)),
    )


def _checkpoint(coordinator, endpoint, role: RoleFolder, rounds_done: int, force: bool, saving: set[int],
                sets: CheckpointSets | None = None) -> None:
    """Saves the coordinator's state after `rounds_done` rounds, with the checksums of what it holds.

    From the moment the state is taken until the checkpoint is complete, the update that completes round
    `rounds_done + 2` is held back, so islands stay within reach of the newest complete checkpoint (they keep
    theirs of it): `saving` holds the rounds being written, and the updates from the oldest one's + 2 on wait.
    A failed save keeps them held; the round loop raises its error (`Checkpointer.check`).
    """

    def hold() -> None:  # under the lock
        hold_past(coordinator, saving)
        endpoint.notify()

    with endpoint.lock:
        # Islands apply every update of a checkpoint round before they contribute again, so no fragment
        # has moved on yet.
        moved_on = max(f.round for f in coordinator.fragments) != rounds_done
        state = None if coordinator.round != rounds_done or moved_on else coordinator.state()
        if state is not None:
            saving.add(rounds_done)
            hold()
    if state is None:
        logging.warning("round %d: a fragment moved on before the checkpoint; not saved", rounds_done)
        if sets is not None:
            sets.skipped(rounds_done)
        return
    # the master trees are laid out fresh for the save, and a view is replaced each round, never written
    if not role.checkpoints.save(rounds_done, state, force=force, frozen_numpy=True):
        with endpoint.lock:
            saving.discard(rounds_done)
            hold()
        return

    def release(future) -> None:
        if future.exception() is None and sets is not None:  # held until every shard's part is durable
            sets.saved(rounds_done)
        elif future.exception() is None:
            with endpoint.lock:
                saving.discard(rounds_done)
                hold()

    role.checkpoints.last_save().add_done_callback(release)
    checksums = {
        f"fragments/{p}/{k}": checksum(v) for p, part in enumerate(state["fragments"]) for k, v in part.items()
    }
    role.metrics.write(dict(kind="checkpoint", round=rounds_done, checksums=checksums))
