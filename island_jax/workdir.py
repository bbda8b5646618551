"""A run's workdir: the one tree every way of running writes, and what is read back from it.

  WORKDIR/coordinator/     config.json, run_info.json, metrics.jsonl, TensorBoard events,
                           checkpoints/ (master, outer optimizer state, view, round),
                           summary.json
  WORKDIR/islands/NAME/    config.json, run_info.json, metrics.jsonl, events.jsonl (spans for the
                           timeline), TensorBoard events, checkpoints/ (params, anchor,
                           AdamW state, data position, round), summary.json
  WORKDIR/summary.json     every role's summary combined (`combine_summaries`)
  WORKDIR/timeline.png     when each island computed, sent, received, waited, evaluated, saved
  WORKDIR/routing.png      expert load per island over rounds and the divergence between islands
                           (the figures `metrics.plots` names; both by default)

The in-process run (`island_jax.run`) and a multi-process launch write the
same files with the same records, and both resume from the same workdir:
every role restarts from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

import ml_collections
from absl import logging

from island_jax.metrics import MetricsWriter, NoMetrics, comma_names, gbps, make_writers, read_jsonl, write_json
from island_jax.plots import PLOTS, plot_routing, plot_timeline, routing_records
from island_jax.provenance import record_start

if TYPE_CHECKING:  # imported where used: the launcher reads workdirs without importing JAX (orbax needs it)
    from island_jax.checkpoint import Checkpointer


def coordinator_dir(workdir: str, shard: int = 0) -> str:
    """The coordinator's folder of a workdir: `coordinator` (of several shards, shard 0's: it leads, and holds the
    checkpoint sets' commit markers), `coordinator-shard-K` for shard K > 0."""
    return os.path.join(workdir, "coordinator" if shard == 0 else f"coordinator-shard-{shard}")


def island_dir(workdir: str, name: str) -> str:
    """Island `name`'s folder of a workdir."""
    return os.path.join(workdir, "islands", name)


def due(rounds_done: int, every_rounds: int, rounds: int) -> bool:
    """Whether the run evaluates or checkpoints after `rounds_done` completed rounds: every
    `every_rounds` rounds (`eval.every_rounds`, `checkpoint.every_rounds`) and after the last."""
    return rounds_done % every_rounds == 0 or rounds_done == rounds


def refuse_finished(workdir: str, rounds: int | None = None) -> None:
    """Refuses a workdir whose run finished, so nothing it holds is overwritten, unless `rounds` raises the
    finished run's `outer.rounds` (it is extended: it goes on from its last round).

    Raises:
      FileExistsError: `WORKDIR/summary.json` exists, of `rounds` rounds or more.
    """
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return
    summary = _read_json(path)
    done = summary.get("rounds")
    if rounds is not None and isinstance(done, int) and rounds > done:
        return
    if summary.get("failures"):
        raise FileExistsError(
            f"{workdir} holds a run of {done} rounds that failed ({'; '.join(summary['failures'])}); pass a new "
            "--workdir (raising --config.outer.rounds would only extend it)"
        )
    raise FileExistsError(
        f"{workdir} holds a finished run of {done} rounds (summary.json); raise --config.outer.rounds to extend it, "
        "or pass a new --workdir"
    )


def set_aside_summary(path: str, rounds_done: int) -> None:
    """Renames a role folder's `summary.json` (of a run finished after `rounds_done` rounds, now extended) to
    `summary_<rounds_done>.json`: the role is no longer finished, and what it summarized is kept."""
    summary = os.path.join(path, "summary.json")
    if os.path.exists(summary):
        os.replace(summary, os.path.join(path, f"summary_{rounds_done}.json"))


def schedule_rounds(path: str, config: ml_collections.ConfigDict) -> int:
    """The rounds a role's learning-rate schedule is laid out over: the `outer.rounds` its run started with.

    A finished run extended by raising `outer.rounds` keeps the schedule of the rounds it completed; the
    rounds added hold the schedule's final value (optax's cosine decay stays at its end value past its steps).
    Read from the starts in `path/run_info.json` (`provenance.record_start`): the value the first change of
    `outer.rounds` started from, else `config.outer.rounds`.
    """
    info = os.path.join(path, "run_info.json")
    if os.path.exists(info):
        for start in _read_json(info).get("starts", []):
            for field, started, _ in start.get("config_changes", []):
                if field == "outer.rounds" and isinstance(started, int):
                    return started
    return config.outer.rounds


@dataclasses.dataclass
class RoleFolder:
    """One role's folder: its checkpoints and metrics (`open_role`).

    `begin()` records the start (`config.json`, `run_info.json`, a `config_change` record) once the role has
    checked what can still refuse it (its data, its port): a start that fails before leaves no config behind.
    """

    path: str
    checkpoints: Checkpointer
    metrics: MetricsWriter | NoMetrics
    config: ml_collections.ConfigDict | None = None  # what `begin` writes (None: not the primary process)
    changes: list = dataclasses.field(default_factory=list)  # config fields changed on this resume
    write_config: bool = False  # config.json is (re)written at `begin`

    def begin(self) -> None:
        """Writes `config.json` (at the first start, or with the changes of a resume), appends this start to
        `run_info.json` (`provenance.record_start`) and logs a `config_change` record; once, by the primary."""
        if self.config is None:
            return
        config, self.config = self.config, None
        if self.write_config:
            config_path = os.path.join(self.path, "config.json")
            tmp = f"{config_path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(config.to_json_best_effort(indent=2, sort_keys=True))
            os.replace(tmp, config_path)
        record_start(self.path, self.changes)
        if self.changes:
            self.metrics.write(dict(kind="config_change", round=self.checkpoints.latest_round() or 0,
                                    changes=[dict(field=k, started=a, now=b) for k, a, b in self.changes]))

    def close(self) -> None:
        """Finishes the save in progress and the metrics (both wait for their background writes)."""
        try:
            self.metrics.close()
        finally:
            self.checkpoints.close()


def checkpoint_schedule(config: ml_collections.ConfigDict, coordinator: bool = False) -> tuple[int, int]:
    """How often a role checkpoints and how many checkpoints it keeps: `(every_rounds, max_to_keep)`.

    The coordinator saves every `k = checkpoint.coordinator_every_rounds`
    rounds (`checkpoint.every_rounds` when 0) and keeps `checkpoint.max_to_keep`.
    An island saves every `e = checkpoint.every_rounds` rounds and at the
    coordinator's rounds too (`island_saves`), and keeps enough that it still
    holds the coordinator's newest complete checkpoint C after a coordinator
    restart: the coordinator never serves round C+2's update before its
    checkpoint of round C is complete, so no island has completed more than
    C + k + 1 rounds, and it keeps C and every save after it up to there.
    Without an outer loop (`outer.enabled` False) there is no coordinator, and
    an island keeps `max_to_keep`.

    Examples (max_to_keep 1): k = e = 1 keeps 3; k = e = 2 keeps 2; k = 4,
    e = 2 keeps 3; k = 1, e = 10 keeps 3.
    """
    ckpt = config.checkpoint
    k = ckpt.coordinator_every_rounds or ckpt.every_rounds
    if coordinator:
        return k, ckpt.max_to_keep
    if not config.outer.enabled:
        return ckpt.every_rounds, ckpt.max_to_keep
    e = ckpt.every_rounds
    needed = max(  # C and the island's saves after it, up to C + k + 1, over C = j k (the pattern repeats)
        1 + sum(island_saves(c + i, k, e) for i in range(1, k + 2)) for c in range(0, k * e + 1, k)
    )
    return e, max(ckpt.max_to_keep, needed)


def island_saves(rounds_done: int, coordinator_every: int, every: int) -> bool:
    """Whether an island saves after `rounds_done` rounds: every `every` rounds, and at the coordinator's
    checkpoint rounds (every `coordinator_every`), which it rolls back to after a coordinator restart."""
    return rounds_done % every == 0 or rounds_done % coordinator_every == 0


def has_started(path: str) -> bool:
    """Whether the role in folder `path` has started its run: it holds a complete checkpoint after a round (the
    coordinator's of round 0 is only its seeded init), or metrics records of completed rounds. A role folder
    that has not is a new run, whatever config it names. Read without importing JAX."""
    folder = os.path.join(path, "checkpoints")
    if os.path.isdir(folder) and any(n.isdigit() and int(n) > 0 for n in os.listdir(folder)):
        return True
    metrics = os.path.join(path, "metrics.jsonl")
    return os.path.exists(metrics) and any(r.get("kind") == "round" for r in read_jsonl(metrics))


ATTEMPTS = "attempts"  # a role folder's subfolder for the files of starts that never began a round


def set_aside_attempt(path: str) -> str | None:
    """Moves what a start that never completed a round left in role folder `path` (its `config.json`,
    `metrics.jsonl`, `events.jsonl`, `run_info.json`, TensorBoard events, a checkpoint of round 0 in
    `checkpoints/`) into `path/attempts/N/` (N = 1, 2, ...), so that a new run's records are not mixed with them;
    returns that folder, or None when there was nothing to move. The `checkpoints/` folder itself stays (the
    other processes of an island may have opened it already); only what it holds moves.

    Raises:
      OSError: an entry cannot be moved.
    """
    if not os.path.isdir(path):
        return None
    checkpoints = os.path.join(path, "checkpoints")
    moves = [(os.path.join(path, n), n) for n in os.listdir(path) if n not in (ATTEMPTS, "checkpoints")]
    if os.path.isdir(checkpoints):
        moves += [(os.path.join(checkpoints, n), os.path.join("checkpoints", n)) for n in os.listdir(checkpoints)]
    if not moves:
        return None
    n = 1
    while os.path.exists(os.path.join(path, ATTEMPTS, str(n))):
        n += 1
    target = os.path.join(path, ATTEMPTS, str(n))
    os.makedirs(os.path.join(target, "checkpoints"))
    for src, name in moves:
        os.replace(src, os.path.join(target, name))
    return target


def started_config(path: str) -> dict | None:
    """The config a role's folder `path` was started with (its `config.json`, parsed), or None when it has not
    started (`has_started`)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path) or not has_started(path):
        return None
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


def check_resume(config: ml_collections.ConfigDict, workdir: str, allow_config_change: bool = False) -> None:
    """Before any role of the run in `workdir` starts: refuses a config that differs from the one any of its
    roles (the coordinator, every island of `config`) was started with, unless `allow_config_change`, and
    another `model.scan_layers` (the parameters' layout) either way.

    Raises:
      ConfigChangeError: naming the role's folder and every changed field with both values
        (`config.refuse_config_changes`).
    """
    from island_jax.config import refuse_config_changes

    for path in [coordinator_dir(workdir), *(island_dir(workdir, n) for n in config.islands.keys())]:
        started = started_config(path)
        if started is not None:
            refuse_config_changes(path, started, config, allow_config_change)


def open_role(
    config: ml_collections.ConfigDict, path: str, coordinator: bool = False, primary: bool = True,
    allow_config_change: bool = False,
) -> RoleFolder:
    """Opens (creating) a role's folder: its `Checkpointer`, `MetricsWriter`, `config.json` and `run_info.json`.

    Every process of a multi-process island opens the one folder (its checkpoints hold every process's
    shards); only process 0, the `primary`, writes the metrics, `config.json` and `run_info.json` (the others
    get `NoMetrics`).

    The `Checkpointer` saves and keeps what `checkpoint_schedule` says for the
    coordinator (`coordinator=True`) or an island; its `every_rounds` is the
    role's interval. A role that has not started (`has_started`: no round
    completed, no checkpoint after round 0; stopped while compiling, say, or
    refused for its data) starts again as a new run, whatever config it
    named: what it left is moved to `attempts/N/` (`set_aside_attempt`).

    A resumed role checks `config` against the `config.json` it started with:
    a field other than `config.RESUME_MAY_CHANGE` that differs is refused,
    unless `allow_config_change` (`model.scan_layers`, the parameters'
    layout, is refused either way); then the role goes on under `config`, which
    becomes its `config.json`, and a `config_change` record in its metrics
    and its start in `run_info.json` (`provenance.record_start`) list every
    changed field with both values (those that may change without it too,
    which also rewrite `config.json`, so that it always describes the run).
    Every start appends its provenance there. The trackers of
    `metrics.writers` are made first: one that cannot start changes nothing.

    Raises:
      ConfigChangeError: a changed field, without `allow_config_change` (another `model.scan_layers`, with it
        too); nothing in the folder is changed.
      FileExistsError: the folder holds completed rounds but no checkpoint to resume from.
      CheckpointError: from orbax, for a checkpoint folder it cannot read.
      ImportError, ValueError: a tracker of `metrics.writers` that cannot be made (`metrics.make_writers`).
    """
    from island_jax.checkpoint import Checkpointer
    from island_jax.config import config_changes, refuse_config_changes

    started = started_config(path)
    if primary and not has_started(path):  # a new run: what an earlier start that never began left is set aside
        moved = set_aside_attempt(path)
        if moved is not None:
            logging.warning("%s held the files of a start that completed no round; they are moved to %s",
                            path, moved)
    changes = []
    if started is not None:
        refuse_config_changes(path, started, config, allow_config_change)
        changes = config_changes(started, config, allowed=True)  # what config.json and the history record
    role = "coordinator" if coordinator else f"island {os.path.basename(os.path.normpath(path))}"
    spec = config.metrics.writers if "metrics" in config else "jsonl,tensorboard"
    os.makedirs(path, exist_ok=True)
    writers = make_writers(spec, path, role, config) if primary else []  # a tracker that cannot start: nothing written
    every_rounds, max_to_keep = checkpoint_schedule(config, coordinator)
    checkpoints = Checkpointer(os.path.join(path, "checkpoints"), every_rounds, max_to_keep)
    metrics = os.path.join(path, "metrics.jsonl")
    if checkpoints.latest_round() is None and os.path.exists(metrics) and any(
        r.get("kind") == "round" for r in read_jsonl(metrics)
    ):
        checkpoints.close()
        for writer in writers:
            writer.close()
        key = "coordinator_every_rounds" if coordinator and config.checkpoint.coordinator_every_rounds else "every_rounds"
        raise FileExistsError(
            f"{path} holds rounds of a run but no checkpoint to resume from (checkpoint.{key}="
            f"{every_rounds}); pass a new --workdir, or move that one away first, so that nothing "
            "it holds is overwritten"
        )
    if not primary:
        return RoleFolder(path, checkpoints, NoMetrics())
    metrics = MetricsWriter(path, writers, background=True)
    # config.json holds the config in effect from this start on (a raised outer.rounds too), written at `begin`
    return RoleFolder(path, checkpoints, metrics, config=config, changes=changes,
                      write_config=started is None or bool(changes))


# Round-record fields an island's summary sums over its rounds.
SUMMED = (
    "inner_steps", "tokens", "bytes_sent", "bytes_received", "compute_seconds", "seconds_blocked", "idle_seconds",
    "wall_seconds", "ideal_compute_seconds", "seconds_transferring", "waits", "eval_seconds", "checkpoint_seconds",
)


def summarize_island(folder: str) -> dict:
    """Totals of an island's `metrics.jsonl` over the whole run, resumed parts included.

    A round logged twice (after a crash, a resumed run trains it again) counts
    once, with its latest record. Returns `rounds` (completed), the sums of
    `SUMMED`: `inner_steps`, `tokens`, `bytes_sent` and `bytes_received`
    (frame bytes, see `comm.inprocess`), `waits`, `wall_seconds` (of the rounds;
    every second is one of `compute_seconds`, `seconds_blocked` or
    `idle_seconds`), `eval_seconds` and `checkpoint_seconds` (between rounds,
    outside their wall seconds; the evaluation and save after the last round
    are in `process_seconds` only), `ideal_compute_seconds` (per round, inner
    steps x the step time with no exchange in flight), `seconds_transferring`;
    then `compute_utilization` (ideal compute / wall), `mfu` (model FLOPs utilization: the rounds' `mfu`,
    weighted by inner steps x median step seconds), `achieved_gbps` (all
    bytes moved x 8 / seconds_transferring / 1e9), the last `checksum` (of the
    last round record, or of a later `rejoin` record), `rounds_replayed` (rounds recomputed after restarts,
    `island.replay`) and `rejoin_bitwise` (whether every rejoin kept the bits: a replay or a rollback to its own
    checkpoint, not the view; None when it never rejoined), and
    when the island evaluated, `eval_loss_initial` (round 0), `eval_loss_final` and `eval_bits_per_byte_final`
    (of the text, `data.bits_per_byte`), the loss's standard error
    `eval_loss_final_stderr`, and `eval_windows` and `eval_windows_sha256` (the held-out set scored); when it
    scored data of its own (`islands.NAME.data`), `own_eval_loss_final` and `own_eval_bits_per_byte_final`.
    """
    rounds, evals, own, held, rejoins = {}, {}, {}, None, []
    for rec in read_jsonl(os.path.join(folder, "metrics.jsonl")):
        if rec.get("kind") in ("round", "rejoin"):  # what it holds: after a round, or the coordinator's state
            held = rec["checksum"]
        if rec.get("kind") == "rejoin":
            rejoins.append(rec)
        if rec.get("kind") == "round":
            rounds[rec["round"]] = rec
        elif rec.get("kind") == "eval":
            evals[rec["round"]] = rec
        elif rec.get("kind") == "own_eval":
            own[rec["round"]] = rec
    summary = {key: sum(rec.get(key, 0) for rec in rounds.values()) for key in SUMMED}
    wall = summary["wall_seconds"]
    summary["compute_utilization"] = summary["ideal_compute_seconds"] / wall if wall else 0.0
    summary["achieved_gbps"] = gbps(summary["bytes_sent"] + summary["bytes_received"], summary["seconds_transferring"])
    # MFU over the run: each round's, weighted by the seconds its steps took at their median
    stepped = [(rec.get("mfu", 0.0), rec["inner_steps"] * rec.get("step_seconds", 0.0)) for rec in rounds.values()]
    seconds = sum(t for _, t in stepped)
    summary["mfu"] = sum(m * t for m, t in stepped) / seconds if seconds else 0.0
    summary.update(rounds=max(rounds, default=0), checksum=held)
    # restarts: rounds recomputed by replays, and whether every rejoin kept the bits (None: it never rejoined)
    summary["rounds_replayed"] = sum(rec.get("replayed", 0) for rec in rejoins)
    summary["rejoin_bitwise"] = all(rec["source"] != "view" for rec in rejoins) if rejoins else None
    if evals:
        last = evals[max(evals)]
        summary.update(eval_loss_initial=evals[0]["eval_loss"] if 0 in evals else None, eval_loss_final=last["eval_loss"],
                       eval_bits_per_byte_final=last.get("eval_bits_per_byte"),
                       eval_loss_final_stderr=last.get("eval_loss_stderr"), eval_windows=last.get("eval_windows"),
                       eval_windows_sha256=last.get("eval_windows_sha256"))
    if own:
        last = own[max(own)]
        summary.update(own_eval_loss_final=last["own_eval_loss"], own_eval_bits_per_byte_final=last["own_eval_bits_per_byte"])
    return summary


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _agree_every_round(config: ml_collections.ConfigDict, workdir: str, merged: dict) -> bool | None:
    """Whether, after every merged round, each island logged the coordinator's view checksum for that round
    (their `round` records, or a `rejoin` record: the view it took after that round; the latest record of a
    round counts); None where an island's round record does not hold the view of the same round
    (fragments, or an update applied `outer.overlap_steps` later)."""
    if config.outer.fragments != 1 or config.outer.overlap_steps != 0:
        return None
    held = {name: {rec["round"]: rec.get("checksum") for rec in read_jsonl(os.path.join(island_dir(workdir, name),
                                                                                       "metrics.jsonl"))
                   if rec.get("kind") in ("round", "rejoin")} for name in config.islands.keys()}
    return bool(merged) and all(rounds.get(r) == rec["checksum"] for r, rec in merged.items()
                                for rounds in held.values())


def combine_summaries(config: ml_collections.ConfigDict, workdir: str, wall_seconds: float) -> dict:
    """Writes `WORKDIR/summary.json` from every role's folder, and the figures `metrics.plots` names:
    `WORKDIR/timeline.png` (`plots.plot_timeline`) and, where the coordinator's records hold routing diagnostics,
    `WORKDIR/routing.png` (`plots.plot_routing`).

    Returns:
      `rounds`, `params`, `codec`, `block_size`, `update_codec`, `contribution_bytes` and `update_bytes` (one
      island's payload bytes each way per round), `corpus`, `eval_loss_initial`,
      `eval_loss_final` (nats per byte on bytes, per token on prepared records, from the evaluating island),
      `eval_bits_per_byte_final`, `eval_loss_final_stderr`
      (its standard error over the held-out windows), `eval_windows`, `eval_windows_sha256`,
      `wall_seconds` (the caller's, seconds), `checksums_agree` (every island's final
      global parameters equal the coordinator's view; without an outer loop,
      True), `checksums_agree_every_round` (after every round, too: `_agree_every_round`), and `islands.NAME`: the island's `SUMMED` totals,
      `achieved_gbps`, `compute_utilization`, `mfu`, `mean_weight` (its share of a
      merge, averaged over rounds), `rounds_merged`, `rounds_replayed` and `rejoin_bitwise` (`summarize_island`),
      and for an island with data of its own
      `own_eval_loss_final` and `own_eval_bits_per_byte_final` (its own held-out split).

    Raises:
      FileNotFoundError: a role left no summary (it did not finish).
    """
    names = list(config.islands.keys())
    islands = {name: _read_json(os.path.join(island_dir(workdir, name), "summary.json")) for name in names}
    evaluator = islands[names[0]]
    merged = {}  # round -> the coordinator's record (a resumed run logs some rounds twice)
    short = {}  # (round, fragment) -> its contributors, where they are fewer than the quorum requires
    required = config.outer.min_islands or len(names)
    if config.outer.enabled:
        coordinator = _read_json(os.path.join(coordinator_dir(workdir), "summary.json"))
        for rec in read_jsonl(os.path.join(coordinator_dir(workdir), "metrics.jsonl")):
            if rec.get("kind") == "round":
                merged[rec["round"]] = rec
                key = (rec["round"], rec.get("fragment", 0))
                short.pop(key, None)  # the latest record of a round logged twice decides
                if len(rec["contributors"]) < required:
                    short[key] = rec["contributors"]
        agree = all(s["checksum"] == coordinator["checksum"] for s in islands.values())
        every_round = _agree_every_round(config, workdir, merged)
    else:  # one island, no exchange: it describes the run itself
        coordinator, agree, every_round = evaluator, True, True
    summary = dict(
        rounds=coordinator["rounds"],
        params=coordinator["params"],
        codec=coordinator["codec"],
        block_size=coordinator["block_size"],
        update_codec=coordinator.get("update_codec", coordinator["codec"]),
        contribution_bytes=coordinator.get("contribution_bytes"),
        update_bytes=coordinator.get("update_bytes"),
        corpus=evaluator.get("corpus"),
        eval_loss_initial=evaluator.get("eval_loss_initial"),
        eval_loss_final=evaluator.get("eval_loss_final"),
        eval_loss_final_stderr=evaluator.get("eval_loss_final_stderr"),
        eval_bits_per_byte_final=evaluator.get("eval_bits_per_byte_final"),
        eval_windows=evaluator.get("eval_windows"),
        eval_windows_sha256=evaluator.get("eval_windows_sha256"),
        wall_seconds=wall_seconds,
        checksums_agree=agree,
        checksums_agree_every_round=every_round,
        rounds_short=sorted({r for r, _ in short}),
        islands={
            name: dict(
                {k: s[k] for k in (*SUMMED, "achieved_gbps", "compute_utilization", "mfu")},
                # the share of each round's merge, averaged over rounds (0 for a round it missed)
                mean_weight=sum(r["weights"].get(name, 0.0) for r in merged.values()) / max(len(merged), 1),
                rounds_merged=sum(name in r["weights"] for r in merged.values()),
                **{k: s[k] for k in ("own_eval_loss_final", "own_eval_bits_per_byte_final") if k in s},
                rounds_replayed=s.get("rounds_replayed", 0), rejoin_bitwise=s.get("rejoin_bitwise"),
            )
            for name, s in islands.items()
        },
    )
    summary["failures"] = failures(config, summary, islands, coordinator, short)
    write_json(os.path.join(workdir, "summary.json"), summary)
    plots = comma_names(config.metrics.get("plots", ",".join(PLOTS)))
    events = [os.path.join(island_dir(workdir, n), "events.jsonl") for n in names]
    events = [p for p in events if os.path.exists(p) and os.path.getsize(p)]
    if events and "timeline" in plots:
        plot_timeline(events, os.path.join(workdir, "timeline.png"))
    coordinator_metrics = os.path.join(coordinator_dir(workdir), "metrics.jsonl")
    if "routing" in plots and os.path.exists(coordinator_metrics) and routing_records(coordinator_metrics):
        plot_routing(coordinator_metrics, os.path.join(workdir, "routing.png"))
    return summary


class RunFailed(RuntimeError):
    """A run finished, but not as its config asks: its `summary.json`'s `failures`, one per sentence."""


def failures(config: ml_collections.ConfigDict, summary: dict, islands: dict, coordinator: dict, short: dict) -> list:
    """What makes a finished run a failure, one sentence each: islands whose final global parameters differ from
    the coordinator's view, and rounds merged from fewer islands than `outer.min_islands` requires (0: all).

    Args:
      summary: the combined summary (its `checksums_agree`); islands: {name: the island's summary};
        coordinator: the coordinator's summary; short: {(round, fragment): the contributors' names} of the
        rounds merged from too few islands.
    """
    out = []
    if not summary["checksums_agree"]:
        held = ", ".join(f"{n}={s['checksum']}" for n, s in islands.items())
        out.append(f"the islands' final global parameters disagree ({held}; the coordinator's view "
                   f"{coordinator['checksum']})")
    if short:
        required = config.outer.min_islands or len(config.islands)
        rounds = sorted({r for r, _ in short})
        first = short[min(short)]
        out.append(f"{len(rounds)} round(s) were merged from fewer islands than outer.min_islands="
                   f"{config.outer.min_islands} requires ({required}): rounds {rounds[:10]}"
                   f"{' ...' if len(rounds) > 10 else ''} (round {min(short)[0]} from {first} only); see the "
                   "coordinator's log for why")
    return out


def check_finished(summary: dict) -> None:
    """Raises RunFailed when the combined `summary` lists `failures`; the last line a run prints says so.

    Raises:
      RunFailed: naming every failure.
    """
    if summary.get("failures"):
        raise RunFailed("the run failed: " + "; ".join(summary["failures"]))


def done_line(config: ml_collections.ConfigDict, workdir: str, summary: dict) -> str:
    """The line a launcher prints when a run has finished: wall time, eval loss first and last (in
    `data.loss_unit`), whether the global parameters agree, and where `combine_summaries` wrote."""
    from island_jax.data import loss_unit

    line = (f"done in {summary['wall_seconds']:.1f} s: eval loss {summary['eval_loss_initial']:.4f} -> "
            f"{summary['eval_loss_final']:.4f} {loss_unit(config, summary['eval_bits_per_byte_final'])}; global "
            f"parameters agree: {summary['checksums_agree']}")
    if summary.get("update_bytes"):
        params = summary["params"]
        up, down = summary["contribution_bytes"], summary["update_bytes"]
        line += (f" (every round: {summary['checksums_agree_every_round']}); per island and round "
                 f"{up:,} bytes up ({summary['codec']}, {8 * up / params:.3f} bits a parameter) and "
                 f"{down:,} down ({summary['update_codec']}, {8 * down / params:.3f})")
    rejoined = {n: s for n, s in summary.get("islands", {}).items() if s.get("rejoin_bitwise") is not None}
    if rejoined:  # restarts: what each restarted island replayed, and whether the run kept its bits
        line += "; rejoins: " + ", ".join(
            f"{n} replayed {s['rounds_replayed']} rounds, {'bitwise' if s['rejoin_bitwise'] else 'from the view'}"
            for n, s in rejoined.items())
    return line + f"; summary in {os.path.join(workdir, 'summary.json')}"
