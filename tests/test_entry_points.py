"""The entry points' arguments (experiments/train.py, launch/local.py): a config found or named in one line, a
run's recorded config.json as its config, a workdir resumed under it, a port in use refused before anything
starts, a spaced override caught, a resume's old round lines skipped. The checks are called in this process; the
tests marked slow run the scripts and read their one line."""

import json
import os
import socket
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from launchers import launcher
from ml_collections import config_flags
from processes import CONFIG, role_env
from tiny_config import get_config

from island_jax import cli
from island_jax.config import fingerprint_fields
from island_jax.workdir import check_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "experiments", "train.py")
LOCAL = os.path.join(ROOT, "launch", "local.py")

local = launcher("local")  # once per process, shared with tests/test_supervisor.py: it defines absl flags


def record(config, folder) -> str:
    """`config` written to `folder/config.json` as a role records it (`workdir.open_role`); returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    return str(folder / "config.json")


def parsed(argv, from_workdir=True):
    """The config absl's flags give for `argv`, found and loaded as `cli.parse_flags` does, in flags of its own."""
    argv = cli._loadable(cli.config_argv(argv, from_workdir))
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv, lock_config=True)
    flags.DEFINE_string("workdir", None, "", flag_values=values)
    values(argv)
    return values.config


def field_types(config, prefix=""):
    """{dotted field: (its type, a FieldReference's declared type)} of every leaf of a ConfigDict."""
    out = {}
    for key, value in config._fields.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(field_types(value, f"{prefix}{key}."))
        else:
            declared = value.get_type() if isinstance(value, ml_collections.FieldReference) else None
            out[f"{prefix}{key}"] = (type(value), declared)
    return out


@pytest.mark.parametrize("path", ["experiments/configs/two_islands.py", "experiments/configs/deepseek_v3_like.py"])
def test_a_recorded_config_json_reads_back_as_the_config_it_was_written_from(tmp_path, path):
    from island_jax.experiment import load_config

    original = load_config(path)
    original.lock()
    recorded = parsed(["train.py", f"--config={record(original, tmp_path / 'coordinator')}"])
    assert recorded == original
    assert field_types(recorded) == field_types(original)  # tuples, floats, outer.overlap_steps of `object`
    assert fingerprint_fields(recorded) == fingerprint_fields(original)
    check_resume(recorded, str(tmp_path))  # the run's own record: no change to refuse


def test_workdir_alone_resumes_under_the_recorded_config_and_overrides_apply(tmp_path):
    original = get_config()
    record(original, tmp_path / "coordinator")
    argv = ["train.py", f"--workdir={tmp_path}", "--config.outer.rounds=5", "--config.outer.overlap_steps=auto"]
    assert cli.config_argv(argv, from_workdir=True) == [
        "train.py", f"--config={tmp_path / 'coordinator' / 'config.json'}", *argv[1:]]
    config = parsed(argv)
    assert (config.outer.rounds, config.outer.overlap_steps) == (5, "auto")
    config.unlock()
    config.outer.update(rounds=original.outer.rounds, overlap_steps=0)
    assert config == original
    # without a coordinator's record (a run without the outer loop), the first island's
    baseline = tmp_path / "baseline"
    record(original, baseline / "islands" / "b")
    record(original, baseline / "islands" / "a")
    assert cli.recorded_config_path(str(baseline)) == str(baseline / "islands" / "a" / "config.json")


def test_a_config_is_found_from_any_folder_or_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.config_argv(["train.py", "--config", "tests/tiny_config.py", "--workdir=w"]) == [
        "train.py", f"--config={CONFIG}", "--workdir=w"]
    with pytest.raises(ValueError) as missing:
        cli.config_argv(["train.py", "--config=experiments/configs/three_islands.py"])
    assert str(missing.value) == (
        f"--config=experiments/configs/three_islands.py: no config file 'experiments/configs/three_islands.py' "
        f"(looked in {tmp_path} and {ROOT}); pass the path of an experiment config (a get_config() file, e.g. "
        "experiments/configs/two_islands.py) or of a run's recorded config.json")
    with pytest.raises(ValueError) as neither:
        cli.config_argv(["train.py", f"--workdir={tmp_path}"], from_workdir=True)
    assert str(neither.value) == (
        "--config is required: pass an experiment config, e.g. --config=experiments/configs/two_islands.py, or "
        f"--workdir of a started run to resume it under its recorded config; {tmp_path} holds no recorded "
        "config.json (no role of a run has started there)")


@pytest.mark.parametrize("bound", ["0.0.0.0", "127.0.0.1"])
def test_a_port_in_use_is_refused_naming_the_flag(bound):
    with socket.create_server((bound, 0)) as taken:
        port = taken.getsockname()[1]
        for host in ("localhost", "0.0.0.0", "127.0.0.1"):
            assert cli.port_in_use(host, port) is not None, (bound, host)
            with pytest.raises(ValueError, match=rf"^--port={port}: the port is in use by another process \(binding "
                                                 r"\S+ fails\); pass a free --port, or leave --port out to have a "
                                                 r"free one picked$"):
                local.check_port(host, port)
    local.check_port("localhost", 0)  # 0: the launcher picks a free one
    with socket.socket() as s:
        s.bind(("localhost", 0))
        free = s.getsockname()[1]
    assert cli.port_in_use("localhost", free) is None


def test_an_override_written_with_a_space_is_caught_before_anything_starts():
    argv = ["local.py", f"--config={CONFIG}", "--workdir=w", "--config.outer.rounds", "2"]
    with pytest.raises(ValueError) as spaced:
        local.config_arguments(argv)
    assert str(spaced.value) == ("--config.outer.rounds 2: write a config override as one argument, "
                                 "--config.outer.rounds=2 (the launcher passes each --config.a.b=v on to every role)")
    argv = ["local.py", f"--config={CONFIG}", "--config.outer.rounds=2", "--config.codec.error_feedback", "--port=1"]
    assert local.config_arguments(argv) == argv[1:4]


def _rounds(workdir, name, rounds):
    with open(workdir / "islands" / name / "metrics.jsonl", "a") as f:
        for r in rounds:
            f.write(json.dumps(dict(kind="round", round=r, train_loss=5.0, bytes_sent=1e6, bytes_received=1e6,
                                    seconds_blocked=0.0)) + "\n")


def test_a_resume_skips_the_round_lines_of_earlier_starts(tmp_path):
    progress, line = local.resumed_progress(str(tmp_path), ["a", "b"], 6)
    assert line is None and progress.poll() == []  # a new run
    for name in ("a", "b"):
        (tmp_path / "islands" / name).mkdir(parents=True)
    _rounds(tmp_path, "a", [1, 2, 3])
    _rounds(tmp_path, "b", [1, 2])
    progress, line = local.resumed_progress(str(tmp_path), ["a", "b"], 6)
    assert line == (f"resuming the run in {tmp_path}: rounds 1-2 were logged by an earlier start; their lines are "
                    "not printed again (each island's metrics.jsonl holds them)")
    assert progress.poll() == []
    _rounds(tmp_path, "b", [3])
    _rounds(tmp_path, "a", [4])
    _rounds(tmp_path, "b", [4])
    assert [p.split(" | ")[0] for p in progress.poll()] == ["round 3/6", "round 4/6"]


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=role_env(), timeout=300,
                          cwd=cwd)


@pytest.mark.slow  # starts the scripts, which refuse before JAX starts
def test_the_entry_points_refuse_bad_arguments_in_one_line_before_anything_starts(tmp_path, corpus):
    workdir = tmp_path / "never"
    (tmp_path / "no_config.py").write_text("rounds = 3\n")
    cases = [  # (script, arguments, the one line)
        (LOCAL, ["--config=no_config.py"],
         f"--config: {tmp_path / 'no_config.py'} defines no get_config(); an experiment config file returns its "
         "config from it"),
        (TRAIN, [f"--config={CONFIG}", "--config.outer.rounds=abc"],
         "FATAL Flags parsing error: flag --config.outer.rounds=abc: invalid literal for int() with base 10: 'abc' "
         "(pass --helpshort or --helpfull to see help on flags)"),
        (LOCAL, ["--config=experiments/configs/three_islands.py"],
         f"--config=experiments/configs/three_islands.py: no config file 'experiments/configs/three_islands.py' "
         f"(looked in {tmp_path} and {ROOT}); pass the path of an experiment config (a get_config() file, e.g. "
         "experiments/configs/two_islands.py) or of a run's recorded config.json"),
        (TRAIN, ["--config=experiments/configs/three_islands.py"],
         f"--config=experiments/configs/three_islands.py: no config file 'experiments/configs/three_islands.py' "
         f"(looked in {tmp_path} and {ROOT}); pass the path of an experiment config (a get_config() file, e.g. "
         "experiments/configs/two_islands.py) or of a run's recorded config.json"),
        (LOCAL, [f"--config={CONFIG}", f"--config.data.files={corpus}", "--config.outer.rounds", "2"],
         "--config.outer.rounds 2: write a config override as one argument, --config.outer.rounds=2 (the launcher "
         "passes each --config.a.b=v on to every role)"),
    ]
    with socket.create_server(("127.0.0.1", 0)) as taken:  # on 127.0.0.1 only; the launcher listens on localhost
        port = taken.getsockname()[1]
        cases += [
            (LOCAL, [f"--config={CONFIG}", f"--config.data.files={corpus}", f"--port={port}"],
             f"--port={port}: the port is in use by another process (binding 127.0.0.1:{port} fails); pass a free "
             "--port, or leave --port out to have a free one picked"),
            (TRAIN, [f"--config={CONFIG}", f"--config.data.files={corpus}", "--role=coordinator",
                     f"--coordinator=0.0.0.0:{port}", "--insecure"],
             f"--coordinator=0.0.0.0:{port}: the port is in use by another process (binding 0.0.0.0:{port} fails); "
             "pick a free port with --coordinator=HOST:PORT"),
        ]
        for script, args, line in cases:
            result = _run(script, f"--workdir={workdir}", *args, cwd=tmp_path)
            assert (result.returncode, result.stderr.splitlines(), result.stdout) == (1, [line], ""), args
    assert not workdir.exists()
