"""Where an island's arrays live on its mesh (`Shardings`): parameters by their partition specs, batches split
over `mesh.BATCH_AXES`, and arrays read back whole for metrics.

On a mesh of several processes each process places only the shards its own devices hold and reads arrays back
through a jitted all-gather over the island's interconnect; `shards.HostLeaf` is a process's host copy of its
parameter shards.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.mesh import BATCH_AXES


class Shardings:
    """Where an island's arrays live on its mesh: parameters by their partition specs, batches split over
    `mesh.BATCH_AXES`.

    On a mesh that spans several processes (a multi-process island) every process places only the shards its
    own devices hold (`jax.make_array_from_callback`, no communication, so it is safe on any thread), and
    reads arrays back whole through a jitted all-gather over the island's interconnect (`to_host`, a
    collective: the training thread only, at the same point on every process).

    Attributes:
      multi_process: the mesh spans devices of other processes.
    """

    def __init__(self, mesh: jax.sharding.Mesh, specs: dict, shapes: dict | None = None):
        self.params = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        self.leaves = jax.tree.leaves(self.params)
        # the shapes of the parameter leaves that are split over devices: never gathered whole (`to_host`)
        self._split_shapes = set() if shapes is None else {
            tuple(np.shape(x)) for x, s in zip(jax.tree.leaves(shapes), self.leaves) if not s.is_fully_replicated
        }
        self.batch = NamedSharding(mesh, P(BATCH_AXES))
        self.multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        self._replicate = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))

    def _put(self, tree, shardings, copy: bool = False):
        alias = False if copy else None  # a jax.Array already placed is itself unless a copy is asked for
        if not self.multi_process:
            return jax.device_put(tree, shardings, may_alias=alias)

        def put(x, sharding):
            if isinstance(x, jax.Array):  # drawn or restored onto the devices already
                return jax.device_put(x, sharding, may_alias=alias)
            return jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index])

        return jax.tree.map(put, tree, shardings)

    def place(self, params: dict, copy: bool = False) -> dict:
        """The parameters on the devices, sharded: NumPy arrays (whole on every process), or `jax.Array`s (drawn
        sharded, `init_params` on a mesh, or restored), which are returned as they are when already placed so,
        unless `copy`."""
        return self._put(params, self.params, copy)

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a [batch_size, ...] batch that this process's devices hold (all of them in one process).

        Raises:
          ValueError: they are not contiguous (a mesh whose devices are not grouped by process).
        """
        spans = sorted({(i[0].start or 0, batch_size if i[0].stop is None else i[0].stop)
                        for i in self.batch.addressable_devices_indices_map((batch_size, 1)).values()})
        lo, hi = spans[0][0], spans[-1][1]
        if sum(b - a for a, b in spans) != hi - lo:
            raise ValueError(f"this process's rows of the batch are not contiguous: {spans}")
        return slice(lo, hi)

    def batch_of(self, windows: np.ndarray, batch_size: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """A batch on the devices: (inputs, targets) int32 [B, S] each, and the segment ids int32 [B, S + 1] of
        packed records (None for byte windows).

        Args:
          windows: uint8 [b, S + 1] byte windows, or int32 [b, 2, S + 1] packed records (tokens, then segment
            ids: `data.records.PreparedDataset`); this process's rows (`local_rows`) of a batch of `batch_size`
            (default: b, one process holds all).
        """
        windows = np.asarray(windows).astype(np.int32)
        segments = None
        if windows.ndim == 3:
            windows, segments = windows[:, 0], self.rows_of(windows[:, 1], batch_size)
        return self.rows_of(windows[:, :-1], batch_size), self.rows_of(windows[:, 1:], batch_size), segments

    def rows_of(self, rows: np.ndarray, batch_size: int | None = None) -> jax.Array:
        """[b, S] rows (this process's, `local_rows`, of a batch of `batch_size`) on the devices, split as a batch."""
        if not self.multi_process:
            return jax.device_put(rows, self.batch)
        return jax.make_array_from_process_local_data(self.batch, rows, (batch_size or len(rows), rows.shape[1]))

    def to_host(self, tree):
        """Every leaf whole, as NumPy (a collective on a multi-process mesh unless the leaves are replicated): for
        metrics and losses.

        Raises:
          ValueError: on a multi-process mesh, a leaf shaped like a parameter that is split over the devices (no
            process holds more of the model than its shards; `shards.HostLeaf` is a process's host copy).
        """
        if not self.multi_process:
            return jax.device_get(tree)
        leaves, treedef = jax.tree.flatten(tree)
        spread = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_replicated]
        for i in spread:
            if tuple(leaves[i].shape) in self._split_shapes:
                raise ValueError(f"to_host of an array shaped like a parameter split over the island's processes "
                                 f"({tuple(leaves[i].shape)}) would hold it whole on every host; read this process's "
                                 "shards instead (shards.HostLeaf)")
        for i, x in zip(spread, self._replicate([leaves[i] for i in spread]) if spread else ()):
            leaves[i] = x
        host = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x) for x in leaves]
        return jax.tree.unflatten(treedef, host)
