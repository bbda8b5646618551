"""`python -m island_jax.plan`: the planner's command line (docs/planner.md).

  python -m island_jax.plan --config=experiments/configs/two_islands.py --step_seconds=0.19
  python -m island_jax.plan --total_params=671e9 --active_params=37e9 --layers=61 \\
      --island=name=us,hardware=h100,devices=1024,batch=2048,seq_len=4096 \\
      --island=name=eu,hardware=h100,devices=1024,batch=2048,seq_len=4096 --gbps=25 --rtt_ms=150
  python -m island_jax.plan --workdir=WORKDIR      # a finished run: predicted against measured
  (add --coordinator_shards=16 for a coordinator cut by chunk range into 16 processes, docs/cluster.md)
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

from island_jax.outer import codec as codec_lib
from island_jax.plan.baseline import DP_BYTES
from island_jax.plan.checks import PlanError
from island_jax.plan.compute import MERGE_FIXED_NS, MERGE_PER_ISLAND_NS, CoordinatorSpec, ModelSpec
from island_jax.plan.inputs import LINK_KEYS, from_config, link_of, parse_island, parse_number
from island_jax.plan.memory import memory_lines
from island_jax.plan.planner import plan
from island_jax.plan.prediction import predict
from island_jax.plan.wire import TOPOLOGIES, LinkSpec, OuterSpec

_OUTER_FLAGS = ("codec", "block_size", "update_codec", "topk_group", "topk_k", "bytes_per_param", "sync", "reference_island", "round_seconds", "fragments",
                "overlap_steps", "pipeline", "chunk_bytes", "shared_link", "fragment_overhead_seconds", "backward_overlap",
                "topology")  # flags named as OuterSpec's fields
_PLAN_FLAGS = (*_OUTER_FLAGS, *LINK_KEYS, "total_params", "active_params", "layers", "island", "step_seconds",
               "mfu", "inner_steps", "coordinator_gbps", "coordinator_cores", "coordinator_shards", "merge_fixed_ns",
               "merge_per_island_ns", "dp_dtype")


def _per_island(text: str, names: Sequence[str]) -> dict[str, float]:
    """{island: seconds} from --step_seconds: "0.2" (every island), "a=0.2,b=0.4", or "" (none).

    Raises:
      PlanError: a value that is not a number, or a name not among `names`.
    """
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(names, parse_number(text, float, "--step_seconds"))
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in names:
            raise PlanError(f"--step_seconds names {name!r}, which is not one of the islands {list(names)}")
        out[name] = parse_number(value, float, f"--step_seconds, {name}")
    return out


def _main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    given = {name for name in f if f[name].present}
    if f.workdir:
        extra = sorted(given & set(_PLAN_FLAGS) - {"fragment_overhead_seconds"})
        if extra:
            raise PlanError(f"--workdir plans the run as it was; leave out {', '.join('--' + e for e in extra)}")
        prediction = predict(f.workdir, f.fragment_overhead_seconds)
        print(prediction.plan)
        print(f"predicted against measured compute utilization ({f.workdir}):")
        print(prediction)
        return 0
    link_flags = {k: getattr(f, k) for k in LINK_KEYS if k in given}
    if f.config is not None:
        if f.island:
            raise PlanError("--island describes islands the config already has; give one or the other")
        config = f.config
        if config.comm.link.bandwidth_gbps:
            link = dataclasses.replace(link_of(config), **link_flags)
        else:
            link = dataclasses.replace(link_of(config), gbps=f.gbps, **link_flags)
            print(f"note: the config emulates no link (comm.link.bandwidth_gbps = 0); planned on {link.gbps:g} "
                  "Gbit/s (--gbps)")
        model, islands, outer, coordinator = from_config(
            config, step_seconds=_per_island(f.step_seconds, list(config.islands.keys())), mfu=f.mfu, link=link)
        model = ModelSpec(*(getattr(f, k) if k in given else getattr(model, a) for k, a in
                        (("total_params", "total_params"), ("active_params", "active_params"), ("layers", "num_layers"))),
                      # the config's FLOPs per token, unless the flags changed the parameter counts
                      flops_per_token=0.0 if {"total_params", "active_params"} & set(given) else model.flops_per_token)
    elif f.island:
        link = LinkSpec(f.gbps, f.rtt_ms, f.connections, f.window_bytes)
        model = ModelSpec(f.total_params, f.active_params, f.layers)
        islands = [parse_island(text, link) for text in f.island]
        steps = _per_island(f.step_seconds, [i.name for i in islands])
        islands = [i if i.step_seconds or i.name not in steps else dataclasses.replace(i, step_seconds=steps[i.name])
                   for i in islands]
        outer, coordinator = OuterSpec(), CoordinatorSpec()
    else:
        raise PlanError("give --config=CONFIG, --workdir=WORKDIR, or the model and islands "
                        "(--total_params=... --island=name=a,hardware=h100,devices=64,batch=512,seq_len=4096)")
    if "inner_steps" in given:
        islands = [dataclasses.replace(i, inner_steps=f.inner_steps) for i in islands]
    changes = {name: getattr(f, name) for name in _OUTER_FLAGS if name in given or f.config is None}
    if changes.get("overlap_steps", "auto") != "auto":
        changes["overlap_steps"] = parse_number(changes["overlap_steps"], int, "--overlap_steps (or auto)")
    outer = dataclasses.replace(outer, **changes)
    coordinator = dataclasses.replace(
        coordinator, gbps=f.coordinator_gbps or math.inf, cores=f.coordinator_cores,
        fixed_ns_per_param=f.merge_fixed_ns, per_island_ns_per_param=f.merge_per_island_ns,
        shards=f.coordinator_shards if "coordinator_shards" in given else coordinator.shards,  # else the config's
    )
    print(plan(model, islands, outer, coordinator, dp_dtype=f.dp_dtype))
    if f.config is not None:
        print(memory_lines(f.config))
    return 0


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "A run's config (its model, islands, codec, outer loop, link).")
    flags.DEFINE_string("workdir", "", "A finished run's workdir: predict its utilization and print it beside the measured.")
    flags.DEFINE_float("total_params", 1e9, "Parameters of the model (what the exchange moves).")
    flags.DEFINE_float("active_params", 0.0, "Parameters active per token (what a step computes; 0: total).")
    flags.DEFINE_integer("layers", 0, "Layers of the model (fragments hold whole layers; 0: unknown).")
    flags.DEFINE_multi_string("island", [], "name=NAME,hardware=KIND,devices=N,mfu=F,step_seconds=S,batch=B,"
                              "seq_len=T,inner_steps=H,gbps=G,rtt_ms=R,connections=C,window_bytes=W (repeat per island).")
    flags.DEFINE_string("step_seconds", "", "Measured seconds per step: S (every island) or a=S,b=S.")
    flags.DEFINE_float("mfu", 0.4, "MFU of step times computed from the catalog peak.")
    flags.DEFINE_integer("inner_steps", 100, "H of every island.")
    flags.DEFINE_float("gbps", 25.0, "Every island's link, Gbit/s each way (inf: unlimited).")
    flags.DEFINE_float("rtt_ms", 0.0, "Every island's round trip, ms.")
    flags.DEFINE_integer("connections", 16, "Parallel connections per island.")
    flags.DEFINE_integer("window_bytes", 0, "Bytes in flight per connection (0: no window).")
    flags.DEFINE_enum("sync", "steps", ["steps", "auto", "time"], "Round planning (outer.sync).")
    flags.DEFINE_string("reference_island", "", "With --sync=auto: the island whose H is kept ('': the first).")
    flags.DEFINE_float("round_seconds", 0.0, "With --sync=time: compute seconds per round.")
    flags.DEFINE_enum("codec", "int8", list(codec_lib.KINDS), "Codec of the pseudo-gradients (and the updates).")
    flags.DEFINE_enum("update_codec", "", ["", *codec_lib.KINDS], "Codec of the updates ('': --codec's).")
    flags.DEFINE_integer("topk_group", 4096, "topk: elements per group.")
    flags.DEFINE_integer("topk_k", 64, "topk: values kept per group.")
    flags.DEFINE_integer("block_size", 256, "Elements per scale of int8 / int4.")
    flags.DEFINE_float("bytes_per_param", 0.0, "Bytes on the wire per parameter (0: from --codec).")
    flags.DEFINE_integer("fragments", 1, "F, Streaming DiLoCo fragments.")
    flags.DEFINE_string("overlap_steps", "0", "tau: inner steps an update may arrive late, or auto.")
    flags.DEFINE_bool("pipeline", True, "comm.pipeline: the update flows back while contributions arrive.")
    flags.DEFINE_integer("chunk_bytes", 1 << 20, "comm.chunk_bytes: the largest chunk a pipelined exchange overlaps.")
    flags.DEFINE_bool("shared_link", False, "The islands share one link (each gets 1/K of its rate).")
    flags.DEFINE_enum("topology", "coordinator", list(TOPOLOGIES), "coordinator (island_jax) or ring (all-reduce).")
    flags.DEFINE_float("backward_overlap", 0.0, "Steps that hide an exchange's start (2/3: from the backward pass).")
    flags.DEFINE_float("fragment_overhead_seconds", 0.0, "Training-thread seconds per fragment exchanged.")
    flags.DEFINE_float("coordinator_gbps", 0.0, "The coordinator's own link (each shard's), Gbit/s each way (0: unlimited).")
    flags.DEFINE_float("merge_fixed_ns", MERGE_FIXED_NS, "The coordinator's CPU ns per parameter per round.")
    flags.DEFINE_float("merge_per_island_ns", MERGE_PER_ISLAND_NS, "... and per contributing island.")
    flags.DEFINE_integer("coordinator_cores", 64, "CPU cores the coordinator's merge (each shard's) spreads over.")
    flags.DEFINE_integer("coordinator_shards", 1, "Processes the coordinator is cut into by chunk range, each on its "
                         "own host and link (default: the config's coordinator.shards, else 1).")
    flags.DEFINE_enum("dp_dtype", "bf16", sorted(DP_BYTES), "Gradient dtype of the data-parallel baseline.")


def _run(argv):
    try:
        return _main(argv)
    except (PlanError, KeyError, FileNotFoundError, ValueError) as e:  # bad input: say what to give, no traceback
        sys.exit(f"island_jax.plan: {e}")


if __name__ == "__main__":
    from absl import app

    from island_jax.cli import parse_flags

    _define_flags()
    app.run(_run, flags_parser=parse_flags)
