"""Plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

import math

import numpy as np

from island_jax.metrics import duration, read_jsonl

# The figures a run can write into its workdir when it ends (`metrics.plots`): timeline.png (`plot_timeline`) and
# routing.png (`plot_routing`).
PLOTS = ("timeline", "routing")


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


def routing_records(metrics_path: str) -> list[dict]:
    """The coordinator's round records with routing diagnostics (`coordinator/routing.py`), one per round: with
    fragments, the round's last fragment's (the one that carries the probe); a round logged again (a resume) once,
    its latest record."""
    by_round: dict = {}
    for r in read_jsonl(metrics_path):
        if r.get("kind") == "round" and r.get("routing"):
            if r["round"] not in by_round or r.get("fragment", 0) >= by_round[r["round"]].get("fragment", 0):
                by_round[r["round"]] = r
    return [by_round[k] for k in sorted(by_round)]


def plot_routing(metrics_path: str, png_path: str) -> str:
    """Draws the expert load per island over rounds and the Jensen-Shannon divergence between the islands' loads.

    One heatmap per island (x: round, y: MoE layer and expert, colour: the expert's share of the layer's
    assignments that round, times E, so 1 is a balanced share), then one panel of the divergence per MoE layer
    (thin lines) and its mean over layers (bits, `routing.js_divergence`), with the top-k overlap's mean on the
    probe where the records hold it (right axis).

    Args:
      metrics_path: the coordinator's `metrics.jsonl` (`WORKDIR/coordinator/`).
      png_path: where to write the PNG (8 inches wide, 100 dpi).

    Returns:
      `png_path`.

    Raises:
      ValueError: the file holds no round records with routing diagnostics (a model without MoE layers).
    """
    routing_figure(metrics_path).savefig(png_path)
    return png_path


def routing_figure(metrics_path: str):
    """`plot_routing`'s matplotlib `Figure`, not saved (for a notebook)."""
    from matplotlib.figure import Figure

    records = routing_records(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no round records with routing diagnostics; pass the coordinator's "
                         "metrics.jsonl (WORKDIR/coordinator/metrics.jsonl) of a run of an MoE model")
    rounds = [r["round"] for r in records]
    names = list(dict.fromkeys(n for r in records for n in r["routing"]["load"]))
    fig = Figure(figsize=(8, 2.2 * (len(names) + 1)), dpi=100)
    axes = fig.subplots(len(names) + 1, 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        load = np.asarray([np.asarray(r["routing"]["load"].get(name), np.float64) if name in r["routing"]["load"]
                           else np.full(np.shape(records[0]["routing"]["load"][names[0]]), np.nan) for r in records])
        layers, experts = load.shape[1:]
        image = ax.imshow((load * experts).reshape(len(records), -1).T, aspect="auto", cmap="viridis", origin="lower",
                          interpolation="nearest", extent=(rounds[0] - 0.5, rounds[-1] + 0.5, -0.5, layers * experts - 0.5))
        ax.set_yticks([layer * experts + (experts - 1) / 2 for layer in range(layers)],
                      [f"layer {layer}" for layer in range(layers)], fontsize=7)
        ax.set_title(f"island {name}: expert load x E (1 = balanced), experts within each layer", fontsize=9)
        fig.colorbar(image, ax=ax, pad=0.01)
    ax = axes[-1]
    js = np.asarray([r["routing"]["js_divergence"] for r in records], np.float64)
    for layer in range(js.shape[1]):
        ax.plot(rounds, js[:, layer], linewidth=0.8, alpha=0.5, color="tab:blue")
    ax.plot(rounds, np.nanmean(js, axis=1), linewidth=2, color="tab:blue", label="JS divergence (mean of layers)")
    ax.set_ylabel("bits")
    ax.set_xlabel("round")
    if any("topk_overlap" in r["routing"] for r in records):
        overlap = [np.nanmean([np.mean(v) for v in r["routing"].get("topk_overlap", {}).values()] or [np.nan])
                   for r in records]
        twin = ax.twinx()
        twin.plot(rounds, overlap, color="tab:orange", linewidth=1.5, label="top-k overlap (mean)")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("overlap")
        twin.legend(fontsize=7, loc="upper right")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("divergence between the islands' expert loads", fontsize=9)
    fig.subplots_adjust(left=0.1, right=0.9, top=0.95, bottom=0.08, hspace=0.3)  # fixed: a tight layout costs more
    return fig


# (lane label, event kinds drawn in it, color)
_LANES = (
    ("compute", ("compute",), "tab:green"),
    ("send", ("send",), "tab:blue"),
    ("receive", ("receive",), "tab:orange"),
    ("wait", ("wait",), "tab:red"),
    ("eval", ("eval",), "tab:purple"),
    ("save", ("checkpoint",), "tab:brown"),
)
MIN_WIDTH = 0.002  # of the x axis: the narrowest bar drawn (2 pixels of a 1000-pixel axis), so short events show
LABEL_SPACING = 0.025  # of the x axis: round numbers closer than this to the last one drawn are left out


class _Gaps:
    """The timeline's x axis: seconds since the first event, with long empty stretches cut short.

    A stretch of more than `longer_than` seconds in which no island has a span
    (the stall of a stop and a resume) is drawn 3% of the busy time wide (at
    most its own length); x is piecewise linear in t, and `t` inverts it.

    Args:
      spans: (start, end) seconds of every event drawn.
      longer_than: seconds; inf cuts nothing.
    """

    def __init__(self, spans: list[tuple[float, float]], longer_than: float):
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] > longer_than]
        busy = (merged[-1][1] - merged[0][0]) - sum(b - a for a, b in gaps)
        width = max(busy, 1.0) * 0.03
        self.cuts = [(a, b, min(b - a, width)) for a, b in gaps]  # (from, to, drawn width), seconds

    def x(self, t: float) -> float:
        removed = 0.0
        for a, b, shown in self.cuts:
            if t <= a:
                break
            if t < b:
                return a - removed + (t - a) * shown / (b - a)
            removed += (b - a) - shown
        return t - removed

    def t(self, x: float) -> float:
        removed = 0.0
        for a, b, shown in self.cuts:
            xa = a - removed
            if x <= xa:
                break
            if x < xa + shown:
                return a + (x - xa) * (b - a) / shown
            removed += (b - a) - shown
        return x + removed


def _round_starts(events: list[dict]) -> list[tuple[float, int]]:
    """(start, round) where an island's inner steps ("compute" events) moved to another round, and the first
    round after each restart ("started" events: a resumed island may train a round again)."""
    starts, last = [], None
    for e in sorted(events, key=lambda e: e["start"]):
        if e["kind"] == "started":
            last = None
        elif e["kind"] == "compute" and e.get("round") is not None and e["round"] != last:
            starts.append((e["start"], e["round"]))
            last = e["round"]
    return starts


def plot_timeline(event_paths, png_path: str, start: float | None = None, end: float | None = None,
                  gap_seconds: float | None = 60.0) -> str:
    """Draws when each island computed, sent, received, waited, evaluated and saved (`island.EventLog` files).

    One band per island, six lanes in it, each in its colour (the legend):
    compute (inner steps), send (a fragment's contribution leaving), receive
    (waiting for, receiving and decoding its update), wait (training stopped
    for a due update), eval and save (evaluation and checkpoint saves between
    rounds). Overlap shows as send / receive bars beside compute bars. A bar
    is at least `MIN_WIDTH` of the axis wide, so that a short event shows (and
    short events apart read as several). Above its lanes, each island's
    rounds are numbered where its inner steps of the round began (a dotted
    line down the band; numbers closer than `LABEL_SPACING` of the axis to
    the last one are left out). Each restart of an island (a process
    appending to its events file: a "started" event) is a dashed black line
    over its band. A stretch of more than `gap_seconds` in which no island
    did anything (the stall of a stop and a resume) is cut to a narrow
    hatched band labelled with its length; the x axis still reads seconds
    since the first event.

    Args:
      event_paths: JSON-lines event files (each island's `events.jsonl`).
      png_path: where to write the PNG (12 inches wide, 1.6 + 1.9 per island tall, 100 dpi).
      start, end: the window to draw, in seconds from the first event (default: all).
      gap_seconds: empty stretches longer than this (s) are cut short; None: none is.

    Returns:
      `png_path`.

    Raises:
      ValueError: the files hold no events.
    """
    timeline_figure(event_paths, start, end, gap_seconds).savefig(png_path)
    return png_path


def timeline_figure(event_paths, start: float | None = None, end: float | None = None,
                    gap_seconds: float | None = 60.0):
    """`plot_timeline`'s matplotlib `Figure`, not saved (same arguments but the PNG's path).

    Raises:
      ValueError: the files hold no events.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    events = [e for path in event_paths for e in read_jsonl(path)]
    if not events:
        raise ValueError(f"no events in {list(event_paths)}; nothing to draw")
    t0 = min(e["start"] for e in events)
    islands = sorted({e["island"] for e in events})
    drawn = [e for e in events if any(e["kind"] in kinds for _, kinds, _ in _LANES)]
    first = {n: min(e["start"] for e in events if e["island"] == n) for n in islands}
    restarts = [e for e in events if e["kind"] == "started" and e["start"] > first[e["island"]]]
    gaps = _Gaps([(e["start"] - t0, e["end"] - t0) for e in drawn] or [(0.0, 0.0)],
                 float("inf") if gap_seconds is None else gap_seconds)
    lo = gaps.x(start if start is not None else 0.0)
    hi = gaps.x(end if end is not None else max(e["end"] for e in events) - t0)
    hi = hi if hi > lo else lo + 1.0
    min_width = MIN_WIDTH * (hi - lo)

    fig = Figure(figsize=(12, 1.6 + 1.9 * len(islands)), dpi=100, layout="constrained")
    ax = fig.subplots()
    band = len(_LANES) + 1  # the lanes, and a row above them for the round numbers
    ticks, labels = [], []
    for i, name in enumerate(islands):
        base = (len(islands) - 1 - i) * band  # the island's lowest lane
        mine = [e for e in drawn if e["island"] == name]
        for j, (label, kinds, color) in enumerate(_LANES):
            y = base + len(_LANES) - 1 - j
            bars = []
            for e in mine:
                if e["kind"] in kinds:
                    x0, x1 = gaps.x(e["start"] - t0), gaps.x(e["end"] - t0)
                    bars.append((x0, max(x1 - x0, min_width)))
            ax.broken_barh(bars, (y + 0.1, 0.8), facecolors=color)
            ticks.append(y + 0.5)
            labels.append(f"{name}: {label}")
        ticks.append(base + len(_LANES) + 0.4)
        labels.append(f"{name}: round")
        shown = None
        for t, r in _round_starts([e for e in events if e["island"] == name]):
            x = gaps.x(t - t0)
            ax.vlines(x, base, base + len(_LANES) + 0.1, colors="0.6", linestyles=":", linewidth=0.7, zorder=0)
            if lo <= x <= hi and (shown is None or x - shown >= LABEL_SPACING * (hi - lo)):
                ax.text(x, base + len(_LANES) + 0.15, str(r), fontsize=7, ha="left", va="bottom", clip_on=True)
                shown = x
        for e in restarts:
            if e["island"] == name:
                x = gaps.x(e["start"] - t0)
                ax.vlines(x, base, base + band - 0.1, colors="black", linestyles="--", linewidth=1.3, zorder=3)
    for a, b, width in gaps.cuts:
        xa = gaps.x(a)
        ax.axvspan(xa, xa + width, facecolor="0.88", edgecolor="0.6", hatch="//", linewidth=0, zorder=0)
        ax.text(xa + width / 2, len(islands) * band - 0.05, f"{duration(b - a)} idle", fontsize=7, ha="center",
                va="top", rotation=90, clip_on=True)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(-0.2, len(islands) * band)
    if gaps.cuts:  # ticks read seconds since the first event, to the ticks' precision (0.1 s on an axis of 1-10 s)
        decimals = max(0, 1 - math.floor(math.log10(hi - lo)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{gaps.t(x):.{decimals}f}"))
    ax.set_xlabel("seconds since the first event" + (" (idle stretches cut short)" if gaps.cuts else ""))
    ax.set_xlim(lo, hi)
    handles = [Patch(facecolor=color, label=label) for label, _, color in _LANES]
    handles.append(Line2D([], [], color="0.6", linestyle=":", label="a round begins (its number above)"))
    handles.append(Line2D([], [], color="black", linestyle="--", label="restart"))
    if gaps.cuts:
        handles.append(Patch(facecolor="0.88", edgecolor="0.6", hatch="//", label="idle, cut short"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title("islands over time: compute, fragment sends and receives, waits, evaluation and saves", fontsize=10)
    return fig

