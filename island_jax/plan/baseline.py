"""The data-parallel baseline a plan is set beside: a ring all-reduce of the gradients across the K islands
every step, 2 (K - 1) / K x params x (2 or 4) bytes each way, overlapped with the backward pass (2/3 of a
step), on the islands' links."""

from __future__ import annotations

import dataclasses

from island_jax.plan.wire import SECONDS_PER_DAY, links_at, required_gbps, transfer_seconds

DP_BYTES = {"bf16": 2, "fp32": 4}  # bytes per gradient element of the data-parallel baseline
BACKWARD_FRACTION = 2.0 / 3.0  # of a step: the backward pass (4 of the 6 N FLOPs per token) a reduction hides in


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """The baseline: a ring all-reduce of the gradients across the islands every step."""

    bytes_per_step: float  # each way, per island
    step_seconds: float  # the balanced step (`data_parallel`)
    comm_seconds: float
    exposed_seconds: float
    compute_utilization: float
    required_gbps: dict[float, float | None]  # target -> Gbit/s (0.0: any rate; None: no rate reaches it)
    bytes_per_day: float  # both ways, per island


def data_parallel(model, islands, outer, dp_bytes, targets) -> DataParallel:
    """The ring all-reduce baseline. Its global batch is every island's tokens per step, split so that every
    island's share takes the same time: the step is sum(tokens) / sum(tokens_i / t_i). With `shared_link`
    the islands share their link here too."""
    k = len(islands)
    steps = [i.seconds_per_step(model) for i in islands]
    tokens = [i.tokens_per_step or 1 for i in islands]
    step = sum(tokens) / sum(n / t for n, t in zip(tokens, steps))
    nbytes = 2 * (k - 1) / k * model.total_params * dp_bytes
    share = k if outer.shared_link else 1

    def at(gbps=None):
        if k == 1:
            return 0.0, 0.0, 1.0
        comm = max(transfer_seconds(nbytes, link.rate_gbps() / share) + 2 * (k - 1) * link.rtt_ms / 2e3
                   for link in links_at(islands, gbps))
        exposed = max(0.0, comm - BACKWARD_FRACTION * step)
        return comm, exposed, step / (step + exposed)

    comm, exposed, util = at()
    return DataParallel(
        bytes_per_step=nbytes, step_seconds=step, comm_seconds=comm, exposed_seconds=exposed,
        compute_utilization=util, required_gbps={t: required_gbps(lambda g: at(g)[2], t) for t in targets},
        bytes_per_day=2 * nbytes * SECONDS_PER_DAY / (step + exposed),
    )
