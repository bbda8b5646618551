"""Compiling an island's programs ahead of time from abstract shapes, for the island's devices and for
accelerators that are not here (compile-only TPU v5p devices through libtpu, the `tpu-aot` extra)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from island_jax.config import ConfigError, validate
from island_jax.hardware import kind_of, target
from island_jax.island import aot, memory
from island_jax.island import step as step_lib
from island_jax.mesh import BATCH_AXES, island_mesh
from island_jax.model.moe import MoE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "configs"))

import two_islands  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tpu_vm(monkeypatch):
    """libtpu asks a TPU VM's metadata for these where they are unset, and logs that it could not."""
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-16")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _learned(c):
    """`c` with learned positions: the TPU compiler takes about 8 s longer over this file's programs with rotary
    ones, and the figures asserted here are those of the learned table (1,920,128 parameters)."""
    c.model.positions = "learned"
    return c


def _v5p(data=2, fsdp=2, expert=2, dispatch="capacity"):
    """`two_islands`' model with island a retargeted to tpu-v5p-16 (8 chips) on mesh data x fsdp x expert, with
    the learned position table it had before rotary positions (`_learned`)."""
    c = _learned(two_islands.get_config())
    c.islands.a.update(num_devices=data * fsdp * expert)
    c.islands.a.mesh.update(data=data, fsdp=fsdp, expert=expert)
    c.moe.dispatch = dispatch
    t = target("tpu-v5p-16")
    c = aot.retarget(c, {"a": t})
    validate(c)
    return c, t


def test_targets_are_named_and_counted_as_cloud_tpu_and_gpu_clusters_count_them():
    got = {n: (t.hardware, t.platform, t.devices, t.hosts, t.topology) for n in (
        "tpu-v5p-16", "tpu-v4-8", "tpu-v5e-16", "tpu-v6e-8", "tpu-v6e-1", "tpu-v5p-2048", "h100-8", "a100-64")
        for t in [target(n)]}
    assert got == {
        "tpu-v5p-16": ("tpu-v5p", "tpu", 8, 2, "v5p:2x2x2"),
        "tpu-v4-8": ("tpu-v4", "tpu", 4, 1, "v4:2x2x1"),
        "tpu-v5e-16": ("tpu-v5e", "tpu", 16, 4, "v5e:4x4"),
        "tpu-v6e-8": ("tpu-v6e", "tpu", 8, 1, "v6e:2x4"),
        "tpu-v6e-1": ("tpu-v6e", "tpu", 1, 1, "v6e:1x1"),
        "tpu-v5p-2048": ("tpu-v5p", "tpu", 1024, 256, "v5p:8x8x16"),
        "h100-8": ("h100", "cuda", 8, 1, "1x1x8"),
        "a100-64": ("a100", "cuda", 64, 8, "1x8x8"),
    }
    for name in ("tpu-v5p-16", "tpu-v4-8", "tpu-v5e-16", "tpu-v6e-1"):
        devices = aot.compile_only_devices(target(name))
        assert (len(devices), kind_of(devices[0])) == (target(name).devices, target(name).hardware)
    assert jax.devices()[0].platform == "cpu"  # the compile-only devices are no backend of this process


def test_an_unknown_target_or_one_of_other_hardware_fails_naming_both():
    with pytest.raises(ConfigError, match=r"--target: target 'tpu-v9-8' is not one this catalog compiles for; give "
                                          r"one of tpu-v4-N, tpu-v5p-N, tpu-v5e-N, tpu-v6e-N, h100-N, a100-N"):
        aot.parse_targets("tpu-v9-8", ["a", "b"])
    with pytest.raises(ConfigError, match=r"--target names island 'c', which is not one of \['a', 'b'\]"):
        aot.parse_targets("a=tpu-v5p-16,c=tpu-v5p-16", ["a", "b"])
    assert {n: t.name for n, t in aot.parse_targets("b=tpu-v6e-8", ["a", "b"]).items()} == {"b": "tpu-v6e-8"}
    c = two_islands.get_config()
    c.islands.a.update(hardware="h100", num_devices=8)
    c.islands.a.mesh.update(data=2, fsdp=2, expert=2)
    with pytest.raises(ConfigError, match=r"islands.a.hardware is 'h100' but target 'tpu-v5p-16' is 'tpu-v5p' "
                                          r"devices; give a target of 'h100' devices, or set islands.a.hardware="
                                          r"'tpu-v5p'"):
        aot.compile_island(c, "a", target_=target("tpu-v5p-16"))
    c, _ = _v5p()
    with pytest.raises(ConfigError, match=r"islands.a's mesh data=2 x fsdp=2 x expert=2 is 8 devices but target "
                                          r"'tpu-v5p-8' has 4"):
        aot.compile_island(aot.retarget(c, {"a": target("tpu-v5p-8")}), "a", target_=target("tpu-v5p-8"))


def test_the_inner_step_for_a_v5p_slice_takes_the_arguments_its_shardings_say():
    c, t = _v5p()
    mesh = island_mesh(2, 2, aot.compile_only_devices(t), fsdp=2)
    _, params, opt_state, _ = aot.abstract_state(c, "a", mesh)
    inputs, targets, _ = aot.batch_shapes(c, mesh, c.islands.a.batch_size)
    params_bytes = sum(aot.per_device_bytes(x) for x in jax.tree.leaves(params))
    adamw_bytes = sum(aot.per_device_bytes(x) for x in jax.tree.leaves(opt_state))
    # 1,920,128 float32 parameters: the embeddings and head split over fsdp, the experts over fsdp x expert
    assert params_bytes == 2_269_696
    assert adamw_bytes == 2 * params_bytes + 2 * 4  # both moments, and AdamW's and the schedule's int32 counts
    batch_bytes = 2 * aot.per_device_bytes(inputs)  # inputs and targets, int32 [8, 128] over 8 devices
    assert batch_bytes == 2 * 8 * 128 * 4 // 8
    # The step seeds no router jitter here (moe.jitter_noise 0): jit leaves out an argument its program does not read.
    by_hand = params_bytes + adamw_bytes + batch_bytes
    assert by_hand == 6_810_120
    programs = aot.compile_island(c, "a", target_=t, programs=["inner_step"])
    assert programs.devices == "8 TPU v5 (target tpu-v5p-16)"
    [inner] = programs.programs
    assert inner.program == "inner_step"
    # The TPU compiler lays each of the 112 argument buffers out in its own tiles: 13,304 bytes (0.2%) of
    # padding over the figure from the shardings, under 512 bytes a buffer.
    assert inner.argument == 6_823_424
    assert 0 <= inner.argument - by_hand < 112 * 512
    assert inner.resident == params_bytes  # the anchor beside the step; parameters and AdamW state are donated
    assert inner.alias == 6_822_400 and inner.temp > 0 and inner.flops > 0


def test_the_dropless_moe_compiles_its_ragged_all_to_all_for_tpu():
    c, t = _v5p(data=1, fsdp=2, expert=4, dispatch="dropless")
    c.model.num_layers = 1
    mesh = island_mesh(1, 4, aot.compile_only_devices(t), fsdp=2)
    m = c.model
    layer = nnx.eval_shape(lambda: MoE(m.d_model, c.moe.num_experts, c.moe.num_experts_per_token,
                                       c.moe.expert_hidden_dim, c.moe.capacity_factor, True, dispatch="dropless",
                                       rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((8, m.seq_len, m.d_model), jnp.float32, sharding=NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):  # traced for the TPU mesh: the dispatch check passes, and the output is the input's shape
        y = jax.eval_shape(lambda state, x: nnx.merge(graphdef, state)(x)[0], state, x)
    assert y.shape == (8, m.seq_len, m.d_model)
    with jax.set_mesh(mesh):  # and the island's inner step
        _, params, opt_state, tx = aot.abstract_state(c, "a", mesh)
        inputs, targets, _ = aot.batch_shapes(c, mesh, c.islands.a.batch_size)
        step = step_lib.build_train_step(c, aot.abstract_params(c)[0], tx)
        text = step.lower(params, opt_state, inputs, targets, 0).compile().as_text()
    # tokens to their experts' devices and back, forward and backward
    assert text.count("ragged-all-to-all(") == 4


def test_a_config_the_target_cannot_hold_is_refused_naming_the_island_and_the_bytes():
    """Island a of `two_islands` (1.9M float32 parameters) on one TPU v5e chip whose config gives it 100 MB
    (`memory_gb` 0.1, kept: the island is of the target's kind already): its parameters, AdamW state and anchor
    are 30.7 MB, and the compiler's inner step needs 115.0 MB with its temporaries and code, so the dry run (of the inner step alone, here) refuses it, having made no
    array. (A model that overflows the chip's whole 16 GB is refused alike, docs/island.md; the TPU compiler takes
    13 s or more over one, too long for this suite.)"""
    c = _learned(two_islands.get_config())
    c.islands.a.update(num_devices=1, batch_size=8, hardware="tpu-v5e", memory_gb=0.1)
    c.islands.a.mesh.update(data=1, fsdp=1, expert=1)
    before = jax.live_arrays()  # held, so that no array of another test is freed and its id reused meanwhile
    results = memory.dry_run(c, ["a"], (), aot.parse_targets("a=tpu-v5e-1", ["a", "b"]), programs=["inner_step"])
    [inner] = results["a"].compiled.programs
    assert (results["a"].hardware, results["a"].memory_gb) == ("tpu-v5e", 0.1)
    assert (inner.argument, inner.temp, inner.resident, inner.peak) == (23_050_752, 65_696_256, 7_680_512, 114_979_840)
    with pytest.raises(ConfigError) as refused:
        memory.check_compiled(results)
    assert str(refused.value).startswith(
        "ConfigError: islands.a compiled for tpu-v5e-1 needs 0.11 GB per device in its inner_step but its devices "
        "have 0.1 GB (islands.a.memory_gb, or the catalog's for 'tpu-v5e'): the compiler's arguments 0.02, outputs "
        "0.00 (not aliased), temporaries 0.07 and code 0.02 GB, and 0.01 GB of the island's state beside them")
    assert [a for a in jax.live_arrays() if all(a is not b for b in before)] == []
