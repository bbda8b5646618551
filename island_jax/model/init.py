"""Initial parameters, produced the same way in every process, and their checksum."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from island_jax.model.transformer import Transformer, partition_specs


def init_params(config: ml_collections.ConfigDict) -> tuple[nnx.GraphDef, dict, dict]:
    """Builds the model from `config.seed` on the CPU backend.

    Initialising on the CPU, whatever accelerator a process has, gives every
    island and the coordinator the same bits.

    Returns:
      (graphdef, params, specs): the model's static structure; its `nnx.Param`
      values as a nested dict of NumPy arrays (`config.model.param_dtype`,
      except the float32 routers); and a matching dict of PartitionSpecs.
    """
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = Transformer(config, rngs=nnx.Rngs(config.seed))
        graphdef, state = nnx.split(model, nnx.Param)
        specs = partition_specs(state)
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    return graphdef, params, specs


def checksum(tree: Any) -> str:
    """SHA-256 (first 16 hex digits) over every leaf's shape, dtype and bytes, in pytree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def count(tree: Any) -> int:
    """Number of elements over all leaves."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))
