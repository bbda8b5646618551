"""`island_jax.experiment`: runs in processes of their own, sweeps over a grid, reuse of finished variants."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
from tiny_config import get_config, write_corpus

from island_jax import experiment
from island_jax.config import ConfigChangeError, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    assert list(rows.columns[:7]) == ["codec.kind", "seed", "eval_loss_final", "eval_bits_per_byte_final",
                                      "wall_seconds", "bytes_per_round", "error"]
    # the byte corpus: a token is a byte, so bits per byte is the loss in bits
    assert rows["eval_bits_per_byte_final"].tolist() == [loss / math.log(2) for loss in rows["eval_loss_final"]]
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
def test_a_sweep_over_overlap_steps_runs_an_integer_and_auto(tmp_path):
    base = tiny(tmp_path, rounds=1)
    grid = {"outer.overlap_steps": [experiment.parse_override(base, "outer.overlap_steps", t) for t in ("0", "auto")]}
    rows = experiment.sweep(base, grid, str(tmp_path / "sweep"), max_parallel=2)
    assert rows["outer.overlap_steps"].tolist() == [0, "auto"] and rows["error"].isna().all(), rows["error"].tolist()
    assert [experiment.Result.load(w).summary.loc[0, "rounds"] for w in rows["workdir"]] == [1, 1]


@pytest.mark.slow
def test_a_failing_variant_gets_its_error_and_the_others_run(tmp_path):
    base = tiny(tmp_path)
    good = base.data.files
    rows = experiment.sweep(base, {"data.files": [str(tmp_path / "nothing" / "*.txt"), good]}, str(tmp_path / "sweep"))
    assert len(rows) == 2
    assert "matches no files" in rows.loc[0, "error"] and str(tmp_path / "sweep") in rows.loc[0, "error"]
    assert pd.isna(rows.loc[0, "eval_loss_final"])
    assert rows.loc[1, "error"] is None and rows.loc[1, "eval_loss_final"] > 0


def test_a_finished_variants_row_holds_its_summarys_final_eval_loss_and_bits_per_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", refuse)
    base = tiny(tmp_path)
    (variant,) = experiment.variants({"codec.kind": ["int4"]})
    folder = tmp_path / "sweep" / variant.name
    folder.mkdir(parents=True)
    (folder / experiment.VARIANT_FILE).write_text(variant.config(base).to_json_best_effort())
    # a prepared run's summary: 1.75 nats per token, 4 tokens over 9 bytes of text (data.bits_per_byte)
    from island_jax.data import bits_per_byte

    summary = dict(eval_loss_final=1.75, eval_bits_per_byte_final=bits_per_byte(1.75, 4, 9), wall_seconds=3.5)
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = experiment.sweep(base, {"codec.kind": ["int4"]}, str(tmp_path / "sweep"))
    assert rows.loc[0, ["eval_loss_final", "eval_bits_per_byte_final", "wall_seconds"]].tolist() == [
        1.75, 1.75 / math.log(2) * (4 / 9), 3.5]
    assert rows.loc[0, "error"] is None and list(rows.columns) == [
        "codec.kind", "seed", *experiment.ROW_COLUMNS, "workdir"]


def test_an_invalid_variant_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(experiment, "run", refuse)
    base = tiny(tmp_path)
    with pytest.raises(ConfigError, match=r"variant moe.num_experts=3, seed=0: .*moe.num_experts"):
        experiment.sweep(base, {"moe.num_experts": [4, 3]}, str(tmp_path / "sweep"), seeds=(0, 1))
    with pytest.raises(ConfigError, match=r"moe.num_expert is not a field of the config; did you mean moe.num_experts\?"):
        experiment.sweep(base, {"moe.num_expert": [4]}, str(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()


def test_variant_names_and_a_key_for_every_island(tmp_path):
    a = experiment.Variant((("codec.kind", "int4"),), 1)
    assert a.name == "codec.kind=int4,seed=1" and a.describe() == "codec.kind=int4, seed=1"
    b = experiment.Variant((("data.files", "/x/*.py"),), 0)
    assert "/" not in b.name and "*" not in b.name
    assert b.name != experiment.Variant((("data.files", "/x/_.py"),), 0).name
    config = experiment.Variant((("islands.*.inner_steps", 3),), 0).config(tiny(tmp_path))
    assert config.islands.a.inner_steps == 3 and config.islands.b.inner_steps == 3


@pytest.mark.slow
def test_sweep_script_parses_values_and_refuses_an_invalid_variant(tmp_path):
    root = ROOT
    result = subprocess.run(
        [sys.executable, os.path.join(root, "experiments", "sweep.py"), f"--config={root}/tests/tiny_config.py",
         f"--workdir={tmp_path / 'sweep'}", "--sweep=moe.num_experts=4,3", "--sweep=codec.error_feedback=true",
         "--seeds=0,1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "variant moe.num_experts=3, codec.error_feedback=True, seed=0" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "sweep").exists()


def test_a_tuple_key_sets_its_fields_together(tmp_path):
    grid = {("islands.*.inner_steps", "outer.rounds"): [(1, 4), (2, 2)], "codec.kind": ["int8", "int4"]}
    points = experiment.variants(grid, seeds=(0,))
    assert [v.overrides for v in points] == [
        (("islands.*.inner_steps", 1), ("outer.rounds", 4), ("codec.kind", "int8")),
        (("islands.*.inner_steps", 1), ("outer.rounds", 4), ("codec.kind", "int4")),
        (("islands.*.inner_steps", 2), ("outer.rounds", 2), ("codec.kind", "int8")),
        (("islands.*.inner_steps", 2), ("outer.rounds", 2), ("codec.kind", "int4")),
    ]
    assert experiment.grid_keys(grid) == ["islands.*.inner_steps", "outer.rounds", "codec.kind"]
    config = points[2].config(tiny(tmp_path))
    assert (config.islands.a.inner_steps, config.islands.b.inner_steps, config.outer.rounds) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"sets 2 fields together; \(1, 4, 5\) is not 2 values"):
        experiment.variants({("islands.*.inner_steps", "outer.rounds"): [(1, 4, 5)]})


def test_a_field_set_twice_in_a_grid_is_refused():
    with pytest.raises(ValueError, match=r"grid keys \['islands.\*.inner_steps'\] are set more than once"):
        experiment.variants({"islands.*.inner_steps": [1], ("islands.*.inner_steps", "outer.rounds"): [(2, 2)]})
    with pytest.raises(ValueError, match=r"grid keys \['codec.kind'\] are set more than once"):
        experiment.variants({"codec.kind": ["int8"], ("codec.kind", "outer.rounds"): [("int4", 2)]})


def test_an_unfinished_run_of_another_config_is_not_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", refuse)
    folder = tmp_path / "run"
    (folder / "islands" / "a").mkdir(parents=True)
    other = tiny(tmp_path)
    other.codec.kind = "int4"
    (folder / experiment.VARIANT_FILE).write_text(other.to_json_best_effort())
    (folder / "islands" / "a" / "config.json").write_text(other.to_json_best_effort())  # island a started under it
    (folder / "islands" / "a" / "metrics.jsonl").write_text(json.dumps(dict(kind="round", round=1)) + "\n")
    with pytest.raises(ConfigChangeError, match=rf"{folder / 'islands' / 'a'} was started with another config: "
                                                r"codec.kind \(started with 'int4', now 'int8'\)\. Resume with"):
        experiment.run(tiny(tmp_path), str(folder))
    assert json.loads((folder / experiment.VARIANT_FILE).read_text())["codec"]["kind"] == "int4"  # left as it was


def test_command_line_values_take_the_type_of_their_field(tmp_path):
    c = tiny(tmp_path)
    assert experiment.parse_override(c, "codec.error_feedback", "true") is True
    assert experiment.parse_override(c, "outer.rounds", "7") == 7
    assert experiment.parse_override(c, "outer.learning_rate", "1") == 1.0
    assert isinstance(experiment.parse_override(c, "outer.learning_rate", "1"), float)
    assert experiment.parse_override(c, "islands.*.batch_size", "16") == 16  # every island's field, one type
    assert experiment.parse_override(c, "islands.*.inner_steps", "5") == 5  # every island
    assert experiment.parse_override(c, "codec.kind", "int4") == "int4"
    with pytest.raises(ConfigError, match=r"outer.rounds=seven: invalid literal"):
        experiment.parse_override(c, "outer.rounds", "seven")
    with pytest.raises(ConfigError, match=r"codec.error_feedback=maybe: .*Non-boolean argument to boolean flag"):
        experiment.parse_override(c, "codec.error_feedback", "maybe")
    with pytest.raises(ConfigError, match=r"islands.a.batch is not a field of the config; did you mean "
                                          r"islands.a.batch_size\?"):
        experiment.parse_override(c, "islands.*.batch", "1")


def test_sweep_values_parse_as_config_flags_parse_them(tmp_path):
    """Every value `--sweep` takes is the one `--config.KEY=TEXT` gives: ml_collections' own parse of the same
    text, through a config flag, for fields of each type (the `object` field outer.overlap_steps included)."""
    from absl import flags
    from ml_collections import config_flags

    cases = [("outer.overlap_steps", "auto"), ("outer.overlap_steps", "0"), ("outer.overlap_steps", "3"),
             ("codec.error_feedback", "false"), ("codec.error_feedback", "1"), ("outer.rounds", "7"),
             ("outer.learning_rate", "1"), ("data.files", "/x/*.py"), ("codec.kind", "int4")]
    for key, text in cases:
        argv = [sys.argv[0], f"--config={os.path.join(ROOT, 'tests', 'tiny_config.py')}", f"--config.{key}={text}"]
        values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
        values(argv)
        node, name = values.config, key.split(".")[-1]
        for part in key.split(".")[:-1]:
            node = node[part]
        expected = node[name]
        got = experiment.parse_override(tiny(tmp_path), key, text)
        assert (got, type(got)) == (expected, type(expected)), (key, text)
    # a sweep over both: two valid variants, the int 0 and the str "auto"
    base = tiny(tmp_path)
    grid = {"outer.overlap_steps": [experiment.parse_override(base, "outer.overlap_steps", t) for t in ("0", "auto")]}
    assert [v.config(base).outer.overlap_steps for v in experiment.variants(grid)] == [0, "auto"]


def test_over_seeds_gives_mean_spread_and_count_per_group():
    rows = pd.DataFrame(
        {
            "codec.kind": ["int8", "int8", "int4", "int4"],
            "seed": [0, 1, 0, 1],
            "eval_loss_final": [2.0, 2.5, 3.0, float("nan")],
            "error": [None, None, None, "the run failed"],
        }
    )
    table = experiment.over_seeds(rows, ["codec.kind"])
    assert table["codec.kind"].tolist() == ["int8", "int4"]
    assert table["mean"].tolist() == [2.25, 3.0] and table["seeds"].tolist() == [2, 1]
    assert table["std"][0] == pytest.approx(0.3535533905932738, rel=1e-12) and pd.isna(table["std"][1])


def test_paired_difference_pairs_runs_with_their_baseline_by_seed():
    baseline = pd.DataFrame({"seed": [0, 1, 2], "eval_loss_final": [2.0, 1.0, 4.0], "error": [None] * 3})
    rows = pd.DataFrame(
        {
            "m": [1, 1, 2, 2, 2],
            "seed": [0, 1, 0, 1, 3],  # seed 3 has no baseline
            "eval_loss_final": [2.02, 1.0, 2.2, 1.3, 9.0],
            "error": [None, None, None, None, None],
        }
    )
    table = experiment.paired_difference(rows, baseline, ["m"])
    assert table["m"].tolist() == [1, 2] and table["seeds"].tolist() == [2, 2]
    assert table["mean"].tolist() == pytest.approx([1.51, 1.75], rel=1e-12)
    assert table["baseline_mean"].tolist() == [1.5, 1.5]
    # pairs: m = 1: +1%, 0%; m = 2: +10%, +30%
    assert table["diff_pct"].tolist() == pytest.approx([0.5, 20.0], rel=1e-9)
    assert table["diff_pct_stderr"].tolist() == pytest.approx([0.5, 10.0], rel=1e-9)  # sd / sqrt(2)
    with pytest.raises(ValueError, match=r"baseline holds two runs with the same \['seed'\]"):
        experiment.paired_difference(rows, pd.concat([baseline, baseline]), ["m"])
    # a failed run is left out; pairs on (seed, cpu): a run pairs only with its own CPU's baseline
    failed = pd.DataFrame({"m": [1], "seed": [2], "eval_loss_final": [float("nan")], "error": ["killed"]})
    both = pd.concat([baseline.assign(cpu="x"), baseline.assign(cpu="y", eval_loss_final=[1.0, 2.0, 2.0])])
    on_cpu = experiment.paired_difference(pd.concat([rows.assign(cpu=["x", "y", "x", "y", "x"]), failed.assign(cpu="x")]),
                                          both, ["m"], on=("seed", "cpu"))
    # pairs: m = 1: 2.02 / 2.0 (x), 1.0 / 2.0 (y): +1%, -50%; m = 2: 2.2 / 2.0 (x), 1.3 / 2.0 (y): +10%, -35%
    assert on_cpu["seeds"].tolist() == [2, 2] and on_cpu["baseline_mean"].tolist() == [2.0, 2.0]
    assert on_cpu["diff_pct"].tolist() == pytest.approx([-24.5, -12.5], rel=1e-9)


def test_load_config_finds_an_experiment_file_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = experiment.load_config("experiments/configs/two_islands.py")
    assert config.outer.rounds == 60 and sorted(config.islands) == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="no config file experiments/configs/nope.py"):
        experiment.load_config("experiments/configs/nope.py")


def test_load_config_passes_an_argument_and_diloco_m_splits_baseline_dps_batch_over_m_islands():
    from island_jax.config import ConfigError

    for arg, names, devices, batch, rounds in (("1,25", "a", 6, 12, 60), ("2,50", "ab", 3, 6, 30),
                                                ("4,25", "abcd", 1, 3, 60)):
        config = experiment.load_config(f"experiments/configs/diloco_m.py:{arg}")
        assert list(config.islands) == list(names) and config.outer.rounds == rounds
        assert {(i.num_devices, i.batch_size, i.inner_steps) for i in config.islands.values()} == {
            (devices, batch, int(arg.split(",")[1]))}
        assert (config.outer.learning_rate, config.outer.momentum, config.outer.nesterov,
                config.outer.momentum_warmup_rounds) == (0.4, 0.9, True, 20)
    assert experiment.load_config("experiments/configs/diloco_m.py").islands.b.batch_size == 6  # "2,25"
    for arg in ("3,25", "2,0", "2,-25", "2,7"):
        with pytest.raises(ConfigError, match=rf"diloco_m.py:{arg}: M must be one of \[1, 2, 4\] and H a positive "
                                              "divisor of 1500"):
            experiment.load_config(f"experiments/configs/diloco_m.py:{arg}")
    with pytest.raises(ConfigError, match="give M,H as two integers"):
        experiment.load_config("experiments/configs/diloco_m.py:two")


class _Bars:
    """Stands in for tqdm.auto.tqdm and records each bar's description, total and final count."""

    made: list = []

    def __init__(self, total=None, desc=None, **kwargs):
        self.total, self.desc, self.n = total, desc, 0
        _Bars.made.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.mark.slow
def test_an_unfinished_variant_resumes_to_the_bits_of_a_run_without_a_stop(tmp_path, monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", _Bars)
    _Bars.made = []
    base = tiny(tmp_path, rounds=4)  # a checkpoint after every round
    grid = {"codec.kind": ["int4"]}
    crashing = tiny(tmp_path, rounds=4)
    crashing.islands.b.crash_at_round = 3  # the process fails as round 3 starts, after round 2's checkpoints
    first = experiment.sweep(crashing, grid, str(tmp_path / "sweep"))
    assert "crash_at_round" in first.loc[0, "error"] and pd.isna(first.loc[0, "eval_loss_final"])
    resumed = experiment.sweep(base, grid, str(tmp_path / "sweep"))
    assert resumed.loc[0, "error"] is None
    fresh = experiment.sweep(base, grid, str(tmp_path / "fresh"))
    assert resumed.loc[0, "eval_loss_final"] == fresh.loc[0, "eval_loss_final"]
    steps = experiment.Result.load(resumed.loc[0, "workdir"]).steps
    assert len(steps) == 2 * 4 * 2 and sorted(steps["step"].unique()) == list(range(1, 9))  # islands x rounds x H
    # bars: the sweep's over variants, and one over the rounds of each variant that ran
    sweeps = [b for b in _Bars.made if b.desc == "sweep"]
    rounds = [b for b in _Bars.made if b.desc == "codec.kind=int4,seed=0"]
    assert [(b.total, b.n) for b in sweeps] == [(1, 1)] * 3
    assert [(b.total, b.n) for b in rounds] == [(4, 2), (4, 4), (4, 4)]  # the first stopped after round 2
