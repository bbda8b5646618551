"""`run_in_process(config, workdir)`: every role of a run in this process, on threads.

The coordinator (`run_coordinator`) and every island (`run_island`) run the
same drivers as in a multi-process launch, on threads of their own, over an
`InProcessExchange` instead of gRPC; each island on its own consecutive slice
of this process's devices. One lock keeps a single island's device work
running at a time (XLA:CPU's in-process collectives must not interleave), so
here the islands' compute is serialized and only a multi-process launch shows
real overlap. The workdir is the one every mode writes (`island_jax.workdir`),
and running again with the same workdir resumes every role from its newest
checkpoint.
"""

from __future__ import annotations

import threading
import time

import jax
import ml_collections
from absl import logging

from island_jax import config as config_lib
from island_jax.comm.inprocess import InProcessExchange
from island_jax.comm.session import RunAborted
from island_jax.coordinator.shards import LocalBus
from island_jax.hardware import measured_cpu_peak_flops
from island_jax.island import memory
from island_jax.model.load import check_init_from
from island_jax.progress import Progress
from island_jax.roles.coordinator import run_coordinator
from island_jax.roles.island import run_island
from island_jax.workdir import check_finished, check_resume, combine_summaries, done_line, refuse_finished


def run_in_process(config: ml_collections.ConfigDict, workdir: str, allow_config_change: bool = False,
                   devices: dict | None = None) -> dict:
    """Trains the run's islands with the DiLoCo outer loop (or one island without it) and evaluates.

    Args:
      config: see `island_jax.config`; validated here, before anything compiles.
      workdir: the run's folder (created; an unfinished run in it is resumed).
      allow_config_change: resume an unfinished run under a config that differs from the one it started
        with (recorded in every role's folder, `workdir.open_role`); otherwise that is refused.
      devices: {island: its devices}, for islands on different backends in one process (an island on the GPU
        beside one on CPU devices); None deals `jax.devices()` to the islands in config order.

    Returns:
      `workdir.combine_summaries`'s summary, also in `workdir/summary.json`.

    Raises:
      ConfigError: an invalid config, or more devices asked for than this process has;
        ConfigChangeError: an unfinished run of another config, without `allow_config_change`.
      FileExistsError: `workdir` holds a finished run.
      RunFailed: the run finished, but its islands disagree or a round was merged without an island its quorum
        requires (`workdir.failures`; the summary is written first).
      The first role's error when a role fails (the others are stopped first,
      their checkpoints in progress finished); KeyboardInterrupt or SystemExit
      likewise stops every role before it propagates.
    """
    if devices is None:
        config_lib.validate(config, num_available_devices=len(jax.devices()))
        dealt, offset = jax.devices(), 0
        devices = {}
        for name, cfg in config.islands.items():
            devices[name], offset = dealt[offset : offset + cfg.num_devices], offset + cfg.num_devices
    else:
        config_lib.validate(config)
        for name, cfg in config.islands.items():
            if len(devices.get(name, ())) != cfg.num_devices:
                raise config_lib.ConfigError(f"islands.{name}.num_devices is {cfg.num_devices} but the run was given "
                                             f"{len(devices.get(name, ()))} devices for it")
    memory.check_fits(config)  # every island's budget, before anything is made, saved or compiled
    check_init_from(config)  # model.init_from: its tensors fit the model, its tokenizer is the data's
    refuse_finished(workdir, config.outer.rounds)
    check_resume(config, workdir, allow_config_change)
    start = time.perf_counter()
    shards = config.coordinator.shards
    exchanges = [InProcessExchange() for _ in range(shards)] if config.outer.enabled else []
    exchange = None if not exchanges else exchanges[0] if shards == 1 else exchanges  # K > 1: one per shard
    bus = LocalBus() if shards > 1 else None
    # XLA:CPU's in-process collectives must not interleave: one lock for every island's device work
    cpu = any(d.platform == "cpu" for island_devices in devices.values() for d in island_devices)
    device_lock = threading.Lock() if cpu else None
    if cpu:  # MFU's denominator (once per process), measured before the roles' threads compete for the cores
        measured_cpu_peak_flops()
    stop = threading.Event()  # set when the run is stopped: every island stops before its next round
    roles = []
    for k, ex in enumerate(exchanges):
        roles.append(("coordinator" if k == 0 else f"coordinator shard {k}", run_coordinator,
                      (config, workdir, ex, False, allow_config_change, k, None, bus)))
    for name in config.islands.keys():
        roles.append((f"island {name}", run_island,
                      (config, workdir, name, exchange, list(devices[name]), device_lock, stop, allow_config_change)))
    errors: list[tuple[str, BaseException]] = []

    def work(role, fn, args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
            errors.append((role, e))
            stop.set()
            for ex in exchanges:
                ex.abort(f"{role} failed: {e!r}")

    threads = [threading.Thread(target=work, args=role, name=role[0].replace(" ", "-")) for role in roles]
    progress = Progress(workdir, list(config.islands.keys()), config.outer.rounds)
    try:
        for t in threads:
            t.start()
        while alive := [t for t in threads if t.is_alive()]:
            alive[0].join(timeout=1.0)
            for line in progress.poll():
                logging.info("%s", line)
    except BaseException as e:  # a signal or Ctrl-C: every role unwinds, saves in progress finish
        stop.set()
        for ex in exchanges:
            ex.abort(f"the run was stopped ({e!r})")
        for t in threads:
            if t.is_alive():
                t.join()
        raise
    for t in threads:
        t.join()
    for line in progress.poll():
        logging.info("%s", line)
    real = [(role, e) for role, e in errors if not isinstance(e, RunAborted)]
    if real or errors:
        raise (real or errors)[0][1]
    summary = combine_summaries(config, workdir, time.perf_counter() - start)
    logging.info("%s", done_line(config, workdir, summary))
    check_finished(summary)
    return summary
