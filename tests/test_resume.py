"""Stop, damage, resume: checked checkpoints and their fallback, the start barrier after a restart, runs that never
started, finished runs extended, and runs that end wrong ending non-zero."""

import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
from test_checkpoint import damage
from tiny_config import get_config, write_corpus

from island_jax.data import DataError
from island_jax.metrics import read_jsonl
from island_jax.model import load
from island_jax.model.load import LoadError
from island_jax.run import run_in_process
from island_jax.workdir import RunFailed, combine_summaries

ROUNDS = 4


def tiny(corpus, rounds=ROUNDS):
    """The tests' two-island config: checkpoints every 2 rounds (each role keeps 2)."""
    c = get_config()
    c.data.files = corpus
    c.outer.rounds = rounds
    c.checkpoint.every_rounds = 2
    return c


def records(workdir, role, kind):
    return [r for r in read_jsonl(os.path.join(workdir, role, "metrics.jsonl")) if r["kind"] == kind]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 4 rounds (its corpus, its workdir), copied by each test that changes it."""
    tmp = tmp_path_factory.mktemp("finished")
    corpus = write_corpus(tmp / "corpus")
    run_in_process(tiny(corpus), str(tmp / "workdir"))
    return corpus, str(tmp / "workdir")


def copy(finished, tmp_path):
    corpus, workdir = finished
    shutil.copytree(workdir, tmp_path / "workdir")
    return corpus, str(tmp_path / "workdir")


def logged(caplog, pattern):
    return [m.groups() for r in caplog.records if (m := re.fullmatch(pattern, r.getMessage(), re.S))]


def test_a_finished_run_is_refused_unless_outer_rounds_is_raised(finished):
    corpus, workdir = finished
    with pytest.raises(FileExistsError) as refused:
        run_in_process(tiny(corpus), workdir)
    assert str(refused.value) == (
        f"{workdir} holds a finished run of 4 rounds (summary.json); raise --config.outer.rounds to extend it, or "
        "pass a new --workdir"
    )


@pytest.mark.slow  # starts experiments/train.py
def test_a_finished_run_extended_from_its_workdir_alone_goes_on_with_its_schedule_held(finished, tmp_path):
    """`experiments/train.py --workdir=DIR` with no --config resumes under the recorded config.json; raising
    outer.rounds extends the finished run from its last round, the learning rate held at the schedule's end."""
    import subprocess
    import sys

    from processes import ROOT, role_env

    corpus, workdir = copy(finished, tmp_path)
    before = {role: read_jsonl(os.path.join(workdir, role, "metrics.jsonl")) for role in ("coordinator", "islands/a")}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), f"--workdir={workdir}",
                             f"--config.outer.rounds={ROUNDS + 1}"], capture_output=True, text=True, env=role_env(),
                            timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "island a: rounds 5..5 extend the run's 4; their inner learning rate holds the schedule's final value" \
        in result.stderr
    summary = json.loads(open(os.path.join(workdir, "summary.json")).read())
    assert summary["rounds"] == 5 and summary["checksums_agree"] is True and summary["failures"] == []
    assert summary["checksums_agree_every_round"] is True
    assert [r["round"] for r in records(workdir, "coordinator", "round")] == [1, 2, 3, 4, 5]
    for role, old in before.items():  # what the first 4 rounds logged is kept as it was
        assert read_jsonl(os.path.join(workdir, role, "metrics.jsonl"))[: len(old)] == old
    rounds = records(workdir, "islands/a", "round")
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    assert [r.get("learning_rate_held") for r in rounds] == [None, None, None, None, True]
    config = tiny(corpus)
    inner = [r for r in records(workdir, "islands/a", "inner") if r["round"] == 5]
    end = np.float32(config.inner.learning_rate * config.inner.min_learning_rate_ratio)
    assert [np.float32(r["learning_rate"]) for r in inner] == [end, end]
    for role in ("coordinator", "islands/a", "islands/b"):  # the old end's summary kept beside the new one
        assert json.loads(open(os.path.join(workdir, role, "summary_4.json")).read())["rounds"] == 4
        assert json.loads(open(os.path.join(workdir, role, "config.json")).read())["outer"]["rounds"] == 5


def test_a_resume_where_an_island_lost_its_newest_checkpoint_does_not_wait_at_the_barrier(finished, tmp_path, caplog):
    """As after a stop that came before island a's checkpoint of round 4 was written: the coordinator and b resume
    at round 4, a at round 2 (it rejoins, replaying rounds 3 and 4, so b must not wait for it to say it is ready)."""
    corpus, workdir = copy(finished, tmp_path)
    shutil.rmtree(os.path.join(workdir, "islands", "a", "checkpoints", "4"))
    config = tiny(corpus, rounds=ROUNDS + 2)
    with caplog.at_level(logging.INFO, logger="absl"):
        summary = run_in_process(config, workdir)
    waits = logged(caplog, r"island (\w+) waited ([\d.]+) s at the start barrier")
    assert [name for name, _ in waits] == ["b"]
    assert float(waits[0][1]) < 30  # the join timeout is 300 s
    assert not logged(caplog, r".*not every island was ready.*")
    assert [r["source"] for r in records(workdir, "islands/a", "rejoin")] == ["replay"]
    assert summary["checksums_agree"] is True and summary["checksums_agree_every_round"] is True


def test_damaged_newest_checkpoints_fall_back_and_the_run_finishes_with_the_islands_agreeing(finished, tmp_path,
                                                                                             caplog):
    corpus, workdir = copy(finished, tmp_path)
    folders = {role: os.path.join(workdir, role, "checkpoints") for role in ("coordinator", "islands/a")}
    for folder in folders.values():
        damage(folder, 4)
    with caplog.at_level(logging.INFO, logger="absl"):
        summary = run_in_process(tiny(corpus, rounds=ROUNDS + 1), workdir)
    for role, folder in folders.items():
        named = [m for m in logged(caplog, r"(the checkpoint of round 4 in (\S+) is damaged: .*); the previous "
                                           r"checkpoint is tried")
                 if m[1] == os.path.join(folder, "4")]
        assert len(named) == 1, role  # named once, with the leaf that reads other bits (or orbax's error)
        assert sorted(os.listdir(folder)) == ["4", "4.damaged", "5"]  # 2 and 4 kept; 4 set aside, then 4, 5 saved
    assert [r["round"] for r in records(workdir, "coordinator", "round")] == [1, 2, 3, 4, 3, 4, 5]
    # b, ahead of the coordinator's round 2, rolls back to its own checkpoint of it; a resumed there already
    assert [(r["round"], r["source"]) for r in records(workdir, "islands/b", "rejoin")] == [(2, "checkpoint")]
    assert records(workdir, "islands/a", "rejoin") == []
    assert summary["rounds"] == 5 and summary["checksums_agree"] is True and summary["failures"] == []


def test_a_run_whose_islands_disagree_or_merged_without_a_required_island_fails(finished, tmp_path):
    corpus, workdir = copy(finished, tmp_path)
    config = tiny(corpus)
    path = os.path.join(workdir, "islands", "b", "summary.json")
    summary = json.loads(open(path).read())
    held, summary["checksum"] = summary["checksum"], "0123456789abcdef"
    open(path, "w").write(json.dumps(summary))
    with open(os.path.join(workdir, "coordinator", "metrics.jsonl"), "a") as f:  # round 3 again, merged from a alone
        last = records(workdir, "coordinator", "round")[2]
        f.write(json.dumps(dict(last, contributors=["a"])) + "\n")
    combined = combine_summaries(config, workdir, 1.0)
    view = json.loads(open(os.path.join(workdir, "coordinator", "summary.json")).read())["checksum"]
    assert view == held
    assert combined["rounds_short"] == [3]
    assert combined["failures"] == [
        f"the islands' final global parameters disagree (a={held}, b=0123456789abcdef; the coordinator's view "
        f"{view})",
        "1 round(s) were merged from fewer islands than outer.min_islands=0 requires (2): rounds [3] (round 3 from "
        "['a'] only); see the coordinator's log for why",
    ]
    assert json.loads(open(os.path.join(workdir, "summary.json")).read())["failures"] == combined["failures"]
    from island_jax.workdir import check_finished

    with pytest.raises(RunFailed) as failed:
        check_finished(combined)
    assert str(failed.value) == "the run failed: " + "; ".join(combined["failures"])


def test_a_start_refused_for_its_data_leaves_no_run_and_the_corrected_command_starts_a_new_one(finished, tmp_path):
    corpus, _ = finished
    workdir = str(tmp_path / "workdir")
    wrong = tiny(str(tmp_path / "nowhere" / "*.py"), rounds=1)
    with pytest.raises(DataError):
        run_in_process(wrong, workdir)
    for name in ("a", "b"):  # no island began: no config.json to refuse the corrected command with
        assert not os.path.exists(os.path.join(workdir, "islands", name, "config.json"))
    summary = run_in_process(tiny(corpus, rounds=1), workdir)
    assert summary["rounds"] == 1 and summary["checksums_agree"] is True
    for role in ("coordinator", "islands/a", "islands/b"):
        assert json.loads(open(os.path.join(workdir, role, "config.json")).read())["data"]["files"] == corpus
    for name in ("a", "b"):  # what the refused start left (its empty metrics), set aside
        attempts = os.path.join(workdir, "islands", name, "attempts")
        assert os.listdir(attempts) == ["1"] and "metrics.jsonl" in os.listdir(os.path.join(attempts, "1"))


def test_sample_and_export_read_checked_parameters_and_name_a_leaf_that_differs(finished, tmp_path):
    """`model.load.from_workdir` (what `sample`, `export` and `Result.sample` read) checks the parameters against
    the checksums in the checkpoint's metadata, as a role's restore does."""
    _, workdir = copy(finished, tmp_path)
    config, params, round = load.from_workdir(workdir)  # intact: read as saved
    assert round == 4
    path = os.path.join(workdir, "islands", "a", "checkpoints", "4", "_CHECKPOINT_METADATA")
    metadata = json.loads(open(path).read())
    leaves = metadata["custom_metadata"]["island_jax_leaves"]
    leaf = "['anchor']['head']['kernel']"
    read, leaves[leaf][0] = leaves[leaf][0], "0123456789abcdef"  # as if the bits on disk had changed since
    open(path, "w").write(json.dumps(metadata))
    with pytest.raises(LoadError) as refused:
        load.from_workdir(workdir)
    assert str(refused.value) == (
        f"the checkpoint of round 4 in {os.path.dirname(path)} is damaged: {leaf} reads checksum {read}, but was "
        "saved with 0123456789abcdef; pass --round=2 (an older checkpoint), or let the run resume (it falls back to "
        "its newest intact checkpoint)"
    )
    assert load.from_workdir(workdir, round=2)[2] == 2


@pytest.mark.slow  # starts launch/summarize.py
def test_a_run_whose_islands_disagree_exits_non_zero_saying_so_last(finished, tmp_path):
    import subprocess
    import sys

    from processes import ROOT, role_env

    corpus, workdir = copy(finished, tmp_path)
    path = os.path.join(workdir, "islands", "b", "summary.json")
    summary = json.loads(open(path).read())
    held, summary["checksum"] = summary["checksum"], "0123456789abcdef"
    open(path, "w").write(json.dumps(summary))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "summarize.py"), f"--config={os.path.join(ROOT, 'tests', 'tiny_config.py')}",
         f"--workdir={workdir}", f"--config.data.files={corpus}", f"--config.outer.rounds={ROUNDS}",
         "--config.checkpoint.every_rounds=2"],
        capture_output=True, text=True, env=role_env(), timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[summarize] the run failed: the islands' final global parameters disagree (a={held}, b=0123456789abcdef; "
        f"the coordinator's view {held})"
    )
    assert "global parameters agree: False" in result.stdout
