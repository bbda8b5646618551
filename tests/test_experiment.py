"""`island_jax.experiment`: runs in processes of their own, sweeps over a grid, reuse of finished variants."""

import subprocess

import pandas as pd
import pytest
from tiny_config import get_config, write_corpus

from island_jax import experiment
from island_jax.config import ConfigError


def tiny(tmp_path, rounds=2):
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.rounds = rounds
    c.eval.every_rounds = rounds
    return c


def refuse(*args, **kwargs):
    raise AssertionError("a process was started")


@pytest.mark.slow
def test_sweep_rows_and_finished_variants_are_read_back(tmp_path, monkeypatch):
    base = tiny(tmp_path)
    grid = {"codec.kind": ["int8", "int4"]}
    rows = experiment.sweep(base, grid, str(tmp_path / "sweep"), seeds=(0, 1), max_parallel=2)
    assert len(rows) == 4
    assert list(rows.columns[:6]) == ["codec.kind", "seed", "eval_loss_final", "wall_seconds", "bytes_per_round", "error"]
    assert list(zip(rows["codec.kind"], rows["seed"])) == [("int8", 0), ("int8", 1), ("int4", 0), ("int4", 1)]
    assert rows["error"].isna().all(), rows["error"].tolist()
    assert (rows["eval_loss_final"] > 0).all() and (rows["wall_seconds"] > 0).all()
    # int4 sends about half of int8's bytes
    int8, int4 = rows.loc[0, "bytes_per_round"], rows.loc[2, "bytes_per_round"]
    assert 0.4 < int4 / int8 < 0.6
    assert rows.loc[0, "eval_loss_final"] != rows.loc[1, "eval_loss_final"]  # the seed matters

    result = experiment.Result.load(rows.loc[2, "workdir"])
    assert result.summary.loc[0, "codec"] == "int4" and "islands.a.bytes_sent" in result.summary
    assert sorted(result.rounds["island"].fillna("coordinator").unique()) == ["a", "b", "coordinator"]
    assert set(result.steps["island"]) == {"a", "b"} and len(result.steps) == 2 * 2 * 2  # islands x rounds x steps
    assert result.bytes_per_round == rows.loc[2, "bytes_per_round"]

    monkeypatch.setattr(subprocess, "Popen", refuse)
    again = experiment.sweep(base, grid, str(tmp_path / "sweep"), seeds=(0, 1))
    pd.testing.assert_frame_equal(again, rows)


@pytest.mark.slow
def test_a_failing_variant_gets_its_error_and_the_others_run(tmp_path):
    base = tiny(tmp_path)
    good = base.data.files
    rows = experiment.sweep(base, {"data.files": [str(tmp_path / "nothing" / "*.txt"), good]}, str(tmp_path / "sweep"))
    assert len(rows) == 2
    assert "matches no files" in rows.loc[0, "error"] and str(tmp_path / "sweep") in rows.loc[0, "error"]
    assert pd.isna(rows.loc[0, "eval_loss_final"])
    assert rows.loc[1, "error"] is None and rows.loc[1, "eval_loss_final"] > 0


def test_an_invalid_variant_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(experiment, "run", refuse)
    base = tiny(tmp_path)
    with pytest.raises(ConfigError, match=r"variant moe.num_experts=3, seed=0: .*moe.num_experts"):
        experiment.sweep(base, {"moe.num_experts": [4, 3]}, str(tmp_path / "sweep"), seeds=(0, 1))
    with pytest.raises(ConfigError, match="no field moe.num_expert"):
        experiment.sweep(base, {"moe.num_expert": [4]}, str(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()


def test_variant_names_and_aliases(tmp_path):
    a = experiment.Variant((("codec.kind", "int4"),), 1)
    assert a.name == "codec.kind=int4,seed=1" and a.describe() == "codec.kind=int4, seed=1"
    b = experiment.Variant((("data.files", "/x/*.py"),), 0)
    assert "/" not in b.name and "*" not in b.name
    assert b.name != experiment.Variant((("data.files", "/x/_.py"),), 0).name
    config = experiment.Variant((("outer.inner_steps", 3),), 0).config(tiny(tmp_path))
    assert config.islands.a.inner_steps == 3 and config.islands.b.inner_steps == 3


@pytest.mark.slow
def test_sweep_script_parses_values_and_refuses_an_invalid_variant(tmp_path):
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, os.path.join(root, "experiments", "sweep.py"), f"--config={root}/tests/tiny_config.py",
         f"--workdir={tmp_path / 'sweep'}", "--sweep=moe.num_experts=4,3", "--sweep=codec.error_feedback=true",
         "--seeds=0,1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "variant moe.num_experts=3, codec.error_feedback=True, seed=0" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "sweep").exists()
