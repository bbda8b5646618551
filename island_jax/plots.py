"""Plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

import numpy as np

from island_jax.metrics import read_jsonl


def plot_expert_load(metrics_path: str, png_path: str) -> str:
    """Draws each MoE layer's expert load fractions over inner steps into a PNG.

    One panel per MoE layer, one line per expert (share of the layer's top-k
    assignments, before drops), and a dashed line at the balanced share 1/E.

    Args:
      metrics_path: an island's `metrics.jsonl` (`WORKDIR/islands/NAME/`), with `inner` records.
      png_path: where to write the PNG (8 x 2.2 inches per layer, 100 dpi).

    Returns:
      `png_path`.

    Raises:
      ValueError: the file holds no inner-step records with MoE metrics.
    """
    from matplotlib.figure import Figure

    records = [r for r in read_jsonl(metrics_path) if r.get("kind") == "inner" and "moe" in r]
    if not records:
        raise ValueError(f"{metrics_path} holds no inner-step records with MoE metrics; pass an island's "
                         "metrics.jsonl (WORKDIR/islands/NAME/metrics.jsonl)")
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
        ax.set_title(f"MoE layer {layer}", fontsize=9)
    axes[-1].set_xlabel("inner step")
    axes[0].legend(fontsize=7, ncol=min(num_experts, 8), loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path)
    return png_path


# (lane label, event kinds drawn in it, color)
_LANES = (
    ("compute", ("compute",), "tab:green"),
    ("send", ("send",), "tab:blue"),
    ("receive", ("receive",), "tab:orange"),
    ("wait", ("wait",), "tab:red"),
    ("eval, save", ("eval", "checkpoint"), "tab:purple"),
)


def plot_timeline(event_paths, png_path: str, start: float | None = None, end: float | None = None) -> str:
    """Draws when each island computed, sent, received and waited (`island.EventLog` files) into a PNG.

    One band per island, five lanes in it: compute (inner steps), send (a
    fragment's contribution leaving), receive (waiting for, receiving and
    decoding its update), wait (training stopped for a due update), and
    eval, save (evaluation and checkpoint saves between rounds). Overlap
    shows as send / receive bars beside compute bars.

    Args:
      event_paths: JSON-lines event files (each island's `events.jsonl`).
      png_path: where to write the PNG (12 inches wide, 1.9 per island, 100 dpi).
      start, end: the window to draw, in seconds from the first event (default: all).

    Returns:
      `png_path`.

    Raises:
      ValueError: the files hold no events.
    """
    from matplotlib.figure import Figure

    events = [e for path in event_paths for e in read_jsonl(path)]
    if not events:
        raise ValueError(f"no events in {list(event_paths)}; nothing to draw")
    t0 = min(e["start"] for e in events)
    islands = sorted({e["island"] for e in events})
    fig = Figure(figsize=(12, 1.0 + 1.9 * len(islands)), dpi=100)
    ax = fig.subplots()
    ticks, labels = [], []
    for i, name in enumerate(islands):
        for j, (label, kinds, color) in enumerate(_LANES):
            y = (len(islands) - 1 - i) * (len(_LANES) + 1) + (len(_LANES) - 1 - j)
            spans = [(e["start"] - t0, e["end"] - e["start"]) for e in events if e["island"] == name and e["kind"] in kinds]
            ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=color)
            ticks.append(y + 0.5)
            labels.append(f"{name}: {label}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("seconds since the first event")
    last = max(e["end"] for e in events) - t0
    ax.set_xlim(start if start is not None else 0.0, end if end is not None else last)
    ax.set_title("islands over time: compute, fragment sends and receives, waits, evaluation and saves", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    return png_path
