"""Catalog of accelerator kinds an island can name in `islands.NAME.hardware`.

Each entry gives the dense (no structured sparsity) bfloat16 peak per device in
TFLOP/s and the memory per device in GB, from the vendor's public figures.
Round planning (`outer.sync = "auto"`) uses only the ratio of peaks, so the
figures need to be right relative to each other, not attainable.
"""

from __future__ import annotations

import functools
import math
import re
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


# Substrings of `jax.Device.device_kind` (lowercase, spaces removed) -> catalog names, first match wins: TPU v5p
# devices call themselves "TPU v5", v5e and v6e ones "TPU v5 lite" and "TPU v6 lite"
_DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("b200", "b200"), ("v6", "tpu-v6e"),
                 ("v5lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5", "tpu-v5p"), ("v4", "tpu-v4"))


def kind_of(device) -> str | None:
    """The catalog name of a device ("cpu" for a CPU device; e.g. "h200" for an "NVIDIA H200"), or None for a
    kind the catalog does not have."""
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "")
    return next((name for part, name in _DEVICE_KINDS if part in kind), None)


@dataclass(frozen=True)
class TpuSlice:
    """A Cloud TPU slice type's size: `devices` (JAX devices: chips, megacore on v4 and v5p), `hosts` (VMs)."""

    generation: str  # "v4", "v5p", "v5e" or "v6e"
    devices: int
    hosts: int


def tpu_slice(accelerator_type: str) -> TpuSlice:
    """The devices and hosts of a Cloud TPU slice type: "v4-16" -> 8 devices on 2 hosts; "v5p-8" -> 4 on 1;
    "v5litepod-16" (or "v5e-16") -> 16 on 4; "v6e-8" -> 8 on 1.

    v4 and v5p count TensorCores (two per chip; a chip is one JAX device, megacore); v5e and v6e count chips.
    Hosts hold 4 chips, except single-host v5e/v6e slices of up to 8 chips.

    Raises:
      ValueError: a type not of these generations, or a size that is not a whole number of chips.
    """
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator_type.strip())
    if not m:
        raise ValueError(f"accelerator_type is {accelerator_type!r}; give a Cloud TPU type such as v4-16, v5p-8, "
                         "v5litepod-16 or v6e-8")
    generation, size = m.group(1).replace("v5litepod", "v5e"), int(m.group(2))
    if generation in ("v4", "v5p"):
        if size < 2 or size % 2:
            raise ValueError(f"accelerator_type {accelerator_type!r}: {generation} counts TensorCores, two per "
                             "chip; use an even size such as 8 or 16")
        chips = size // 2
        return TpuSlice(generation, chips, max(1, -(-chips // 4)))
    if size < 1:
        raise ValueError(f"accelerator_type {accelerator_type!r} has no chips")
    return TpuSlice(generation, size, 1 if size <= 8 else -(-size // 4))


# The targets of `--dry_run --target=NAME`: NAME is KIND-N, KIND a catalog name with a compile-only path
TARGET_KINDS = ("tpu-v4", "tpu-v5p", "tpu-v5e", "tpu-v6e", "h100", "a100")
GPUS_PER_HOST = 8  # an NVIDIA HGX/DGX host's GPUs, of a GPU target's hosts


@dataclass(frozen=True)
class Target:
    """An accelerator a program is compiled for ahead of time, with compile-only devices (`--dry_run --target`).

    Attributes:
      name: as given, e.g. "tpu-v5p-16" or "h100-8".
      hardware: its catalog name (`CATALOG`), e.g. "tpu-v5p": an island compiled for it has this `hardware`.
      platform: "tpu" or "cuda", as `jax.experimental.topologies.get_topology_desc` names it.
      devices: its JAX devices: TPU chips (v4 and v5p names count TensorCores, two per chip: `tpu_slice`), GPUs.
      hosts: the hosts they are on.
      topology: the topology the compiler is given: libtpu's "GENERATION:XxYxZ" (chips), or for CUDA
        "SLICESxHOSTSxGPUS" (1 x hosts x GPUs per host).
    """

    name: str
    hardware: str
    platform: str
    devices: int
    hosts: int
    topology: str

    @property
    def memory_gb(self) -> float:
        """GB per device, the catalog's."""
        return CATALOG[self.hardware].memory_gb


def _torus(chips: int, dims: int) -> list[int]:
    """The chips' standard slice shape of `dims` dimensions, as Cloud TPU lays slices out: from 1 x ... x 1
    (3-D: 2 x 2 x 1, one host), the last of the smallest sides doubled until it holds `chips` (a power of
    two): 8 -> 2x2x2, 16 -> 2x2x4, 32 -> 2x4x4; 2-D: 8 -> 2x4, 16 -> 4x4."""
    shape = [2, 2, 1] if dims == 3 else [1, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, n in enumerate(shape) if n == smallest)] *= 2
    return shape


def target(name: str) -> Target:
    """The `Target` named `name`: "KIND-N" with KIND one of `TARGET_KINDS` and N its size as Cloud TPU and
    GPU clusters count it ("tpu-v5p-16" is 8 chips, "tpu-v6e-8" 8 chips, "h100-8" 8 GPUs on one host).

    Raises:
      ValueError: naming `name` and the forms that exist, for a name of no kind in `TARGET_KINDS`, or a size
        that is no slice (TPU slices of 1, 4, 8 or a power of two of chips; GPUs: up to 8, or whole hosts of 8).
    """
    forms = ", ".join(f"{k}-N" for k in TARGET_KINDS)
    m = re.fullmatch(r"([a-z0-9-]+?)-(\d+)", name.strip())
    if not m or m.group(1) not in TARGET_KINDS:
        raise ValueError(f"target {name!r} is not one this catalog compiles for; give one of {forms} (e.g. "
                         "tpu-v5p-16, tpu-v6e-8, h100-8)")
    kind_name, size = m.group(1), int(m.group(2))
    if kind(kind_name) == "tpu":
        generation = kind_name.removeprefix("tpu-")
        tpu = tpu_slice(f"{generation}-{size}")
        chips = tpu.devices
        three_d = generation in ("v4", "v5p")
        if chips < (4 if three_d else 1) or chips & (chips - 1):
            raise ValueError(f"target {name!r}: {chips} chips make no {generation} slice; use a power of two of "
                             f"chips{' from 4 (' + generation + '-8)' if three_d else ''}, e.g. "
                             f"{kind_name}-{16 if three_d else 8}")
        topology = f"{generation}:{'x'.join(map(str, _torus(chips, 3 if three_d else 2)))}"
        return Target(name, kind_name, "tpu", chips, tpu.hosts, topology)
    if size < 1 or (size > GPUS_PER_HOST and size % GPUS_PER_HOST):
        raise ValueError(f"target {name!r}: {size} GPUs are no cluster of {GPUS_PER_HOST}-GPU hosts; use up to "
                         f"{GPUS_PER_HOST}, or a multiple of {GPUS_PER_HOST}")
    hosts = max(1, size // GPUS_PER_HOST)
    return Target(name, kind_name, "cuda", size, hosts, f"1x{hosts}x{size // hosts}")
