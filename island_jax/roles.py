"""One role of a multi-process run: the coordinator, or one island, over gRPC.

A cluster launch (or `launch/local.py` on one machine) starts
`run_coordinator` once and `run_island` once per `config.islands` entry, each
in its own process with its own JAX runtime. The island, codec, coordinator and
outer step are those of the in-process run (`island_jax.train`); only the
transport differs. Each role keeps its whole state in its folder of the workdir:

  WORKDIR/coordinator/     config.json, metrics.jsonl, TensorBoard events,
                           checkpoints/ (master, outer optimizer state, view, round),
                           summary.json
  WORKDIR/islands/NAME/    config.json, metrics.jsonl, TensorBoard events,
                           checkpoints/ (params, anchor, AdamW state, data position,
                           round), summary.json

Restarting a role with the same workdir resumes from its newest checkpoint;
the handshake checks that every role resumed at the same round with the same
parameters. `combine_summaries` writes `WORKDIR/summary.json` from all roles.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from island_jax import config as config_lib
from island_jax import data as data_lib
from island_jax.checkpoint import Checkpointer
from island_jax.comm.client import GrpcTransport
from island_jax.comm.link import LinkEmulator
from island_jax.comm.server import serve
from island_jax.coordinator import FragmentedCoordinator
from island_jax.island import STEP_METRICS, Island
from island_jax.metrics import MetricsWriter, format_eta, read_jsonl, write_json
from island_jax.params import checksum, count, init_params
from island_jax.plots import plot_timeline
from island_jax.streaming import ACCOUNTING_FIELDS, EventLog, StreamingSync


def coordinator_dir(workdir: str) -> str:
    return os.path.join(workdir, "coordinator")


def island_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "islands", name)


def _open_role(config: ml_collections.ConfigDict, folder: str) -> tuple[Checkpointer, MetricsWriter]:
    """Checkpointer and metrics of a role's folder; refuses a folder with metrics but no checkpoint."""
    checkpoints = Checkpointer(
        os.path.join(folder, "checkpoints"), config.checkpoint.every_rounds, config.checkpoint.max_to_keep
    )
    if checkpoints.latest_round() is None and os.path.exists(os.path.join(folder, "metrics.jsonl")):
        raise FileExistsError(
            f"{folder} holds metrics of a run but no checkpoint to resume from; pass a new --workdir, or move that "
            "one away first, so that nothing it holds is overwritten"
        )
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):  # a resumed role keeps the config it started with
        with open(path, "w", encoding="utf-8") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    return checkpoints, MetricsWriter(folder, tensorboard=True, background=True)


def run_coordinator(config: ml_collections.ConfigDict, workdir: str, address: str) -> dict:
    """Serves the exchange on `address` until every island has the last round's update.

    Args:
      config: the run's config (validated here).
      workdir: the run's folder; this role writes under `workdir/coordinator`.
      address: HOST:PORT to listen on (port 0: any free port, logged).

    Returns:
      The role's summary (also `coordinator/summary.json`): `rounds`, `params`,
      `codec`, `block_size`, `update_bytes` (payload bytes per round),
      `wire_bytes.NAME.{sent, received}` (serialized messages, handshake excluded),
      `wall_seconds`.

    Raises:
      ConfigError, FileExistsError, CheckpointError; TimeoutError if a round is
      not merged within `comm.round_timeout_seconds`.
    """
    config_lib.validate(config)
    start = time.perf_counter()
    folder = coordinator_dir(workdir)
    os.makedirs(folder, exist_ok=True)
    checkpoints, metrics = _open_role(config, folder)
    names, rounds = list(config.islands.keys()), config.outer.rounds
    _, params, _ = init_params(config)
    coordinator = FragmentedCoordinator(config, params, names)
    if checkpoints.latest_round() is not None:
        coordinator.load_state(checkpoints.restore(coordinator.state()))
        logging.info("resumed from the checkpoint of round %d (view checksum %s)", coordinator.round, coordinator.checksum)
    first = coordinator.round
    if first >= rounds:
        logging.info("the run is complete (%d of %d rounds); nothing to do", first, rounds)
        return {}
    server, service, port = serve(coordinator, address, config.comm.chunk_bytes)
    logging.info(
        "coordinator serving on %s:%d for islands %s (%d parameters, %s payloads of %d bytes); health: SERVING",
        address.rsplit(":", 1)[0], port, names, count(params), config.codec.kind, service.payload_bytes,
    )
    last = time.perf_counter()
    try:
        for r in range(first, rounds):
            for p, fragment in enumerate(coordinator.fragments):
                with service.lock:
                    deadline = time.monotonic() + config.comm.round_timeout_seconds
                    while fragment.round <= r and time.monotonic() < deadline:
                        if coordinator.poll():  # closes a round once a quorum's grace window has passed
                            service.notify()
                        else:
                            service.lock.wait(timeout=0.5)
                    if fragment.round <= r:
                        raise TimeoutError(
                            f"round {r + 1} of fragment {p} was not merged within comm.round_timeout_seconds="
                            f"{config.comm.round_timeout_seconds}; contributions came from "
                            f"{sorted(fragment._pending)} of {names}"
                        )
                    rec = next(h for h in reversed(fragment.history) if h.round == r)
                    received = {k: v["received"] for k, v in service.wire_bytes.items()}
                    view_checksum = rec.checksum
                now = time.perf_counter()
                metrics.write(
                    dict(
                        kind="round",
                        round=r + 1,
                        fragment=p,
                        contributors=rec.contributors,
                        tokens=rec.tokens,
                        weights=rec.weights,
                        pseudo_gradient_norm=rec.pseudo_gradient_norm,
                        cosine_similarity=rec.cosine_similarity,
                        update_bytes=rec.update_bytes,
                        update_codec_relative_error=rec.update_codec_relative_error,
                        wire_bytes_received=received,
                        checksum=view_checksum,
                        seconds=now - last,
                    )
                )
                last = now
                logging.info(
                    "round %d/%d%s merged | weights %s | pseudo-gradient norms %s | cosine %s",
                    r + 1, rounds, f" fragment {p}" if len(coordinator) > 1 else "",
                    " ".join(f"{k}={v:.3f}" for k, v in rec.weights.items()),
                    " ".join(f"{k}={v:.4f}" for k, v in rec.pseudo_gradient_norm.items()),
                    " ".join(f"{k}={v:.3f}" for k, v in rec.cosine_similarity.items()) or "-",
                )
            if (r + 1) % config.checkpoint.every_rounds == 0 or r + 1 == rounds:
                with service.lock:
                    # Islands apply every update of a checkpoint round before they contribute again,
                    # so no fragment has moved on yet.
                    state = coordinator.state() if coordinator.round == r + 1 == max(
                        f.round for f in coordinator.fragments) else None
                if state is None:
                    logging.warning("round %d: a fragment moved on before the checkpoint; not saved", r + 1)
                elif checkpoints.save(r + 1, state, force=r + 1 == rounds):
                    # What the checkpoint holds, so a restore can be checked bit for bit.
                    metrics.write(dict(kind="checkpoint", round=r + 1, checksums=_state_checksums(state)))
        # Every island that contributed to the last round receives its update (a quorum may have left some out).
        last = [n for f in coordinator.fragments for n in f.history[-1].contributors]
        if not service.wait_until_fetched(rounds - 1, set(last), timeout=config.comm.round_timeout_seconds):
            raise TimeoutError(f"not every island fetched the update of round {rounds} in time")
    finally:
        server.stop(grace=5.0)
        metrics.close()
        checkpoints.close()
    summary = dict(
        rounds=rounds,
        params=count(params),
        codec=config.codec.kind,
        block_size=config.codec.block_size,
        update_bytes=service.payload_bytes,
        wire_bytes=service.wire_bytes,
        checksum=coordinator.checksum,
        wall_seconds=time.perf_counter() - start,
    )
    write_json(os.path.join(folder, "summary.json"), summary)
    logging.info("coordinator done after %d rounds in %.1f s", rounds, summary["wall_seconds"])
    return summary


def run_island(config: ml_collections.ConfigDict, workdir: str, name: str, address: str) -> dict:
    """Trains island `name` on this process's devices, exchanging with the coordinator at `address`.

    The first island of `config.islands` also evaluates the global parameters
    (every `eval.every_rounds` and after the last round).

    Args:
      config: the run's config (validated here).
      workdir: the run's folder; this role writes under `workdir/islands/NAME`.
      name: a key of `config.islands`; the process needs its `num_devices` devices.
      address: the coordinator's HOST:PORT.

    Returns:
      The role's summary (also in its folder): `summarize_island`'s totals,
      `process_seconds` (start-up, compilation and the first evaluation
      included) and for the evaluating island `corpus`. Rounds are driven by
      `streaming.StreamingSync` (fragments, overlap, accounting); every span
      of the island goes to `events.jsonl`.

    Raises:
      ConfigError, DataError, HandshakeError, ContributionError, ExchangeError,
      FileExistsError, CheckpointError; RuntimeError at `crash_at_round`.
    """
    config_lib.validate(config, num_available_devices=len(jax.devices()), island=name)
    start = time.perf_counter()
    folder = island_dir(workdir, name)
    os.makedirs(folder, exist_ok=True)
    checkpoints, metrics = _open_role(config, folder)
    names, rounds, cfg = list(config.islands.keys()), config.outer.rounds, config.islands[name]
    corpus = data_lib.load_corpus(config.data.files, config.data.eval_fraction, names)
    graphdef, params, specs = init_params(config)
    island = Island(name, config, jax.devices()[: cfg.num_devices], graphdef, params, specs, corpus.train_bytes[name], rounds)
    first = 0
    if checkpoints.latest_round() is not None:
        first = island.load_state(checkpoints.restore(island.state(0)))
        logging.info("island %s resumed from the checkpoint of round %d (step %d)", name, first, island.step)
    if first >= rounds:
        logging.info("the run is complete (%d of %d rounds); nothing to do", first, rounds)
        return {}
    island.warm_up()  # compiles before the first round's clock starts
    link = LinkEmulator.from_config(config)
    transport = GrpcTransport(
        address, config.comm.chunk_bytes, config.comm.join_timeout_seconds, config.comm.round_timeout_seconds,
        connections=config.comm.connections, pipeline=config.comm.pipeline, link=link,
    )
    if link is not None:
        logging.info(
            "island %s: emulated link %.3g Gbit/s, %.3g ms one way, window %d bytes (one connection: %.3g Gbit/s; "
            "%d connections fill it, comm.connections=%d)", name, link.bandwidth_gbps, link.latency_ms,
            link.window_bytes, link.one_connection_gbps(), link.connections_needed(), config.comm.connections,
        )
    transport.join(name, config_lib.fingerprint_fields(config), island.global_checksum, first)
    logging.info(
        "island %s joined the coordinator at %s at round %d: %d devices (data=%d x expert=%d), batch %d, H=%d",
        name, address, first, cfg.num_devices, cfg.mesh.data, cfg.mesh.expert, cfg.batch_size, island.inner_steps,
    )
    evaluator = name == names[0]
    eval_batches = eval_loss = None
    if evaluator:
        eval_batches = data_lib.eval_batches(
            corpus.eval_bytes, config.model.seq_len, config.eval.batch_size, config.eval.num_batches
        )
        eval_loss = island.evaluate(eval_batches)
        if first == 0:
            metrics.write(dict(kind="eval", round=0, eval_loss=eval_loss))
        logging.info("round %d: eval loss %.4f nats/byte", first, eval_loss)
    # Every island starts its first round at the same moment (the evaluator evaluated first).
    transport.start_together(name, config_lib.fingerprint_fields(config), island.global_checksum, first)
    timed_start = None
    events = EventLog(os.path.join(folder, "events.jsonl"), name)
    sync = StreamingSync(island, transport, config, first, link=link, events=events)
    try:
        r = first  # the round being trained (0-based)
        while r < rounds:
            if cfg.crash_at_round == r + 1:
                raise RuntimeError(f"island {name} crashes at round {r + 1} on purpose (islands.{name}.crash_at_round)")
            step0 = island.step
            checkpoint_due = (r + 1) % config.checkpoint.every_rounds == 0 or r + 1 == rounds
            # A checkpoint holds no exchange in flight: every update of the round is applied first.
            result = sync.run_round(r, drain=checkpoint_due)
            for j in range(result["steps"]):
                metrics.write(
                    dict(
                        kind="inner",
                        round=r + 1,
                        step=step0 + j + 1,
                        **{k: result[k][j] for k in STEP_METRICS},
                        moe=result["layers"][j],
                        tokens_per_second=result["tokens"] / result["seconds"],
                    )
                )
            if sync.rejoined_round is not None:  # more than a round behind: rejoined from the view
                r, sync.rejoined_round = sync.rejoined_round - 1, None  # the rounds completed are now the view's
            record = dict(
                kind="round",
                round=r + 1,
                inner_steps=result["steps"],
                train_loss=float(np.mean(result["cross_entropy"])),
                tokens=result["tokens"],
                busy_seconds=result["busy_seconds"],
                step_seconds=result["step_seconds"],
                **{k: result[k] for k in ACCOUNTING_FIELDS},
                achieved_gbps=(result["bytes_sent"] + result["bytes_received"]) * 8 / result["seconds_transferring"] / 1e9
                if result["seconds_transferring"] else 0.0,
                checksum=functools.partial(checksum, island.global_params),  # computed by the metrics thread
                expert_load=result["expert_load"],
            )
            if evaluator and ((r + 1) % config.eval.every_rounds == 0 or r + 1 == rounds):
                with sync.between_rounds("eval"):
                    eval_loss = island.evaluate(eval_batches, global_params=True)
                metrics.write(dict(kind="eval", round=r + 1, eval_loss=eval_loss))
                record["eval_loss"] = eval_loss
            metrics.write(record)
            if checkpoint_due:
                with sync.between_rounds("checkpoint"):
                    state = island.state(r + 1)
                    saved = checkpoints.save(r + 1, state, force=r + 1 == rounds)
                if saved:
                    metrics.write(
                        dict(kind="checkpoint", round=r + 1, checksums={k: checksum(jax.device_get(v)) for k, v in state.items()})
                    )
            eta = "after round 2"
            if timed_start is not None:
                eta = format_eta((time.perf_counter() - timed_start) / max(r - first, 1) * (rounds - r - 1))
            logging.info(
                "round %d/%d | loss %.4f | eval %s | sent/received %.2f/%.2f MB | compute %.1f s, blocked %.1f s, "
                "idle %.1f s (before it: eval %.1f s, save %.1f s) | utilization %.3f | tau %d | ETA %s",
                r + 1, rounds, record["train_loss"], f"{eval_loss:.4f}" if eval_loss is not None else "-",
                record["bytes_sent"] / 1e6, record["bytes_received"] / 1e6, result["compute_seconds"],
                result["seconds_blocked"], result["idle_seconds"], result["eval_seconds"], result["checkpoint_seconds"],
                result["compute_utilization"],
                result["overlap_steps"], eta,
            )
            if timed_start is None:
                timed_start = time.perf_counter()  # rounds after the first carry no compilation
            r += 1
    finally:
        sync.close()
        events.close()
        metrics.close()
        checkpoints.close()
        transport.close()
    summary = summarize_island(folder)
    summary.update(process_seconds=time.perf_counter() - start)  # start-up, compilation and evaluation included
    if evaluator:
        summary["corpus"] = corpus.fingerprint
    write_json(os.path.join(folder, "summary.json"), summary)
    return summary


_SUMMED = (
    "inner_steps", "tokens", "bytes_sent", "bytes_received", "compute_seconds", "seconds_blocked", "idle_seconds",
    "wall_seconds", "ideal_compute_seconds", "seconds_transferring", "waits", "eval_seconds", "checkpoint_seconds",
)


def _state_checksums(state: dict) -> dict:
    """{name: checksum} of a coordinator checkpoint's parts (per fragment: `fragments/P/NAME`)."""
    return {
        f"fragments/{p}/{k}": checksum(v) for p, part in enumerate(state["fragments"]) for k, v in part.items()
    }


def summarize_island(folder: str) -> dict:
    """Totals of an island's `metrics.jsonl` over the whole run, resumed parts included.

    A round logged twice (after a crash, a resumed run trains it again) counts
    once, with its latest record. Returns `rounds` (completed), the sums of
    `inner_steps`, `tokens`, `bytes_sent`, `bytes_received` (bytes), `waits`,
    `wall_seconds` (of the rounds; every second is one of `compute_seconds`,
    `seconds_blocked` or `idle_seconds`), `eval_seconds` and
    `checkpoint_seconds` (between rounds, outside their wall seconds; the
    evaluation and save after the last round are in `process_seconds` only),
    `ideal_compute_seconds` (per round,
    inner steps x the step time with no exchange in flight),
    `compute_utilization` (ideal compute / wall), `seconds_transferring`,
    `achieved_gbps` (all bytes moved x 8 / seconds_transferring), the last `checksum`, and when the
    island evaluated, `eval_loss_initial` (round 0) and `eval_loss_final`.
    """
    rounds, evals = {}, {}
    for rec in read_jsonl(os.path.join(folder, "metrics.jsonl")):
        if rec.get("kind") == "round":
            rounds[rec["round"]] = rec
        elif rec.get("kind") == "eval":
            evals[rec["round"]] = rec["eval_loss"]
    summary = {key: sum(rec.get(key, 0) for rec in rounds.values()) for key in _SUMMED}
    # per round, inner steps x the step time measured with no exchange in flight; over the wall seconds
    wall = summary["wall_seconds"]
    summary["compute_utilization"] = summary["ideal_compute_seconds"] / wall if wall else 0.0
    moved = summary["bytes_sent"] + summary["bytes_received"]
    summary["achieved_gbps"] = moved * 8 / summary["seconds_transferring"] / 1e9 if summary["seconds_transferring"] else 0.0
    summary.update(rounds=max(rounds, default=0), checksum=rounds[max(rounds)]["checksum"] if rounds else None)
    if evals:
        summary.update(eval_loss_initial=evals.get(0), eval_loss_final=evals[max(evals)])
    return summary


def combine_summaries(config: ml_collections.ConfigDict, workdir: str, wall_seconds: float) -> dict:
    """`WORKDIR/summary.json` from every role's folder, as the in-process run writes it.

    Returns:
      `rounds`, `params`, `codec`, `block_size`, `corpus`, `eval_loss_initial`,
      `eval_loss_final` (nats per byte, from the evaluating island),
      `wall_seconds` (the caller's), `checksums_agree` (every island's final
      global parameters equal the coordinator's view), and
      `islands.NAME.{inner_steps, tokens, bytes_sent, bytes_received,
      compute_seconds, seconds_blocked, idle_seconds, wall_seconds, eval_seconds, checkpoint_seconds,
      ideal_compute_seconds, waits,
      seconds_transferring, achieved_gbps, compute_utilization, mean_weight (its share of a merge,
      averaged over rounds), rounds_merged}`; and draws `WORKDIR/timeline.png` from the islands' events.

    Raises:
      FileNotFoundError: a role left no summary (it did not finish).
    """
    with open(os.path.join(coordinator_dir(workdir), "summary.json"), encoding="utf-8") as f:
        coordinator = json.load(f)
    islands = {}
    for name in config.islands.keys():
        with open(os.path.join(island_dir(workdir, name), "summary.json"), encoding="utf-8") as f:
            islands[name] = json.load(f)
    evaluator = islands[next(iter(config.islands.keys()))]
    merged = {}  # round -> the coordinator's record (a resumed run logs some rounds twice)
    for rec in read_jsonl(os.path.join(coordinator_dir(workdir), "metrics.jsonl")):
        if rec.get("kind") == "round":
            merged[rec["round"]] = rec
    summary = dict(
        rounds=coordinator["rounds"],
        params=coordinator["params"],
        codec=coordinator["codec"],
        block_size=coordinator["block_size"],
        corpus=evaluator.get("corpus"),
        eval_loss_initial=evaluator.get("eval_loss_initial"),
        eval_loss_final=evaluator.get("eval_loss_final"),
        wall_seconds=wall_seconds,
        checksums_agree=all(s["checksum"] == coordinator["checksum"] for s in islands.values()),
        islands={
            name: dict(
                {k: s[k] for k in (*_SUMMED, "achieved_gbps", "compute_utilization")},
                # the share of each round's merge, averaged over rounds (0 for a round it missed)
                mean_weight=sum(r["weights"].get(name, 0.0) for r in merged.values()) / max(len(merged), 1),
                rounds_merged=sum(name in r["weights"] for r in merged.values()),
            )
            for name, s in islands.items()
        },
    )
    write_json(os.path.join(workdir, "summary.json"), summary)
    events = [os.path.join(island_dir(workdir, n), "events.jsonl") for n in config.islands.keys()]
    events = [p for p in events if os.path.exists(p) and os.path.getsize(p)]
    if events:
        plot_timeline(events, os.path.join(workdir, "timeline.png"))
    return summary
