"""The plots: expert load over inner steps, and the islands' timeline."""

import json
import struct

import pytest
from matplotlib.collections import LineCollection, PolyCollection

from island_jax.plots import (
    MIN_WIDTH,
    _Gaps,
    plot_expert_load,
    plot_routing,
    plot_timeline,
    routing_figure,
    routing_records,
    timeline_figure,
)


def test_expert_load_png_has_one_panel_per_layer(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "w") as f:
        for step in range(1, 6):
            load = [[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]]
            f.write(json.dumps(dict(kind="inner", step=step, moe=dict(expert_load=load))) + "\n")
        f.write(json.dumps(dict(kind="round", round=1)) + "\n")
    out = plot_expert_load(str(metrics), str(tmp_path / "load.png"))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (800, 440)  # 8 x (2.2 x 2 layers) inches at 100 dpi
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(dict(kind="round", round=1)) + "\n")
    with pytest.raises(ValueError, match="no inner-step records with MoE metrics; pass an island's metrics.jsonl"):
        plot_expert_load(str(empty), str(tmp_path / "b.png"))


def _events(path, island, rounds_before, rounds_after, stall, receives=6, step=0.5):
    """An island's events.jsonl: rounds of 10 steps of `step` s, `receives` receives of 2 ms apart (1 ms long)
    after the 5th step, an evaluation and a save after each round; then `stall` s of nothing and a restart that
    trains `rounds_after` (some again)."""
    events, t = [dict(island=island, kind="started", start=1000.0, end=1000.0, pid=1)], 1000.0
    for part, rounds in enumerate((rounds_before, rounds_after)):
        if part:
            t += stall
            events.append(dict(island=island, kind="started", start=t, end=t, pid=2))
            t += 1.0
        for r in rounds:
            for k in range(10):
                events.append(dict(island=island, kind="compute", start=t, end=t + step, round=r))
                if k == 4:
                    events += [dict(island=island, kind="receive", start=t + 0.002 * f, end=t + 0.002 * f + 0.001,
                                    round=r, fragment=f) for f in range(receives)]
                t += step
            events.append(dict(island=island, kind="eval", start=t, end=t + 0.3, round=r))
            events.append(dict(island=island, kind="checkpoint", start=t + 0.3, end=t + 0.4, round=r))
            t += 0.4
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def test_timeline_has_a_legend_round_numbers_wide_enough_bars_and_its_restarts(tmp_path):
    a = _events(tmp_path / "a.jsonl", "a", [1, 2, 3], [3, 4], stall=300.0)
    b = _events(tmp_path / "b.jsonl", "b", [1, 2], [2, 3, 4], stall=305.0, step=0.45)
    fig = timeline_figure([a, b])
    (ax,) = [x for x in fig.axes if x.get_yticklabels()]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "compute", "send", "receive", "wait", "eval", "save", "a round begins (its number above)", "restart",
        "idle, cut short"]
    assert [t.get_text() for t in ax.get_yticklabels()][:7] == [
        "a: compute", "a: send", "a: receive", "a: wait", "a: eval", "a: save", "a: round"]
    # eval and save: lanes of their own, in colours of their own
    lanes = [t.get_text() for t in ax.get_yticklabels() if not t.get_text().endswith("round")]
    bars = dict(zip(lanes, [c for c in ax.collections if isinstance(c, PolyCollection)], strict=True))
    assert tuple(bars["a: eval"].get_facecolor()[0]) != tuple(bars["a: save"].get_facecolor()[0])
    assert len(bars["b: eval"].get_paths()) == len(bars["b: save"].get_paths()) == 5
    # 30 receives 2 ms apart, 1 ms each: every bar is at least MIN_WIDTH of the axis wide
    lo, hi = ax.get_xlim()
    widths = [p.get_extents().width for p in bars["a: receive"].get_paths()]
    assert len(widths) == 30 and min(widths) >= MIN_WIDTH * (hi - lo) * (1 - 1e-9)
    # the rounds numbered per island, again after the restart (a replays round 3, b round 2)
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t.isdigit()] == ["1", "2", "3", "3", "4", "1", "2", "2", "3", "4"]
    # one dashed line per restart, over the island's band; the 5-minute stall is cut short and labelled
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert sum(c.get_color()[0][:3].tolist() == [0.0, 0.0, 0.0] for c in lines) == 2  # black: the restarts
    assert "5m00s idle" in texts  # a's last save ended 16.2 s in, b's first step after its restart 299.6 s later
    assert hi - lo < 60  # about 36 s of training and the stall's short band, not 340 s
    assert ax.xaxis.get_major_formatter()(hi, 0) == f"{_Gaps_end(a, b):.0f}"  # ticks read seconds since the first
    png = plot_timeline([a, b], str(tmp_path / "timeline.png"))
    data = open(png, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1200, 540)  # 12 x 5.4 in


def _Gaps_end(*paths):
    events = [json.loads(line) for p in paths for line in open(p)]
    return max(e["end"] for e in events) - min(e["start"] for e in events)


def test_the_cut_time_axis_maps_back_to_seconds():
    gaps = _Gaps([(0.0, 10.0), (12.0, 20.0), (320.0, 330.0)], longer_than=60.0)
    assert gaps.cuts == [(20.0, 320.0, pytest.approx(0.03 * 30.0))]  # 3% of the 30 s outside the cut
    for t in (0.0, 15.0, 20.0, 100.0, 320.0, 325.0):
        assert gaps.t(gaps.x(t)) == pytest.approx(t)
    assert (gaps.x(15.0), gaps.x(330.0)) == (15.0, pytest.approx(30.9))
    assert _Gaps([(0.0, 10.0), (300.0, 310.0)], float("inf")).cuts == []


def test_routing_figure_has_a_heatmap_per_island_and_the_divergence_once_per_round(tmp_path):
    metrics = tmp_path / "metrics.jsonl"

    def record(round, fragment, load_a):
        routing = dict(load={"a": load_a, "b": [[0.5, 0.5], [0.25, 0.75]]}, js_divergence=[0.1 * round, 0.0],
                       topk_overlap={"a/b": [1.0, 0.5]})
        return dict(kind="round", round=round, fragment=fragment, routing=routing)

    with open(metrics, "w") as f:
        for r in (record(1, 0, [[1.0, 0.0], [0.5, 0.5]]), record(1, 1, [[0.75, 0.25], [0.5, 0.5]]),
                  record(2, 1, [[0.5, 0.5], [0.5, 0.5]]), dict(kind="round", round=3),  # no routing: left out
                  record(2, 1, [[0.25, 0.75], [0.5, 0.5]])):  # round 2 logged again by a resume: the latest
            f.write(json.dumps(r) + "\n")
    kept = routing_records(str(metrics))
    assert [(r["round"], r["fragment"], r["routing"]["load"]["a"][0]) for r in kept] == [(1, 1, [0.75, 0.25]),
                                                                                         (2, 1, [0.25, 0.75])]
    fig = routing_figure(str(metrics))
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert len(heatmaps) == 2
    assert heatmaps[0].images[0].get_array().tolist() == [[1.5, 0.5], [0.5, 1.5], [1.0, 1.0], [1.0, 1.0]]  # x E
    js = next(ax for ax in fig.axes if ax.get_ylabel() == "bits")
    assert list(js.lines[-1].get_ydata()) == [0.05, 0.1]  # the mean over layers, per round
    assert plot_routing(str(metrics), str(tmp_path / "routing.png")) == str(tmp_path / "routing.png")
    (tmp_path / "dense.jsonl").write_text(json.dumps(dict(kind="round", round=1)) + "\n")
    with pytest.raises(ValueError, match="no round records with routing diagnostics"):
        routing_figure(str(tmp_path / "dense.jsonl"))
