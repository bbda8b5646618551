"""An island's device mesh, and the names of its axes."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType

DATA_AXIS = "data"  # splits the batch (and, later, FSDP shards)
EXPERT_AXIS = "expert"  # holds the experts of every MoE layer; also splits the batch outside them
AXES = (DATA_AXIS, EXPERT_AXIS)  # the mesh's axes, in order
BATCH_AXES = AXES  # the batch is split over both axes


def use_cpu_devices(count: int) -> None:
    """Gives this process `count` (at least 1) virtual CPU devices; call it before JAX starts its backend
    (the first device query). Processes on accelerators use their own devices and ignore it."""
    jax.config.update("jax_num_cpu_devices", max(count, 1))


def island_mesh(data: int, expert: int, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """A (data, expert) mesh over exactly these devices, with Explicit axis types.

    `data` splits the batch (and, later, FSDP shards); `expert` holds the
    experts of every MoE layer and also splits the batch outside them.

    Args:
      data, expert: the sizes of the `DATA_AXIS` and `EXPERT_AXIS` axes.
      devices: the island's devices, exactly data x expert of them.

    Raises:
      ValueError: if data x expert differs from len(devices).
    """
    if data * expert != len(devices):
        raise ValueError(f"a mesh of data={data} x expert={expert} needs {data * expert} devices, got {len(devices)}")
    return jax.make_mesh((data, expert), AXES, axis_types=(AxisType.Explicit, AxisType.Explicit), devices=devices)
