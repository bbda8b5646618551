"""The start barrier's log lines, which both transports write alike (`inprocess`, `grpc_server`, `grpc_client`).

What an island and the coordinator call of a transport (`Transport`, `Endpoint`), and the errors and statistics
that cross it, live in `island_jax.protocol`.
"""

from __future__ import annotations

from absl import logging

BARRIER_LOG_SECONDS = 5.0  # how often a start barrier that still waits says for whom


def barrier_line(island: str, waits: dict[str, str], seconds: float) -> str:
    """The line a start barrier logs while `island` waits: for which islands (`waits`: name -> why, from
    `FragmentedCoordinator.barrier_waits_for`) and for how long, seconds."""
    return f"island {island} has waited {seconds:.0f} s at the start barrier for islands {_why(waits)}"


def _why(waits: dict[str, str]) -> str:
    return ", ".join(f"{n} ({reason})" for n, reason in sorted(waits.items()))


def log_barrier_wait(island: str, waits: dict[str, str] | None, seconds: float, timeout: float) -> None:
    """Logs how long `island` waited at the start barrier (seconds), or, when `waits` is not empty (the barrier
    gave up after `timeout` seconds, `comm.join_timeout_seconds`), for whom it waited in vain."""
    if waits:
        logging.warning("island %s: not every island was ready within %.0f s (still waiting for %s); starting "
                        "anyway; see the log of those islands, or raise comm.join_timeout_seconds", island, timeout,
                        _why(waits))
    else:
        logging.info("island %s waited %.2f s at the start barrier", island, seconds)
