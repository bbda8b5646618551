"""The expert-load plot helper."""

import json
import struct

import pytest

from island_jax.plots import plot_expert_load


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
