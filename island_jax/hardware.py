"""Catalog of accelerator kinds an island can name in `islands.NAME.hardware`.

Each entry gives the dense (no structured sparsity) bfloat16 peak per device in
TFLOP/s and the memory per device in GB, from the vendor's public figures.
Round planning (`outer.sync = "auto"`) uses only the ratio of peaks, so the
figures need to be right relative to each other, not attainable.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind: `peak_tflops` (dense bf16, TFLOP/s per device), `memory_gb` (per device)."""

    name: str
    peak_tflops: float
    memory_gb: float


CATALOG = {
    h.name: h
    for h in (
        # Not a measurement: emulated islands on one machine share its cores, so
        # every virtual CPU device counts the same; islands.NAME.simulated_speed
        # is how an emulated island is made slower.
        Hardware("cpu", 1.0, 0.0),
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 with sparsity), 80 GB HBM2e.
        Hardware("a100", 312.0, 80.0),
        # NVIDIA H100 datasheet, SXM: BF16 1,979 TFLOPS with sparsity, so 989 dense; 80 GB HBM3.
        Hardware("h100", 989.0, 80.0),
        # NVIDIA H200 datasheet, SXM: the H100's compute (BF16 1,979 sparse, 989 dense); 141 GB HBM3e.
        Hardware("h200", 989.0, 141.0),
        # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs; BF16 4.5 PFLOPS sparse per
        # GPU (HGX B200), so 2,250 dense; 1,440 GB for 8 GPUs, 180 GB each.
        Hardware("b200", 2250.0, 180.0),
        # Google Cloud TPU v4 documentation: 275 TFLOPS bf16 per chip, 32 GiB HBM.
        Hardware("tpu-v4", 275.0, 32.0),
        # Google Cloud TPU v5e documentation: 197 TFLOPS bf16 per chip, 16 GB HBM2.
        Hardware("tpu-v5e", 197.0, 16.0),
        # Google Cloud TPU v5p documentation: 459 TFLOPS bf16 per chip, 95 GB HBM.
        Hardware("tpu-v5p", 459.0, 95.0),
        # Google Cloud TPU v6e (Trillium) documentation: 918 TFLOPS bf16 per chip, 32 GB HBM.
        Hardware("tpu-v6e", 918.0, 32.0),
    )
}


def kind(name: str) -> str:
    """"cpu", "gpu" or "tpu": how a launcher asks a scheduler for devices of the catalog's `name`."""
    return "cpu" if name == "cpu" else "tpu" if name.startswith("tpu-") else "gpu"


def lookup(name: str) -> Hardware:
    """The catalog entry for `name`.

    Raises:
      KeyError: with the known names, for a kind not in the catalog.
    """
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"hardware {name!r} is not in the catalog; choose one of {sorted(CATALOG)}") from None


_MEASURE_LOCK = threading.Lock()


def measured_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's CPU matmul rate, FLOP/s: the best of `repeats` float32 [n, n] x [n, n] products on the
    first CPU device (2 n^3 FLOPs each), after one that compiles. Measured once per process (about 0.1 s),
    under a lock, so that islands starting on threads of one process all get the same figure.

    It stands for the CPU's peak: XLA:CPU runs every virtual device of a process on the same cores, so
    this one figure is the peak of all of them together, not of each.
    """
    with _MEASURE_LOCK:
        return _measure_cpu_peak_flops(n, repeats)


@functools.cache
def _measure_cpu_peak_flops(n: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def peak_flops(hardware: str, num_devices: int, platform: str) -> float:
    """The most FLOP/s an island's devices can do, the denominator of its MFU.

    On an accelerator, num_devices x the catalog's dense bf16 peak of `hardware`. On CPU ("cpu" platform),
    the machine's measured matmul rate (`measured_cpu_peak_flops`), whatever the number of virtual devices,
    since they share the same cores.

    Raises:
      KeyError: `hardware` is not in the catalog (on an accelerator).
    """
    if platform == "cpu":
        return measured_cpu_peak_flops()
    return num_devices * lookup(hardware).peak_tflops * 1e12


# Substrings of `jax.Device.device_kind` (lowercase, spaces removed) -> catalog names
_DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("b200", "b200"), ("v6", "tpu-v6e"),
                 ("v5p", "tpu-v5p"), ("v4", "tpu-v4"))


def kind_of(device) -> str | None:
    """The catalog name of a device ("cpu" for a CPU device; e.g. "h200" for an "NVIDIA H200"), or None for a
    kind the catalog does not have."""
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "")
    return next((name for part, name in _DEVICE_KINDS if part in kind), None)
