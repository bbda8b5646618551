"""`train_and_evaluate(config, workdir)`: every island and the coordinator in one process.

The islands run on threads of their own, on their own slices of this
process's devices (one island's device work at a time), and reach the
coordinator through the in-process transport; the multi-process launch swaps
only the transport. Writes to `workdir`:
`config.json`, `metrics.jsonl` (inner steps, rounds, evaluations) and
`summary.json`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from island_jax import config as config_lib
from island_jax import data as data_lib
from island_jax.comm.link import LinkEmulator
from island_jax.comm.transport import InProcessTransport, IslandAborted
from island_jax.coordinator import FragmentedCoordinator
from island_jax.island import STEP_METRICS, Island
from island_jax.metrics import MetricsWriter, format_eta, read_jsonl, write_json
from island_jax.outer import codec
from island_jax.params import checksum, count, init_params
from island_jax.plots import plot_timeline
from island_jax.streaming import ACCOUNTING_FIELDS, EventLog, StreamingSync


def build_islands(config: ml_collections.ConfigDict, corpus: data_lib.Corpus, graphdef, params, specs) -> list[Island]:
    """One Island per `config.islands` entry, each on its own consecutive slice of `jax.devices()`."""
    devices, islands, start = jax.devices(), [], 0
    for name, cfg in config.islands.items():
        island_devices = devices[start : start + cfg.num_devices]
        start += cfg.num_devices
        islands.append(
            Island(name, config, island_devices, graphdef, params, specs, corpus.train_bytes[name], config.outer.rounds)
        )
    return islands


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains the model with the DiLoCo outer loop (or none) and evaluates it.

    With the outer loop, every island trains on a thread of its own, driven by
    `streaming.StreamingSync` (Streaming DiLoCo's fragments and overlap; plain
    DiLoCo with `outer.fragments = 1`, `outer.overlap_steps = 0`).

    Args:
      config: see `island_jax.config`; validated here before anything compiles.
      workdir: output folder (created).

    Returns:
      The summary, also written to `workdir/summary.json`: `rounds`, `params`,
      `codec`, `block_size`, `corpus` (fingerprint), `eval_loss_initial`,
      `eval_loss_final` (nats per byte on the held-out files), `wall_seconds`,
      and `islands.NAME.{inner_steps, tokens, bytes_sent, bytes_received}`
      (payload bytes), with the outer loop also `compute_seconds`,
      `seconds_blocked`, `idle_seconds`, `wall_seconds`, `ideal_compute_seconds`,
      `eval_seconds`, `checkpoint_seconds` and `compute_utilization` (see
      `streaming.StreamingSync`). The islands'
      spans go to `events_NAME.jsonl` and `timeline.png`.

    Raises:
      ConfigError: on an invalid config (before compiling).
      HandshakeError: if an island's initial parameters differ from the coordinator's.
      RuntimeError: if islands end a round holding different global parameters.
      FileExistsError: if `workdir` already holds a run.
    """
    config_lib.validate(config, num_available_devices=len(jax.devices()))
    start = time.perf_counter()
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        raise FileExistsError(
            f"workdir {workdir} already holds a run (metrics.jsonl); pass a new --workdir, or move that one "
            "away first, so that nothing it holds is overwritten"
        )
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    metrics = MetricsWriter(workdir)

    names = list(config.islands.keys())
    corpus = data_lib.load_corpus(config.data.files, config.data.eval_fraction, names)
    logging.info("corpus: %s", corpus.fingerprint)
    eval_batches = data_lib.eval_batches(
        corpus.eval_bytes, config.model.seq_len, config.eval.batch_size, config.eval.num_batches
    )
    graphdef, params, specs = init_params(config)
    num_params = count(params)
    islands = build_islands(config, corpus, graphdef, params, specs)
    transport = None
    links = {name: LinkEmulator.from_config(config) for name in names}
    if config.outer.enabled:
        transport = InProcessTransport(FragmentedCoordinator(config, params, names), links, config.comm.connections)
        for isl in islands:
            transport.join(isl.name, config_lib.fingerprint_fields(config), isl.global_checksum)
    wire_bytes = codec.payload_bytes(params, config.codec.kind, config.codec.block_size)
    logging.info(
        "%d parameters; islands %s; %s",
        num_params,
        {i.name: dict(devices=len(i.mesh.devices.flat), batch=i.batch_size, inner_steps=i.inner_steps) for i in islands},
        f"codec {config.codec.kind} ({wire_bytes} bytes per payload)" if transport else "no outer loop",
    )

    evaluator = islands[0]
    eval_initial = evaluator.evaluate(eval_batches)
    metrics.write(dict(kind="eval", round=0, eval_loss=eval_initial))
    logging.info("round 0: eval loss %.4f nats/byte", eval_initial)
    totals = {i.name: dict(inner_steps=0, tokens=0, bytes_sent=0, bytes_received=0) for i in islands}
    rounds = config.outer.rounds
    if transport is None:
        for r in range(rounds):
            _log_round(config, metrics, islands, {islands[0].name: islands[0].train_round()}, r, totals, None, eval_batches)
        eval_loss = _last_eval(workdir, eval_initial)
    else:
        eval_loss = _train_islands_in_threads(config, workdir, metrics, islands, transport, links, totals, eval_batches)
        eval_loss = eval_initial if eval_loss is None else eval_loss
    metrics.close()
    summary = dict(
        rounds=rounds,
        params=num_params,
        codec=config.codec.kind,
        block_size=config.codec.block_size,
        corpus=corpus.fingerprint,
        eval_loss_initial=eval_initial,
        eval_loss_final=eval_loss,
        wall_seconds=time.perf_counter() - start,
        islands=totals,
    )
    write_json(os.path.join(workdir, "summary.json"), summary)
    events = [os.path.join(workdir, f"events_{n}.jsonl") for n in names]
    events = [p for p in events if os.path.exists(p) and os.path.getsize(p)]
    if events:
        plot_timeline(events, os.path.join(workdir, "timeline.png"))
    logging.info("done in %.1f s: eval loss %.4f -> %.4f nats/byte", summary["wall_seconds"], eval_initial, eval_loss)
    return summary


def _train_islands_in_threads(config, workdir, metrics, islands, transport, links, totals, eval_batches):
    """Every island on a thread of its own, each driven by a `StreamingSync` (fragments, overlap, accounting).

    The islands meet after every round; then the round is logged, evaluated,
    and, when no update is in flight (tau = 0, or after the last round), every
    island's parameters are checked against the coordinator's view. One lock
    keeps a single island's device work running at a time (XLA:CPU's
    in-process collectives), so the islands' compute is serialized here and
    only a multi-process launch shows real overlap.

    Returns:
      The last eval loss (None if none was taken).
    """
    rounds = config.outer.rounds
    device_lock = threading.Lock()
    syncs = {}
    for isl in islands:
        isl.device_lock = device_lock
        isl.warm_up()
        events = EventLog(os.path.join(workdir, f"events_{isl.name}.jsonl"), isl.name)
        syncs[isl.name] = StreamingSync(isl, transport, config, 0, link=links[isl.name], events=events)
    results: dict[str, dict] = {}
    state = dict(eval_loss=None, start=time.perf_counter(), second=None, round=0)
    errors: list[BaseException] = []

    def evaluating():  # every island waits while one evaluates: evaluation time for each
        stack = contextlib.ExitStack()
        for sync in syncs.values():
            stack.enter_context(sync.between_rounds("eval"))
        return stack

    def after_round():  # one thread runs it while the others wait at the barrier
        r = state["round"]
        in_flight = any(s.inflight for s in syncs.values())
        eval_loss = _log_round(
            config, metrics, islands, dict(results), r, totals, None if in_flight else transport, eval_batches,
            state, global_params=True, evaluating=evaluating,
        )
        if eval_loss is not None:
            state["eval_loss"] = eval_loss
        state["round"] = r + 1

    barrier = threading.Barrier(len(islands), action=after_round)

    def work(isl):
        sync = syncs[isl.name]
        try:
            for r in range(rounds):
                results[isl.name] = sync.run_round(r, drain=r + 1 == rounds)
                barrier.wait()
        except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
            errors.append(e)
            barrier.abort()
            transport.abort(f"island {isl.name} failed: {e!r}")

    threads = [threading.Thread(target=work, args=(isl,), name=f"island-{isl.name}") for isl in islands]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sync in syncs.values():
        sync.close()
        sync.events.close()
    real = [e for e in errors if not isinstance(e, (threading.BrokenBarrierError, IslandAborted))]
    if real or errors:
        raise (real or errors)[0]
    return state["eval_loss"]


def _log_round(
    config, metrics, islands, results, r, totals, transport, eval_batches, state=None, global_params=False,
    evaluating=contextlib.nullcontext,
):
    """Writes round `r`'s inner-step and round records, evaluates when due (inside `evaluating()`); returns the
    eval loss taken (or None).

    With `transport` (no update in flight), checks that every island's
    parameters equal the coordinator's view.

    Raises:
      RuntimeError: islands hold different global parameters.
    """
    rounds = config.outer.rounds
    record = dict(kind="round", round=r + 1, train_loss={}, islands={})
    for isl in islands:
        result = results.get(isl.name)
        if result is None:
            continue
        step0 = isl.step - result["steps"]
        for j in range(result["steps"]):
            metrics.write(
                dict(
                    kind="inner",
                    island=isl.name,
                    round=r + 1,
                    step=step0 + j + 1,
                    **{k: result[k][j] for k in STEP_METRICS},
                    moe=result["layers"][j],
                    tokens_per_second=result["tokens"] / result["seconds"],
                )
            )
        metrics.write(
            dict(kind="island_round", island=isl.name, round=r + 1, steps=result["steps"],
                 step_seconds=result["step_seconds"], seconds=result["seconds"], busy_seconds=result["busy_seconds"],
                 tokens=result["tokens"], expert_load=result["expert_load"],
                 **{k: result[k] for k in ACCOUNTING_FIELDS if k in result})
        )
        record["train_loss"][isl.name] = float(np.mean(result["cross_entropy"]))
        t = totals[isl.name]
        t["inner_steps"] += result["steps"]
        t["tokens"] += result["tokens"]
        t["bytes_sent"] += result.get("payload_bytes", 0)
        t["bytes_received"] += result.get("bytes_received", 0)
        if "wall_seconds" in result:
            for k in ("compute_seconds", "seconds_blocked", "idle_seconds", "wall_seconds", "ideal_compute_seconds",
                      "eval_seconds", "checkpoint_seconds"):
                t[k] = t.get(k, 0.0) + result[k]
            t["compute_utilization"] = t["ideal_compute_seconds"] / t["wall_seconds"]
        if "codec_relative_error" in result:
            record.setdefault("codec_relative_error", {})[isl.name] = result["codec_relative_error"]
    if transport is not None:
        checksums = {isl.name: isl.global_checksum for isl in islands}
        checksums["coordinator"] = checksum(transport.coordinator.view)
        if len(set(checksums.values())) != 1:
            raise RuntimeError(f"islands hold different global parameters after round {r + 1}: {checksums}")
        record["checksums"] = checksums
        recs = [f.history[-1] for f in transport.coordinator.fragments if f.history and f.history[-1].round == r]
        if recs:
            rec = recs[-1]
            record.update(update_codec_relative_error=rec.update_codec_relative_error, tokens=rec.tokens,
                          weights=rec.weights, pseudo_gradient_norm=rec.pseudo_gradient_norm,
                          cosine_similarity=rec.cosine_similarity, update_bytes=sum(x.update_bytes for x in recs))
    eval_loss = None
    if (r + 1) % config.eval.every_rounds == 0 or r + 1 == rounds:
        with evaluating():
            eval_loss = islands[0].evaluate(eval_batches, global_params=global_params)
        metrics.write(dict(kind="eval", round=r + 1, eval_loss=eval_loss))
        record["eval_loss"] = eval_loss
    metrics.write(record)
    first = islands[0].name
    if state is not None:
        now = time.perf_counter()
        if r == 0:
            state["second"] = now  # rounds after this one carry no compilation
        eta = format_eta((now - state["second"]) / r * (rounds - r - 1)) if r else "after round 2"
    else:
        eta = "-"
    logging.info(
        "round %d/%d | loss %s | eval %s | sent/received %.2f/%.2f MB by %s | utilization %s | ETA %s",
        r + 1, rounds, " ".join(f"{k}={v:.4f}" for k, v in record["train_loss"].items()),
        f"{eval_loss:.4f}" if eval_loss is not None else "-",
        results.get(first, {}).get("payload_bytes", 0) / 1e6, results.get(first, {}).get("bytes_received", 0) / 1e6,
        first, " ".join(f"{k}={v.get('compute_utilization', 0):.3f}" for k, v in results.items()), eta,
    )
    return eval_loss


def _last_eval(workdir, default):
    evals = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("kind") == "eval"]
    return evals[-1]["eval_loss"] if evals else default

