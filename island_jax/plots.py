"""Plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

import numpy as np

from island_jax.metrics import read_jsonl


def plot_expert_load(metrics_path: str, png_path: str, island: str | None = None) -> str:
    """Draws each MoE layer's expert load fractions over inner steps into a PNG.

    One panel per MoE layer, one line per expert (share of the layer's top-k
    assignments, before drops), and a dashed line at the balanced share 1/E.

    Args:
      metrics_path: a `metrics.jsonl` with `inner` records (an island's folder
        of a multi-process run, or an in-process run's workdir).
      png_path: where to write the PNG (8 x 2.2 inches per layer, 100 dpi).
      island: in an in-process run's metrics, the island to draw (default: the first).

    Returns:
      `png_path`.

    Raises:
      ValueError: the file holds no inner-step records with MoE metrics.
    """
    from matplotlib.figure import Figure

    records = [r for r in read_jsonl(metrics_path) if r.get("kind") == "inner" and "moe" in r]
    if records and island is None:
        island = records[0].get("island")
    records = [r for r in records if r.get("island") == island]
    if not records:
        raise ValueError(f"{metrics_path} holds no inner-step records with MoE metrics (island {island!r})")
    steps = [r["step"] for r in records]
    load = np.asarray([r["moe"]["expert_load"] for r in records])  # [steps, layers, experts]
    num_layers, num_experts = load.shape[1:]
    fig = Figure(figsize=(8, 2.2 * num_layers), dpi=100)
    axes = fig.subplots(num_layers, 1, sharex=True, squeeze=False)[:, 0]
    for layer, ax in enumerate(axes):
        for e in range(num_experts):
            ax.plot(steps, load[:, layer, e], linewidth=1, label=f"expert {e}")
        ax.axhline(1 / num_experts, color="gray", linestyle="--", linewidth=0.8)
        ax.set_ylabel("load fraction")
        ax.set_title(f"MoE layer {layer}" + (f", island {island}" if island else ""), fontsize=9)
    axes[-1].set_xlabel("inner step")
    axes[0].legend(fontsize=7, ncol=min(num_experts, 8), loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path)
    return png_path
