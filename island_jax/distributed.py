"""An island of several processes (hosts): one `jax.distributed` job, and a check of its CPU collectives.

Every process of a multi-process island calls `initialize` before JAX starts its backend. The island's processes
then form one job of their own (each island has its own JAX coordinator; islands never share one):
`jax.devices()` lists every device of the island, the mesh spans them, and the inner step is one SPMD program
over all of them. The coordinator address, process count and id come from the flags (`--island_coordinator`,
`--process_id`) or, without them, from the cluster environment `jax.distributed` detects (SLURM, TPU VMs). The
runtime's heartbeat and shutdown timeouts (`config.distributed`) end a process whose peer died with an error
rather than leaving it in a collective forever.

`check_collectives` is the start-up self-check of a multi-process CPU island (gloo collectives): a
reduce-scatter and an all-gather of known values at the sizes the island's own programs move, compared with the
exact expected result, against silently wrong results such as jax-ml/jax#40830's (docs/cluster.md).
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.lax import all_gather, psum_scatter
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

_AXIS = "processes"  # the self-check's one mesh axis, over every device of the island


class CollectiveCheckError(RuntimeError):
    """A collective of the island returned other values than the exact expected ones (see `check_collectives`)."""


def initialize(num_processes: int, process_id: int | None, coordinator_address: str | None, timeouts) -> None:
    """Joins this process to its island's `jax.distributed` job (before JAX starts its backend).

    Args:
      num_processes: `islands.NAME.num_processes` (more than 1).
      process_id: this process's index in the island (0 hosts the island's JAX coordinator), or None: from
        the cluster environment (SLURM, TPU VM). With both it and `coordinator_address`, cluster detection is
        off ("deactivate"), so every process uses all of its host's devices.
      coordinator_address: the island's JAX coordinator, "HOST:PORT" of its process 0, or None: from the
        cluster environment.
      timeouts: `config.distributed` (`initialization_timeout_seconds`, `heartbeat_timeout_seconds`,
        `shutdown_timeout_seconds`).

    Raises:
      RuntimeError: the job formed with another process count than the config's.
    """
    # On CPU, collectives between processes run over gloo (TCP); other backends bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Given the flags, nothing is detected: under SLURM, detection would also pick local_device_ids, binding each
    # process to the one GPU of its SLURM_LOCALID (jax/_src/clusters/slurm_cluster.py), so a process per node
    # with several GPUs would see only GPU 0. Without them, the cluster environment supplies everything.
    explicit = process_id is not None and coordinator_address is not None
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        cluster_detection_method="deactivate" if explicit else None,
        initialization_timeout=int(timeouts.initialization_timeout_seconds),
        heartbeat_timeout_seconds=int(timeouts.heartbeat_timeout_seconds),
        shutdown_timeout_seconds=int(timeouts.shutdown_timeout_seconds),
    )
    if jax.process_count() != num_processes:
        raise RuntimeError(
            f"the island's jax.distributed job has {jax.process_count()} processes but its config says "
            f"num_processes={num_processes}; start exactly that many, or correct the config"
        )
    logging.info("process %d of %d of the island joined its jax.distributed job (%d devices in all, %d here)",
                 jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count())


def allgather_json(value) -> list:
    """Every process's `value` (anything JSON can hold), in process order: a collective over the island's
    devices, so the training thread calls it at the same point on every process. One process: [value]."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))
    # padded to a power of two (256 bytes at least), so that the gather's few shapes each compile once
    padded = np.zeros(max(256, 1 << (int(sizes.max()) - 1).bit_length()), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)])) for row, n in zip(rows, sizes.reshape(-1))]


def exchange_rows(mine: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Every process's 1-D `mine`, in process order, where process p's has `sizes[p]` elements (every process
    knows every size): a collective over the island's devices (its interconnect), padded to the longest, so the
    training thread calls it at the same point on every process. One process: [mine].

    Raises:
      ValueError: `mine` is not `sizes[this process]` long.
    """
    if len(mine) != sizes[jax.process_index()]:
        raise ValueError(f"process {jax.process_index()} sends {len(mine)} elements where every process expects "
                         f"{sizes[jax.process_index()]}")
    if jax.process_count() == 1:
        return [mine]
    padded = np.zeros(max(max(sizes), 1), mine.dtype)
    padded[: len(mine)] = mine
    rows = multihost_utils.process_allgather(padded)
    return [rows[p, :n] for p, n in enumerate(sizes)]


def check_sizes(leaf_sizes: Iterable[int], num_devices: int) -> list[int]:
    """The element counts the self-check moves per device: each distinct parameter leaf size (what the inner
    step reduces and the exchange gathers), rounded up to a multiple of `num_devices`, ascending."""
    return sorted({-(-int(n) // num_devices) * num_devices for n in leaf_sizes if n > 0})


def _pattern(num_elements: int, salt: int) -> np.ndarray:
    """float32 integers below 2**12, so that sums over up to 4096 devices are exact."""
    return ((np.arange(num_elements, dtype=np.int64) * 7 + salt) % 1021).astype(np.float32)


def check_collectives(devices: Sequence[jax.Device], sizes: Sequence[int]) -> None:
    """A reduce-scatter and an all-gather of known float32 values over `devices`, compared exactly.

    For each size n (elements per device, a multiple of len(devices)): device d holds
    `_pattern(n, d)`; the reduce-scatter must leave device d the d-th n/D slice of their sum, and the
    all-gather of those slices must give every device the whole sum, bit for bit.

    Raises:
      CollectiveCheckError: naming the collective, the size, the device and the first wrong element (with
        its value, the expected one and the distance in ulps).
    """
    count = len(devices)
    mesh = jax.make_mesh((count,), (_AXIS,), axis_types=(AxisType.Explicit,), devices=list(devices))
    sharding = NamedSharding(mesh, P(_AXIS))
    reduce_scatter = jax.jit(jax.shard_map(
        lambda x: psum_scatter(x, _AXIS, scatter_dimension=0, tiled=True), mesh=mesh, in_specs=P(_AXIS),
        out_specs=P(_AXIS), check_vma=False,
    ))
    gather = jax.jit(jax.shard_map(
        lambda x: all_gather(x, _AXIS, axis=0, tiled=True), mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
        check_vma=False,
    ))
    for n in sizes:
        parts = [_pattern(n, d) for d in range(count)]
        total = np.sum(np.stack(parts), axis=0, dtype=np.float32)
        inputs = jax.make_array_from_callback((count * n,), sharding, lambda idx: np.concatenate(parts)[idx])
        scattered = reduce_scatter(inputs)
        piece = n // count
        for shard in scattered.addressable_shards:
            d = shard.index[0].start // piece
            _compare("reduce-scatter", n, d, np.asarray(shard.data), total[d * piece : (d + 1) * piece])
        gathered = gather(scattered)
        for shard in gathered.addressable_shards:
            _compare("all-gather", n, shard.index[0].start // n, np.asarray(shard.data), total)
    logging.info("the island's collectives over %d devices returned the exact values at %d sizes (up to %d "
                 "float32 elements per device)", count, len(sizes), max(sizes, default=0))


def _compare(what: str, n: int, device: int, got: np.ndarray, expected: np.ndarray) -> None:
    wrong = np.flatnonzero(got.view(np.uint32) != expected.view(np.uint32))
    if wrong.size:
        i = int(wrong[0])
        ulps = abs(int(got.view(np.int32)[i]) - int(expected.view(np.int32)[i]))
        raise CollectiveCheckError(
            f"the island's {what} of {n} float32 elements per device returned wrong values on device {device}: "
            f"{wrong.size} of {got.size} elements differ, the first at element {i} of {got.size} ({got[i]!r}, "
            f"expected {expected[i]!r}: {ulps} ulp off). The collectives between this island's processes corrupt "
            "data silently (as in jax-ml/jax#40830); training would diverge between its hosts. Use a jax/jaxlib "
            "release without the fault, or run the island as one process"
        )
