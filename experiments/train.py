"""Runs one experiment, or one role of it.

  python experiments/train.py --config=CONFIG.py --workdir=DIR
      the coordinator and every island in this process, on threads (in-process transport);
  python experiments/train.py --config=CONFIG.py --workdir=DIR --role=coordinator --coordinator=HOST:PORT
      the coordinator, serving gRPC on HOST:PORT;
  python experiments/train.py --config=CONFIG.py --dry_run [--target=tpu-v5p-16] [--role=island --island=NAME]
      the memory per device of every island (or one), from shapes and from the compiler (for the island's devices
      or, with --target, for an accelerator's compile-only devices); allocates and trains nothing;
  python experiments/train.py --config=CONFIG.py --workdir=DIR --role=island --island=NAME --coordinator=HOST:PORT
      island NAME, exchanging with the coordinator at HOST:PORT;
      an island of several processes (islands.NAME.num_processes) runs one such command per process, each
      with --process_id=I and --island_coordinator=HOST:PORT of its process 0 (or neither, where
      jax.distributed finds them in the cluster's environment: SLURM, TPU VMs; docs/cluster.md).

`launch/local.py` starts the coordinator and every island as separate processes
on this machine. Overrides use ml_collections syntax, e.g.
`--config.islands.b.batch_size=8`; every role of a run needs the same ones.
`--config` may also be a run's recorded `WORKDIR/coordinator/config.json`, and
with `--workdir` of a started run it may be left out: the run resumes under the
config it recorded (overrides still apply; island_jax/cli.py).
Each process gets one virtual CPU device per device it needs (set from the
config before JAX starts its backend) unless it runs on accelerators.
"""

import signal
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiment config (a get_config() file) or to a run's recorded config.json; "
    "left out with the --workdir of a started run, that run's recorded config.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder: config, metrics, checkpoints, summary.")
_ROLE = flags.DEFINE_enum(
    "role", "all", ["all", "coordinator", "island"],
    "all: every role in this process; coordinator or island: one role of a multi-process run.",
)
_ISLAND = flags.DEFINE_string("island", None, "With --role=island: the island's name in config.islands.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", "localhost:50051", "The coordinator's HOST:PORT (where it listens, or where islands reach it); "
    "of a coordinator of coordinator.shards processes, every shard's, shard 0 first: HOST:PORT,HOST:PORT,...",
)
_SHARD = flags.DEFINE_integer(
    "shard", 0, "With --role=coordinator and coordinator.shards > 1: the shard this process serves (0 leads; it listens "
    "on the --coordinator list's address of that index).", lower_bound=0,
)
_SHARD_SERVICE = flags.DEFINE_string(
    "shard_service", None, "With --role=coordinator and coordinator.shards > 1: HOST:PORT where shard 0 runs the "
    "shards' jax.distributed coordination service (their contributor sets and checkpoint commits).",
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "With --role=island, of an island of several processes: this process's index in it (0 hosts "
    "its jax.distributed coordinator). Default: from the cluster environment (SLURM, TPU VM).",
)
_ISLAND_COORDINATOR = flags.DEFINE_string(
    "island_coordinator", None, "With --role=island, of an island of several processes: HOST:PORT where its process "
    "0 runs the island's jax.distributed coordinator. Default: from the cluster environment (SLURM, TPU VM).",
)
_INSECURE = flags.DEFINE_bool(
    "insecure", False, "With --role=coordinator: listen beyond loopback without TLS and tokens (comm.tls, comm.auth); "
    "anyone who reaches the port can then join, read the model and contribute.",
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume an unfinished run under a config that differs from the one it started with "
    "(each role's config.json): the change is recorded (a config_change record, run_info.json). Without it, that is "
    "refused, naming every changed field.",
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Train nothing: print, per island (this one with --role=island) and per device, the bytes of "
    "parameters, gradients, optimizer state, anchor and activations from shapes, and each program's bytes and FLOPs "
    "from the compiler (the inner step, eval step and pseudo-gradient compiled from abstract shapes, on the island's "
    "devices or for --target's; nothing is drawn or run); a config that cannot fit fails, naming what to change. "
    "Needs no --workdir and writes nothing.",
)
_TARGET = flags.DEFINE_string(
    "target", None, "With --dry_run: compile for this accelerator instead, with compile-only devices: tpu-v4-N, "
    "tpu-v5p-N, tpu-v5e-N or tpu-v6e-N (N as Cloud TPU counts it: tpu-v5p-16 is 8 chips; the tpu-aot extra), h100-N or "
    "a100-N (N GPUs, 8 a host; the gpu-aot extra), for every island, or per island as a=tpu-v5p-16,b=h100-8. A retargeted island's hardware becomes the "
    "target's, with the catalog's memory; its mesh must have the target's devices.",
)


def _quiet_libraries() -> None:
    """Keeps INFO lines of this project; libraries (orbax, JAX) log only warnings and errors, unless
    `--verbosity=1` (`island_jax.logs.install`)."""
    import logging
    import os

    from island_jax import logs

    logs.install(logging.WARNING, ours=(os.path.dirname(os.path.abspath(__file__)),))


def _leave_island(name: str, error: Exception) -> None:
    """Ends this process of a multi-process island at once, saying why: its peers cannot go on without it (nor
    it without them), and waiting for the distributed runtime's shutdown barrier would only delay the exit."""
    import os

    import jax

    why = f"{type(error).__name__}: {error}"
    if isinstance(error, jax.errors.JaxRuntimeError):
        why = ("a collective with the island's other processes failed, most likely because one of them died "
               f"({why})")
    sys.stdout.flush()
    sys.stderr.write(
        f"island {name}, process {jax.process_index()} of {jax.process_count()}: {why}. This process ends; the "
        "island's other processes end too (within distributed.heartbeat_timeout_seconds). Start all of them again "
        "to resume the island from its checkpoints.\n"
    )
    sys.stderr.flush()
    os._exit(1)


def _check_port(address: str) -> None:
    """Exits with one line when the coordinator's HOST:PORT is held by another process (`cli.port_in_use`),
    before anything starts; port 0 (gRPC picks one) passes."""
    from island_jax.cli import port_in_use

    host, _, port = address.rpartition(":")
    if not port.isdigit():
        sys.exit(f"--coordinator={address}: cannot read it; give HOST:PORT, e.g. --coordinator=localhost:50051")
    taken = port_in_use(host, int(port))
    if taken:
        sys.exit(f"--coordinator={address}: the port is in use by another process (binding {taken} fails); pick a "
                 "free port with --coordinator=HOST:PORT")


def _dry_run(config, names) -> None:
    """Prints `island.memory.dry_run`'s table of islands `names` and exits on a config that does not fit. The
    process gets as many virtual CPU devices as the largest island compiled on them; with a target it uses the CPU
    backend alone (unless JAX_PLATFORMS says otherwise): the targets' devices are compile-only."""
    import os

    from island_jax import config as config_lib
    from island_jax.island import aot, memory
    from island_jax.mesh import use_cpu_devices

    try:
        targets = aot.parse_targets(_TARGET.value, names) if _TARGET.value is not None else {}
        import jax

        if targets and not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")  # no local accelerator is looked for (libtpu would log that)
        local = [config.islands[n].num_devices for n in names if n not in targets]
        use_cpu_devices(max([n for n in local if n <= memory.SHAPES_ONLY_ABOVE], default=1))

        results = memory.dry_run(config, names, jax.devices(), targets)
        print(memory.table(results, config), flush=True)  # the results carry each island's retargeted hardware
        memory.check_compiled(results)
    except config_lib.ConfigError as e:
        sys.exit(str(e))


def main(argv):
    from island_jax import allocator
    from island_jax import config as config_lib

    _quiet_libraries()
    allocator.configure()  # glibc malloc's settings for every role (a MALLOC_*_ variable set by hand wins)

    # A stopped role (the launcher stops the others when one fails) unwinds like an error, so that its
    # checkpoint being written in the background is finished before the process ends.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config, role, name = _CONFIG.value, _ROLE.value, _ISLAND.value
    if argv[1:]:
        sys.exit(f"unexpected argument {argv[1]!r}: give flags only (--config=PATH, --workdir=DIR, --config.a.b=v, "
                 "...)")
    if role == "island" and not name:
        sys.exit("--role=island needs --island=NAME, one of the config's islands")
    if not _WORKDIR.value and not _DRY_RUN.value:
        sys.exit("--workdir is required: the run's folder (or give --dry_run, which writes nothing)")
    if role == "coordinator" and not _DRY_RUN.value:
        from island_jax.coordinator.shards import ShardError, shard_address

        try:
            _check_port(shard_address(config, _COORDINATOR.value, _SHARD.value))
        except ShardError as e:
            sys.exit(f"ShardError: {e}")
    try:
        # Everything that needs no backend, before JAX starts.
        config_lib.validate(config, island=name if role == "island" else None)
    except config_lib.ConfigError as e:
        sys.exit(str(e))

    from island_jax.mesh import use_cpu_devices

    if _TARGET.value is not None and not _DRY_RUN.value:
        sys.exit("--target compiles for an accelerator that is not here: give it with --dry_run")
    if _DRY_RUN.value:
        _dry_run(config, [name] if role == "island" else list(config.islands.keys()))
        return

    island = config.islands[name] if role == "island" else None
    use_cpu_devices({"all": config_lib.total_devices(config), "coordinator": 1}.get(role) or config_lib.devices_per_process(island))
    if island is not None and island.num_processes > 1:
        from island_jax import distributed

        distributed.initialize(island.num_processes, _PROCESS_ID.value, _ISLAND_COORDINATOR.value, config.distributed)

    from island_jax.checkpoint import CheckpointError
    from island_jax.comm.security import SecurityError
    from island_jax.data import DataError
    from island_jax.protocol import ContributionError, ExchangeError, HandshakeError
    from island_jax.workdir import RunFailed

    try:
        if role == "all":
            from island_jax.run import run_in_process

            run_in_process(config, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
        elif role == "coordinator":
            from island_jax.roles.coordinator import run_coordinator

            run_coordinator(config, _WORKDIR.value, _COORDINATOR.value, insecure=_INSECURE.value,
                            allow_config_change=_ALLOW_CONFIG_CHANGE.value, shard=_SHARD.value,
                            shard_service=_SHARD_SERVICE.value)
        else:
            from island_jax.roles.island import run_island

            try:
                run_island(config, _WORKDIR.value, name, _COORDINATOR.value if config.outer.enabled else None,
                           allow_config_change=_ALLOW_CONFIG_CHANGE.value)
            except Exception as e:
                if island.num_processes > 1:
                    _leave_island(name, e)
                raise
    except config_lib.ConfigError as e:
        sys.exit(str(e))
    except (DataError, HandshakeError, ContributionError, ExchangeError, CheckpointError, FileExistsError,
            SecurityError, TimeoutError, RunFailed) as e:
        sys.exit(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    from island_jax.cli import parse_run_flags

    app.run(main, flags_parser=parse_run_flags)
