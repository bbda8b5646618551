"""The plan as the command line prints it (`format_plan`, `str(plan)`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from island_jax.plan.memory import HOST_MEMORY_BYTES

if TYPE_CHECKING:
    from island_jax.plan.planner import Plan


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _gbps(value: float | None) -> str:
    return "unreachable" if value is None else "any" if value == 0 else f"{value:.3g}"


def _shard_line(p: Plan) -> str:
    """Each shard of a coordinator cut by chunk range: its memory against a host's, CPU and link per round."""
    c, memory = p.coordinator, p.shard_memory["total"]
    (bytes_in, bytes_out), (seconds_in, seconds_out) = p.shard_bytes, p.shard_link_seconds
    host = _si(HOST_MEMORY_BYTES, "B")
    fits = (f"within a host's {host}" if memory <= HOST_MEMORY_BYTES else
            f"more than a host's {host}: {p.fewest_shards} shards would fit")
    link = (f", {seconds_in:.4g} s in and {seconds_out:.4g} s out on its own {c.gbps:g} Gbit/s link"
            if math.isfinite(c.gbps) else ", on an unlimited link")
    return (f"coordinator per shard ({c.shards} shards by chunk range, each 1/{c.shards} within a chunk per fragment): "
            f"memory {_si(memory, 'B')} "
            f"({fits}); CPU {p.shard_cpu_seconds:.4g} s/round, {p.merge_seconds:.4g} s over {c.cores} cores; "
            f"{_si(bytes_in, 'B')} in and {_si(bytes_out, 'B')} out per round{link}; "
            f"{_si(p.coordinator_bytes_per_day / c.shards, 'B')}/day")


def format_plan(p: Plan) -> str:
    """The plan as the command line prints it: a line on the model and the exchange, a table of the
    islands' rounds, then the required link rates, the coordinator (and, cut into shards, each shard) and the
    data-parallel baseline."""
    o = p.outer
    head = (
        f"model: {_si(p.model.total_params, '')}parameters ({_si(p.model.active, '')}active); {o.codecs} at "
        + (f"{o.wire_bytes_per_param():.6g} bytes/parameter: {_si(p.payload_bytes, 'B')} each way per island per round; "
           if p.update_bytes == p.payload_bytes else
           f"{o.wire_bytes_per_param():.6g} and {o.update_wire_bytes_per_param():.6g} bytes/parameter: "
           f"{_si(p.payload_bytes, 'B')} up and {_si(p.update_bytes, 'B')} down per island per round; ") +
        f"F={o.fragments}, tau={o.overlap_steps}, pipeline={'on' if o.pipeline else 'off'}, sync={o.sync}, "
        f"topology={o.topology}" + (", one shared link" if o.shared_link else "")
    )
    columns = ("island", "H", "step s", "compute s", "up", "down", "Gbit/s", "transfer s", "tau", "exposed s",
               "utilization", "bytes/day")
    table = [columns] + [
        (r.name, f"{r.inner_steps:.4g}", f"{r.step_seconds:.4g}", f"{r.compute_seconds:.4g}", _si(r.bytes_up, "B"),
         _si(r.bytes_down, "B"), f"{r.rate_gbps:.4g}", f"{r.transfer_up_seconds:.4g}", str(r.overlap_steps),
         f"{r.exposed_seconds:.4g}", f"{r.compute_utilization:.4f}", _si(r.bytes_per_day, "B"))
        for r in p.islands
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = [head, "per round:"] + ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    req = ", ".join(f"{t:.0%} {_gbps(g)}" for t, g in p.required_gbps.items())
    dreq = ", ".join(f"{t:.0%} {_gbps(g)}" for t, g in p.dp.required_gbps.items())
    mem = ", ".join(f"{k.replace('_', ' ')} {_si(v, 'B')}" for k, v in p.coordinator_memory.items() if k != "total")
    d, c = p.dp, p.coordinator
    cores = f"{c.cores}" if c.shards == 1 else f"{c.shards} x {c.cores}"
    lines += [
        f"round: {p.wall_seconds:.4g} s; compute utilization {p.compute_utilization:.4f} (the lowest island)",
        f"link Gbit/s each way, on every island's link, for compute utilization {req}",
        "coordinator: none (a ring all-reduce among the islands)" if o.topology == "ring" else
        f"coordinator: memory {_si(p.coordinator_memory['total'], 'B')} ({mem}); CPU {p.coordinator_cpu_seconds:.4g} "
        f"s/round (params x ({c.fixed_ns_per_param:g} + {c.per_island_ns_per_param:g} x K) ns, the merge rate "
        f"benchmarks/merge.py measured), {p.merge_seconds:.4g} s over {cores} cores; "
        f"{_si(p.coordinator_bytes_per_day, 'B')}/day",
        *([_shard_line(p)] if c.shards > 1 and o.topology != "ring" else []),
        f"data parallel (ring all-reduce across the {len(p.islands)} island{'s' if len(p.islands) > 1 else ''} "
        "every step): "
        f"{_si(d.bytes_per_step, 'B')} each way per step, {d.comm_seconds:.4g} s against a {d.step_seconds:.4g} s "
        f"step ({d.exposed_seconds:.4g} s exposed); compute utilization {d.compute_utilization:.4f}; "
        f"link Gbit/s for {dreq}; {_si(d.bytes_per_day, 'B')}/day",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
