"""`run_island`: an island's one round loop, over gRPC, in process, or with no outer loop.

A cluster launch (or `launch/local.py`) runs it in a process of its own,
reaching the coordinator's address over gRPC; the in-process run
(`island_jax.run`) runs it on a thread over an `InProcessExchange`; the
data-parallel baseline (`outer.enabled = False`) runs it with no exchange at
all. The island, its rounds (`StreamingSync`: fragments, overlap,
accounting), its metrics and checkpoints under `WORKDIR/islands/NAME`, and
resume from the newest checkpoint are the same in every case.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from island_jax import allocator, distributed
from island_jax import config as config_lib
from island_jax import data as data_lib
from island_jax.checkpoint import CheckpointCorrupt
from island_jax.comm.inprocess import InProcessExchange, InProcessTransport
from island_jax.comm.link import LinkEmulator
from island_jax.comm.session import RunAborted
from island_jax.comm.sharded import ShardedTransport
from island_jax.coordinator.shards import ShardError, parse_addresses
from island_jax.island import ACCOUNTING_FIELDS, STEP_METRICS, EventLog, Island, StreamingSync, memory
from island_jax.island.outer_loop import log_view_taken
from island_jax.island.replay import ReplayPlan, short_reason
from island_jax.island.step import learning_rates
from island_jax.mesh import island_mesh
from island_jax.metrics import gbps, read_jsonl, write_json
from island_jax.model.init import checksum, count, init_params
from island_jax.model.load import check_init_from
from island_jax.progress import Eta
from island_jax.protocol import CORPUS, CoordinatorRestarted, ExchangeError
from island_jax.workdir import (
    RoleFolder,
    checkpoint_schedule,
    coordinator_dir,
    due,
    island_dir,
    island_saves,
    open_role,
    schedule_rounds,
    set_aside_summary,
    summarize_island,
)


def connect(
    config: ml_collections.ConfigDict, exchange: str | InProcessExchange | None, finished=None, part: int = 0,
    parts: int = 1, shares: list[list[int]] | None = None,
):
    """Island's transport to `exchange`: gRPC to "HOST:PORT", in process to an `InProcessExchange`, or None
    (no outer loop). To a coordinator of `coordinator.shards` K > 1: "HOST:PORT,..." (every shard's, shard 0
    first) or a list of K `InProcessExchange`s, over a `ShardedTransport` of one transport per shard. An emulated link (`comm.link` in the config) sits under either transport. `finished`
    (gRPC): called while the coordinator is unreachable; True ends the retries (the run is over). `part`,
    `parts`: this process of an island of several (gRPC), which moves its share of every payload: `shares`, per
    fragment the indices of the chunks it owns (`island.shards.Ownership`)."""
    if exchange is None:
        return None
    link, c = LinkEmulator.from_config(config), config.comm
    count = config.coordinator.shards
    if isinstance(exchange, (list, tuple)):  # the in-process exchanges of every shard
        if len(exchange) != count:
            raise ShardError(f"{len(exchange)} in-process exchanges but coordinator.shards is {count}")
        return ShardedTransport([
            InProcessTransport(ex, link, c.connections, c.round_timeout_seconds, c.join_timeout_seconds,
                               shard=(k, count)) for k, ex in enumerate(exchange)])
    if isinstance(exchange, InProcessExchange):
        return InProcessTransport(exchange, link, c.connections, c.round_timeout_seconds, c.join_timeout_seconds)
    from island_jax.comm import security
    from island_jax.comm.grpc_client import GrpcTransport

    addresses = parse_addresses(exchange)
    if len(addresses) != count:
        raise ShardError(f"--coordinator lists {len(addresses)} addresses ({exchange}) but coordinator.shards is "
                         f"{count}; give every shard's HOST:PORT, shard 0 first")
    token = security.read_token(c.auth.token_file, c.auth.token_env)
    transports = [GrpcTransport(
        address, c.chunk_bytes, c.join_timeout_seconds, c.round_timeout_seconds, connections=c.connections,
        pipeline=c.pipeline, link=link, reconnect_seconds=c.reconnect_seconds, finished=finished, tls=c.tls,
        token=token, part=part, parts=parts, shares=shares,
        keepalive_seconds=c.keepalive_seconds, backoff_cap_seconds=c.reconnect_backoff_cap_seconds,
        shard=(k, count) if count > 1 else None,
    ) for k, address in enumerate(addresses)]
    return transports[0] if count == 1 else ShardedTransport(transports, encoded_once=True)


def run_finished(workdir: str, rounds: int) -> bool:
    """Whether the coordinator of the run in `workdir` finished its `rounds` rounds (wrote a summary of as many:
    a summary of fewer is a finished run being extended, `outer.rounds` raised)."""
    path = os.path.join(coordinator_dir(workdir), "summary.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("rounds", 0) >= rounds
    except (OSError, ValueError):  # none yet, or being written
        return False


def run_island(
    config: ml_collections.ConfigDict,
    workdir: str,
    name: str,
    exchange: str | InProcessExchange | None,
    devices: Sequence[jax.Device] | None = None,
    device_lock: threading.Lock | None = None,
    stop: threading.Event | None = None,
    allow_config_change: bool = False,
) -> dict:
    """Trains island `name` for the run's rounds, exchanging with the coordinator at `exchange`.

    The first island of `config.islands` also evaluates the global parameters
    (the local ones without an outer loop) after round 0, every
    `eval.every_rounds` and after the last round.

    Args:
      config: the run's config (validated here).
      workdir: the run's folder; this role writes under `workdir/islands/NAME`.
      name: a key of `config.islands`.
      exchange: the coordinator's "HOST:PORT" (gRPC), the run's `InProcessExchange`, or None (no outer
        loop: the data-parallel baseline).
      devices: the island's `num_devices` devices (default: the first ones of `jax.devices()`).
      device_lock: held around the island's device work when islands share a process (XLA:CPU's
        in-process collectives must not interleave).
      stop: once set, the island stops before its next round (raising `RunAborted`), its last
        checkpoint kept: how the in-process run stops its islands.
      allow_config_change: resume under a config that differs from the one the island started with
        (`workdir.open_role`); otherwise that is refused.

    Returns:
      The role's summary (also in its folder): `workdir.summarize_island`'s
      totals, `params`, `codec`, `block_size`, `process_seconds` (start-up,
      compilation and the first evaluation included) and, for the evaluating
      island, `corpus`. Empty if the run was complete.

    Raises:
      ConfigError (ConfigChangeError: resumed under another config), DataError, HandshakeError, ContributionError, ExchangeError,
      FileExistsError, CheckpointError; RuntimeError at `crash_at_round`;
      RunAborted when an in-process exchange is aborted.
    """
    cfg = config.islands[name]
    devices = list(devices) if devices is not None else jax.devices()[: cfg.num_devices]
    config_lib.validate(config, num_available_devices=len(devices), island=name)
    check_init_from(config)  # model.init_from: its tensors fit the model, its tokenizer is the data's
    memory.check_fits(config, [name])  # before anything is made, saved or compiled
    start = time.perf_counter()
    # An island of several processes runs as one in a single process (the in-process run: the same devices).
    multi_process = cfg.num_processes > 1 and jax.process_count() > 1
    if multi_process and jax.process_count() != cfg.num_processes:
        raise config_lib.ConfigError(
            f"islands.{name}.num_processes is {cfg.num_processes} but this process is one of {jax.process_count()}; "
            "start each of the island's processes with --process_id and --island_coordinator (docs/cluster.md)"
        )
    primary = jax.process_index() == 0 if multi_process else True  # writes the island's metrics, once
    role = open_role(config, island_dir(workdir, name), primary=primary, allow_config_change=allow_config_change)
    names, rounds = list(config.islands.keys()), config.outer.rounds
    transport = events = sync = None
    evaluators: list[_Evaluator] = []
    try:
        corpus = data_lib.load(config, names, island=name)
        role.begin()  # the config and data are checked: the run has started (config.json, run_info.json)
        # On CPU devices each process draws only its own shards of the initial parameters (the same bits).
        mesh = island_mesh(cfg.mesh.data, cfg.mesh.expert, devices, fsdp=cfg.mesh.fsdp) if devices[0].platform == "cpu" else None
        graphdef, params, specs = init_params(config, mesh)
        if multi_process and devices[0].platform == "cpu":  # gloo between the processes: check it first
            leaf_sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
            distributed.check_collectives(devices, distributed.check_sizes(leaf_sizes, len(devices)))
        scheduled = schedule_rounds(role.path, config)  # the rounds the run started with: an extension holds
        if multi_process:  # what process 0 read (it also writes run_info.json)
            scheduled = distributed.allgather_json(scheduled)[0]
        island = Island(name, config, devices, graphdef, params, specs, corpus.train[name], scheduled, device_lock)
        num_params = count(params)
        del params  # the island holds its own shards now; a whole draw (on accelerators) is not kept for the run
        first = 0
        if role.checkpoints.latest_round() is not None:
            first = island.load_state(role.checkpoints.restore(island.state(0, template=True)))
            logging.info("island %s resumed from the checkpoint of round %d (step %d)", name, first, island.step)
        if first >= rounds:
            logging.info("the run is complete (%d of %d rounds); nothing to do", first, rounds)
            return {}
        if primary:  # extended (outer.rounds raised) past a finished run: it is no longer finished
            set_aside_summary(role.path, first)
        if rounds > scheduled:
            logging.info("island %s: rounds %d..%d extend the run's %d; their inner learning rate holds the "
                         "schedule's final value", name, scheduled + 1, rounds, scheduled)
        island.warm_up()  # compiles before the first round's clock starts
        transport = connect(config, exchange, finished=lambda: run_finished(workdir, rounds), part=island.part,
                            parts=island.parts, shares=[[c.index for c in o.share] for o in island.ownerships])
        evaluators = []
        if name == config_lib.evaluating_island(config):
            evaluators.append(_Evaluator(config, corpus.eval, corpus.token_bytes, island, role, transport is not None))
        if name in corpus.own_eval:  # data of its own: its own held-out split too
            evaluators.append(_Evaluator(config, corpus.own_eval[name], corpus.token_bytes, island, role,
                                         transport is not None, kind="own_eval"))
        probe = data_lib.eval_windows(corpus.eval, config.model.seq_len, config.eval.batch_size, config.eval.seed)
        island.set_routing_probe(data_lib.eval_batches(probe, config.eval.batch_size)[0] if len(probe) else None,
                                 config.metrics.get("routing_probe_tokens", 0))  # the same windows on every island
        fingerprint = join_fingerprint(config, corpus)
        first, fragment_rounds, plan = _join(config, island, transport, role, first, evaluators, fingerprint)
        events = EventLog(os.path.join(role.path, "events.jsonl") if primary else None, name)
        link = transport.link if transport is not None else None
        sync = StreamingSync(island, transport, config, first, link=link, events=events, fragment_rounds=fragment_rounds)
        if plan is not None:
            sync.replay_from(plan)
        elif first > 0:  # a resume: its first step is the first after the checkpoint round's update
            sync.resumed_after_update(_logged_loss(role.path, island.step))
        _train_rounds(config, island, sync, role, evaluators, first, stop, fingerprint)
    except ExchangeError:
        if not run_finished(workdir, rounds):
            raise
        logging.warning("island %s: the coordinator finished the run without this island's last rounds", name)
    finally:
        for part in (sync, events, transport):
            if part is not None:
                part.close()
        role.close()
    if not primary:
        return {}
    summary = summarize_island(role.path)
    summary.update(
        params=num_params, codec=config.codec.kind, block_size=config.codec.block_size,
        process_seconds=time.perf_counter() - start,  # start-up, compilation and evaluation included
    )
    if any(e.kind == "eval" for e in evaluators):
        summary["corpus"] = corpus.fingerprint
    write_json(os.path.join(role.path, "summary.json"), summary)
    return summary


def _logged_loss(folder: str, step: int) -> float | None:
    """The loss the role's own record (`metrics.jsonl`) holds for inner step `step` (1-based), or None."""
    path = os.path.join(folder, "metrics.jsonl")
    found = None
    for record in read_jsonl(path) if os.path.exists(path) else []:
        if record.get("kind") == "inner" and record.get("step") == step:
            found = record["loss"]
    return found


class _Evaluator:
    """Scores a held-out set (`data.eval_windows`) with the global parameters and writes a `kind` record:
    `{kind}_loss` (nats per token: the mean over windows, weighted by the targets each scores), `{kind}_bits_per_byte`
    (of the text, `data.bits_per_byte`), `{kind}_loss_stderr` (the standard error of the windows' unweighted mean),
    `{kind}_loss_halves` (the means of the set's first and second halves, weighted as the loss), `{kind}_windows`
    (how many) and
    `{kind}_windows_sha256` (`data.windows_sha256`: equal in every run scored on the same windows).

    `kind` "eval" is the shared held-out set (the first island scores it); "own_eval" an island's own data's
    eval split (`islands.NAME.data`)."""

    def __init__(self, config, source, token_bytes, island: Island, role: RoleFolder, global_params: bool,
                 kind: str = "eval"):
        self.island, self.role, self.global_params, self.kind = island, role, global_params, kind
        windows = data_lib.eval_windows(source, config.model.seq_len, config.eval.num_windows, config.eval.seed)
        self.count, self.sha256 = len(windows), data_lib.windows_sha256(windows)
        # the targets each window's loss averages over, and the bytes of text they stand for
        self.targets, self.text_bytes = data_lib.scored(windows, token_bytes)
        self.batches = data_lib.eval_batches(windows, config.eval.batch_size)

    def __call__(self, round: int, write: bool = True) -> dict:
        """Scores the held-out set after `round` rounds; returns the record's fields (written when `write`)."""
        losses = self.island.evaluate(self.batches, global_params=self.global_params)
        loss, stderr = data_lib.mean_and_stderr(losses)
        half = len(losses) // 2
        halves = [float(np.mean(losses[:half], dtype=np.float64)), float(np.mean(losses[half:], dtype=np.float64))]
        if np.any(self.targets != self.targets[0]):  # packed records: windows score different numbers of targets

            def weighted(part: slice) -> float:
                return float(np.sum(losses[part] * self.targets[part], dtype=np.float64) / np.sum(self.targets[part]))

            loss, halves = weighted(slice(None)), [weighted(slice(None, half)), weighted(slice(half, None))]
        k = self.kind
        result = {f"{k}_loss": loss, f"{k}_loss_stderr": stderr,
                  f"{k}_bits_per_byte": data_lib.bits_per_byte(loss, int(np.sum(self.targets)),
                                                               int(np.sum(self.text_bytes))),
                  f"{k}_loss_halves": halves,
                  f"{k}_windows": self.count, f"{k}_windows_sha256": self.sha256}
        if write:
            self.role.metrics.write(dict(kind=k, round=round, **result))
        return result


def join_fingerprint(config: ml_collections.ConfigDict, corpus: data_lib.Corpus) -> dict:
    """What an island joins with: `config.fingerprint_fields`, and its corpus's fingerprint under
    `handshake.CORPUS` (every island must split the same corpus: `handshake.check_corpus`)."""

    return {**config_lib.fingerprint_fields(config), CORPUS: corpus.fingerprint}


def _join(config, island: Island, transport, role: RoleFolder, first: int, evaluators: list[_Evaluator],
          fingerprint: dict):
    """The handshake (rejoining a running run when the island is behind or ahead of the coordinator), the
    evaluation of the round it starts at, and the start every island makes together. Returns (the round it
    trains first, each fragment's round when they differ, else None, the `ReplayPlan` of the rounds it replays
    first, else None)."""
    name, cfg = island.name, config.islands[island.name]
    link = transport.link if transport is not None else None
    if transport is not None:  # how its exchanges move, for island_jax.plan.predict
        role.metrics.write(dict(kind="exchange", pipelined=bool(transport.pipelined)))
    if link is not None:
        logging.info(
            "island %s: emulated link %.3g Gbit/s, %.3g ms one way, window %d bytes (one connection: %.3g Gbit/s; "
            "%d connections fill it, comm.connections=%d)", name, link.bandwidth_gbps, link.latency_ms,
            link.window_bytes, link.one_connection_gbps(), link.connections_needed(), config.comm.connections,
        )
    fragment_rounds, rejoined, plan = None, False, None
    if transport is not None:
        resumed = first
        resume = True
        while True:  # a coordinator that restarts while the island joins or fetches the view: again, from scratch
            try:
                first, fragment_rounds, rejoined, plan = align(config, island, transport, role, first, resume, fingerprint)
                break
            except CoordinatorRestarted as e:  # its state may be a checkpoint's now: restored again, or the view
                logging.warning("island %s: %s; it joins the restarted coordinator", name, e)
                resume = False
        if rejoined and evaluators and plan is None:
            logging.info("island %s evaluates the view it rejoined at (round %d; it resumed at %d)", name, first, resumed)
    logging.info(
        "island %s %s at round %d: %d devices (data=%d x fsdp=%d x expert=%d), batch %d, H=%d", name,
        "joined the coordinator" if transport is not None else "trains alone (no outer loop)", first,
        cfg.num_devices, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.batch_size, island.inner_steps,
    )
    for evaluator in evaluators:
        k = evaluator.kind
        scored = evaluator(first, write=first == 0)
        logging.info("round %d: %s loss %.4f +- %.4f %s (%d held-out windows)", first, k.replace("_", " "),
                     scored[f"{k}_loss"], scored[f"{k}_loss_stderr"],
                     data_lib.loss_unit(config, scored[f"{k}_bits_per_byte"]), scored[f"{k}_windows"])
    if transport is not None and not rejoined:  # every island starts its first round together
        checksum_now = island.global_checksum  # a collective over an island's processes: every one computes it
        if island.part == 0:
            transport.start_together(name, fingerprint, checksum_now, first)
    return first, fragment_rounds, plan


def align(config, island: Island, transport, role: RoleFolder, at: int, resume: bool,
          fingerprint: dict) -> tuple[int, list | None, bool, ReplayPlan | None]:
    """Joins the coordinator with the island's state after `at` completed rounds and brings the island to the
    round it is admitted at (bit for bit where it can):

    - one ahead of a restarted coordinator rolls back to its own checkpoint of the coordinator's round;
    - with `outer.rejoin = "replay"`, one behind (or ahead with no checkpoint of that round) replays the rounds
      from its newest checkpoint the coordinator kept every round after (`island.replay`);
    - otherwise it takes the island view, its own optimizer state and data position kept: no longer bitwise.

    Args:
      at: the rounds the island completed (its checkpoint's round, or the round it was training).
      resume: the island is at a round boundary (it resumed from a checkpoint) and trains on from its own
        state when the coordinator is at the same round; False (after a coordinator restart, mid-round) always
        rolls back or takes the view.
      fingerprint: what the island joins with (`join_fingerprint`).

    Returns:
      (the round to train next, each fragment's round when the view's fragments differ (else None), whether
      the island's state was replaced, the `ReplayPlan` of the rounds to replay first (else None)).
    """
    name = island.name
    # process 0's join decides for every process of the island (the others only learn the coordinator's plans)
    reply = island.agree(transport.join(name, fingerprint, island.global_checksum, at))[0]
    target = reply["round"]
    if resume and not reply["rejoin"]:
        return at, None, False, None
    own = None
    if target <= at and target in role.checkpoints.rounds(wait=True):
        try:
            own = role.checkpoints.restore(island.state(0, template=True), round=target)
        except CheckpointCorrupt:  # logged, and moved aside: the view is the state to take
            logging.warning("island %s: its checkpoint of round %d is damaged; it takes the view", name, target)
    if own is not None:
        island.load_state(own)
        if island.global_checksum == reply["checksum"]:
            logging.warning("island %s rolls back from round %d to its checkpoint of round %d, the coordinator's: "
                            "the run goes on bit for bit", name, at, target)
            role.checkpoints.discard_after(target)  # the rounds after it are trained again, and saved again
            _log_rejoin(island, role, at, target, "checkpoint")
            return target, None, True, None
        logging.warning("island %s: its checkpoint of round %d holds other parameters than the coordinator's "
                        "view; it takes the view", name, target)
    plan = _replay_plan(config, island, role, at, resume, reply)
    if plan is not None:
        return plan.start, None, True, plan
    rounds, view = transport.fetch_view(name, min_round=target, needed=island.view_chunks)
    island.load_view(view)
    log_view_taken(island, transport)
    first = min(rounds)
    if first > at and resume:
        logging.warning("island %s rejoined the run at round %d: it missed rounds %d..%d (it had completed %d)",
                        name, first + 1, at + 1, first, at)
    else:
        logging.warning("island %s (at round %d) takes the coordinator's view of round %d and keeps its own "
                        "optimizer state and data position: from here on the run is not bitwise what it would "
                        "have been without the restart", name, at, first)
    role.checkpoints.discard_after(first - 1)  # of another timeline from its round on
    _log_rejoin(island, role, at, first, "view")
    return first, (list(rounds) if len(set(rounds)) > 1 else None), True, None


def _replay_plan(config, island: Island, role: RoleFolder, at: int, resume: bool, reply: dict) -> ReplayPlan | None:
    """With `outer.rejoin = "replay"`: the island restored to its newest checkpoint (or, resumed at a round
    boundary, its state now) from which the coordinator kept every fragment's round up to the one it is
    admitted at, and the plan to replay them; None (nothing changed) when none is kept from any, or
    `outer.rejoin = "view"`."""
    kept, target, fragments = reply.get("kept") or [], reply["round"], len(island.partition)
    if config.outer.get("rejoin", "replay") != "replay" or not kept:
        return None
    saved = [r for r in role.checkpoints.rounds(wait=True) if r <= target]
    candidates = sorted(set(saved) | ({at} if resume and at <= target else set()), reverse=True)
    for start in island.agree(ReplayPlan.starts(kept, candidates, target, fragments))[0]:
        if not (resume and start == at):
            try:
                island.load_state(role.checkpoints.restore(island.state(0, template=True), round=start))
            except CheckpointCorrupt:  # logged and moved aside: an older one, if kept
                continue
        role.checkpoints.discard_after(start)  # the rounds after it are trained again, and saved again
        what = f"rounds {start + 1}..{target}" if start < target else f"the fragments of round {start + 1} merged"
        logging.warning("island %s replays %s from its checkpoint of round %d with the coordinator's kept updates, "
                        "each contribution checked against the digest merged", island.name, what, start)
        return ReplayPlan(kept, start, target, fragments, island.tokens_per_step)
    rounds = sorted({k["round"] for k in kept})
    logging.warning("island %s cannot replay: the coordinator keeps rounds %d..%d, and no checkpoint of the island "
                    "(%s) starts where they cover every round up to %d; it takes the view", island.name,
                    rounds[0] + 1, rounds[-1] + 1, saved or "none", target)
    return None


def _log_rejoin(island: Island, role: RoleFolder, at: int, round: int, source: str, **fields) -> None:
    """A `rejoin` record: the island's state after `round` rounds is now the coordinator's (`source`: "view",
    its own "checkpoint" of that round, or a "replay" of the rounds after `at`, whose `replayed` count it
    holds), replacing what it held after `at` rounds; `checksum` of what it holds; `fields` (`reason`: why a
    replay ended in the view). Round records logged before it of rounds from `round` on describe the replaced
    state."""
    role.metrics.write(dict(kind="rejoin", round=round, source=source, rounds_before=at,
                            checksum=island.global_checksum, **fields))


def _train_rounds(config, island: Island, sync: StreamingSync, role: RoleFolder, evaluators, first: int, stop,
                  fingerprint: dict) -> None:
    """The round loop: train, log, evaluate and checkpoint when due; stops before a round once `stop` is set."""
    name, rounds, cfg = island.name, config.outer.rounds, config.islands[island.name]
    coordinator_every, _ = checkpoint_schedule(config, coordinator=True)
    eta = Eta(rounds)
    r = first  # the round being trained (0-based)
    while r < rounds:
        if stop is not None and stop.is_set():
            raise RunAborted(f"island {name} stopped before round {r + 1} (the run was stopped)")
        if cfg.crash_at_round == r + 1:
            raise RuntimeError(f"island {name} crashes at round {r + 1} on purpose (islands.{name}.crash_at_round)")
        replayed = _replay_progress(island, sync, role, r)
        step0 = island.step
        # At the island's own rounds and the coordinator's (which it rolls back to after a coordinator restart);
        # a checkpoint holds no exchange in flight: every update of the round is applied first.
        checkpoint_due = r + 1 == rounds or island_saves(r + 1, coordinator_every, config.checkpoint.every_rounds)
        try:
            result = sync.run_round(r, drain=checkpoint_due)
        except CoordinatorRestarted as e:
            logging.warning("island %s: %s", name, e)
            sync.forget_inflight(timeout=config.comm.reconnect_seconds)
            sync.end_replay()
            r, fragment_rounds, _, plan = align(config, island, sync.transport, role, r, False, fingerprint)
            sync.restart(r, fragment_rounds)
            if plan is not None:
                sync.replay_from(plan)
            continue
        lrs = learning_rates(island.tx, step0, result["steps"])  # from the schedule the steps' updates read
        for j in range(result["steps"]):
            role.metrics.write(dict(
                kind="inner", round=r + 1, step=step0 + j + 1, **{k: result[k][j] for k in STEP_METRICS},
                learning_rate=lrs[j], moe=result["layers"][j], tokens_per_second=result["tokens"] / result["seconds"],
            ))
        why = None
        if sync.rejoined_round is not None:  # more than a round behind, or a replay that ended: from the view
            why = sync.rejoin_reason
            fields = {} if why is None else dict(reason=why, replayed=r - sync.replay_start)
            _log_rejoin(island, role, r + 1, sync.rejoined_round, "view", **fields)
            r, sync.rejoined_round, sync.rejoin_reason = sync.rejoined_round - 1, None, None  # the view's rounds
            replayed = False
        record = _round_record(island, result, r)
        if replayed:
            record["replayed"] = True
        if why is not None:
            record["rejoin"] = f"view ({short_reason(why)})"
        if island.multi_process:
            _agree_on_round(island, record, r)
        if evaluators and due(r + 1, config.eval.every_rounds, rounds):
            with sync.between_rounds("eval"):
                for evaluator in evaluators:
                    scored = evaluator(r + 1)
                    k = evaluator.kind
                    record.update({f"{k}_loss": scored[f"{k}_loss"], f"{k}_loss_stderr": scored[f"{k}_loss_stderr"],
                                   f"{k}_bits_per_byte": scored[f"{k}_bits_per_byte"]})
        role.metrics.write(record)
        if checkpoint_due:
            with sync.between_rounds("checkpoint"):
                state = island.state(r + 1)
                saved = role.checkpoints.save(r + 1, state, force=True)
            if saved:
                checksums = {k: checksum(v) for k, v in state.items()}  # shard by shard (a collective over processes)
                role.metrics.write(dict(kind="checkpoint", round=r + 1, checksums=checksums))
        logging.info(
            "island %s round %d/%d | loss %.4f | eval %s | sent/received %.2f/%.2f MB | compute %.1f s, blocked "
            "%.1f s, idle %.1f s (before it: eval %.1f s, save %.1f s) | utilization %.3f | MFU %.2f%% | tau %d | "
            "ETA %s",
            name, r + 1, rounds, record["train_loss"], f"{record['eval_loss']:.4f}" if "eval_loss" in record else "-",
            record["bytes_sent"] / 1e6, record["bytes_received"] / 1e6, result["compute_seconds"],
            result["seconds_blocked"], result["idle_seconds"], result["eval_seconds"], result["checkpoint_seconds"],
            result["compute_utilization"], 100 * result["mfu"], result["overlap_steps"], eta.after(r + 1),
        )
        allocator.trim()  # what the round's exchange, eval and checkpoint freed goes back to the kernel
        r += 1


def _replay_progress(island: Island, sync: StreamingSync, role: RoleFolder, r: int) -> bool:
    """Before round `r` (0-based) of an island replaying: ends the replay once `r` is the run's round (a `rejoin`
    record of source "replay"), or tells the coordinator which round it recomputes. Returns whether round `r` is
    replayed whole."""
    plan = sync.replay
    if plan is None:
        return False
    if r >= plan.target:
        logging.warning("island %s replayed from its checkpoint of round %d to round %d, to the bits merged; it "
                        "trains on with the run", island.name, plan.start, plan.target)
        _log_rejoin(island, role, plan.start, plan.target, "replay", replayed=plan.target - plan.start)
        sync.end_replay()
        return False
    if island.part == 0:
        sync.transport.replaying(island.name, r)
    return plan.whole_round(r)


def _agree_on_round(island: Island, record: dict, r: int) -> None:
    """Of an island of several processes: checks that they hold the same global parameters after round `r`
    (0-based), and books the island's bytes as all its processes moved them (`process_*` fields: per process,
    in process order; `bytes_sent`, `bytes_received` and `payload_bytes`: their sums).

    Each process holds only its shards, so the checksum (`global_checksum`) is computed by all of them together,
    and the shards that several processes hold (replicas over `data`) are compared by their digests.

    Raises:
      RuntimeError: two processes hold different bits of one shard (the leaf and the processes are named).
    """
    shared = island.agree([island.global_checksum, record["bytes_sent"], record["bytes_received"],
                           record["payload_bytes"], island.replica_digests()])
    checksums = [c for c, *_ in shared]
    seen: dict[str, tuple[int, str]] = {}
    for p, (*_, digests) in enumerate(shared):
        for shard, digest in digests.items():
            first = seen.setdefault(shard, (p, digest))
            if first[1] != digest:
                raise RuntimeError(f"island {island.name}: after round {r + 1} processes {first[0]} and {p} hold "
                                   f"different bits of shard {shard} (leaf, shard); the update was not applied alike")
    _, sent, received, payload, _ = zip(*shared)
    record.update(
        process_checksums=checksums, process_bytes_sent=list(sent), process_bytes_received=list(received),
        process_payload_bytes=list(payload), bytes_sent=sum(sent), bytes_received=sum(received),
        payload_bytes=sum(payload), checksum=checksums[0],  # computed already: not again on the metrics thread
    )


def _round_record(island: Island, result: dict, r: int) -> dict:
    """The island's metrics record of round `r` (0-based); see `StreamingSync.run_round` for the fields."""
    # Without an outer loop the run's parameters are the island's own (copied now: the next step donates them).
    params = island.global_params if island.config.outer.enabled else island.host_shards(island.params)
    return dict(
        kind="round",
        round=r + 1,
        inner_steps=result["steps"],
        train_loss=float(np.mean(result["cross_entropy"])),
        tokens=result["tokens"],
        busy_seconds=result["busy_seconds"],
        step_seconds=result["step_seconds"],
        compute_step_seconds=result["compute_step_seconds"],
        mfu=result["mfu"],
        **{k: result[k] for k in ACCOUNTING_FIELDS},
        achieved_gbps=gbps(result["bytes_sent"] + result["bytes_received"], result["seconds_transferring"]),
        checksum=functools.partial(checksum, params),  # computed by the metrics thread
        expert_load=result["expert_load"],
        **({"learning_rate_held": True} if r + 1 > island.total_rounds else {}),
    )
