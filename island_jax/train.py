"""`train_and_evaluate(config, workdir)`: every island and the coordinator in one process.

The islands run one after another on their own slices of this process's
devices and reach the coordinator through the in-process transport; the
multi-process launch swaps only the transport. Writes to `workdir`:
`config.json`, `metrics.jsonl` (inner steps, rounds, evaluations) and
`summary.json`.
"""

from __future__ import annotations

import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from island_jax import config as config_lib
from island_jax import data as data_lib
from island_jax.comm.link import LinkEmulator
from island_jax.comm.transport import InProcessTransport
from island_jax.coordinator import Coordinator
from island_jax.island import STEP_METRICS, Island
from island_jax.metrics import MetricsWriter, format_eta, write_json
from island_jax.outer import codec
from island_jax.params import checksum, count, init_params


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

    Args:
      config: see `island_jax.config`; validated here before anything compiles.
      workdir: output folder (created).

    Returns:
      The summary, also written to `workdir/summary.json`: `rounds`, `params`,
      `codec`, `block_size`, `corpus` (fingerprint), `eval_loss_initial`,
      `eval_loss_final` (nats per byte on the held-out files), `wall_seconds`,
      and `islands.NAME.{inner_steps, tokens, bytes_sent, bytes_received}`.

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
    if config.outer.enabled:
        links = {name: LinkEmulator.from_config(config) for name in names}
        transport = InProcessTransport(Coordinator(config, params, names), links, config.comm.connections)
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
    eval_loss, eval_round = eval_initial, 0
    rounds = config.outer.rounds
    second_round_start = start
    for r in range(rounds):
        round_start = time.perf_counter()
        losses, codec_errors = {}, {}
        for isl in islands:
            step0 = isl.step
            result = isl.train_round()
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
            losses[isl.name] = float(np.mean(result["cross_entropy"]))
            totals[isl.name]["inner_steps"] += result["steps"]
            totals[isl.name]["tokens"] += result["tokens"]
            if transport is not None:
                payload = isl.encode_pseudo_gradient()
                transport.contribute(r, isl.name, result["tokens"], payload, isl.global_checksum, result["step_seconds"])
                totals[isl.name]["bytes_sent"] += len(payload)
                codec_errors[isl.name] = isl.codec_relative_error
            metrics.write(
                dict(kind="island_round", island=isl.name, round=r + 1, steps=result["steps"],
                     step_seconds=result["step_seconds"], seconds=result["seconds"],
                     busy_seconds=result["busy_seconds"], tokens=result["tokens"], expert_load=result["expert_load"])
            )
        for isl in islands if transport is not None else ():
            update = transport.fetch_update(r, isl.name)
            isl.apply_update(update)
            planned = transport.planned_inner_steps(isl.name)
            if planned and planned != isl.inner_steps:  # outer.auto_from = measured, after round 0
                logging.info("island %s: %d inner steps per round from round %d on", isl.name, planned, r + 2)
                isl.set_inner_steps(planned, rounds - r - 1)
            totals[isl.name]["bytes_received"] += len(update)
        checksums = {isl.name: isl.params_checksum() for isl in islands}
        if transport is not None:
            checksums["coordinator"] = checksum(transport.coordinator.view)
        if len(set(checksums.values())) != 1:
            raise RuntimeError(f"islands hold different global parameters after round {r + 1}: {checksums}")
        record = dict(kind="round", round=r + 1, checksums=checksums, train_loss=losses)
        if transport is not None:
            rec = transport.coordinator.history[-1]
            record.update(codec_relative_error=codec_errors, update_codec_relative_error=rec.update_codec_relative_error)
            record.update(tokens=rec.tokens, weights=rec.weights, pseudo_gradient_norm=rec.pseudo_gradient_norm,
                          cosine_similarity=rec.cosine_similarity, update_bytes=rec.update_bytes)
        if (r + 1) % config.eval.every_rounds == 0 or r + 1 == rounds:
            eval_loss, eval_round = evaluator.evaluate(eval_batches), r + 1
            metrics.write(dict(kind="eval", round=r + 1, eval_loss=eval_loss))
            record["eval_loss"] = eval_loss
        record["seconds"] = time.perf_counter() - round_start  # training, exchange and evaluation
        metrics.write(record)
        # ETA from the rounds after the first, which also compiled the steps.
        eta = format_eta((time.perf_counter() - second_round_start) / r * (rounds - r - 1)) if r else "after round 2"
        logging.info(
            "round %d/%d | loss %s | eval %.4f (round %d) | sent/received per island %.2f/%.2f MB | %.1f s | ETA %s",
            r + 1,
            rounds,
            " ".join(f"{k}={v:.4f}" for k, v in losses.items()),
            eval_loss,
            eval_round,
            totals[names[0]]["bytes_sent"] / (r + 1) / 1e6,
            totals[names[0]]["bytes_received"] / (r + 1) / 1e6,
            record["seconds"],
            eta,
        )
        if r == 0:
            second_round_start = time.perf_counter()  # rounds after this one carry no compilation
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
    logging.info("done in %.1f s: eval loss %.4f -> %.4f nats/byte", summary["wall_seconds"], eval_initial, eval_loss)
    return summary
