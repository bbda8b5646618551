"""Sampling from a run's checkpoint (KV cache) in its tokenizer, and exporting its weights as safetensors."""

import json
import logging
import os
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest
from processes import shared_folder
from tiny_config import get_config, write_corpus, write_prepared

from island_jax import experiment, logs, sample
from island_jax.config import island
from island_jax.data.records import PreparedDataset
from island_jax.mesh import island_mesh
from island_jax.metrics import read_jsonl
from island_jax.model import load
from island_jax.model.init import checksum, init_params
from island_jax.run import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = b"def self(:"  # bytes of the tiny corpus's words
IDS = np.frombuffer(PROMPT, np.uint8).astype(np.int32)  # their ids on the byte corpus
GREETING = "def Grüße"  # not ASCII: 11 UTF-8 bytes, fewer BPE tokens


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny two-island run with 64-byte sequences, 3 rounds: (config, workdir), made once per pytest run
    (`shared_folder`)."""

    def trained_config(folder):
        config = get_config()
        config.data.files = str(folder / "corpus" / "*.py")
        config.model.seq_len = 64
        return config

    def make(folder):
        write_corpus(folder / "corpus")
        run_in_process(trained_config(folder), str(folder / "workdir"))

    folder = shared_folder(tmp_path_factory, "sample", make)
    return trained_config(folder), folder / "workdir"


def test_greedy_sampling_with_the_cache_equals_argmax_decoding_without_it(trained):
    _, workdir = trained
    config, params, round = load.from_workdir(str(workdir))
    assert round == 3
    fast = sample.generate(config, params, IDS, max_new_tokens=32, temperature=0)[0]
    slow = sample.greedy_without_cache(config, params, IDS, 32)
    assert fast.dtype == np.int32 and fast.shape == (32,) and fast.tolist() == slow.tolist()
    assert len(set(fast.tolist())) > 1  # not one byte repeated: the check compares real choices
    # a top-k of 1, or a nucleus smaller than any token's probability, leaves only the argmax at any temperature
    assert sample.generate(config, params, IDS, 32, temperature=1.5, top_k=1, seed=4)[0].tolist() == fast.tolist()
    assert sample.generate(config, params, IDS, 32, temperature=1.5, top_p=1e-9, seed=4)[0].tolist() == fast.tolist()
    # on a mesh of 2 x 2 devices (the samples split over data, the experts over expert): the same choices
    meshed = sample.generate(config, params, IDS, 32, temperature=0, num_samples=4, mesh=(2, 2))
    assert meshed.tolist() == [fast.tolist()] * 4
    drawn = sample.generate(config, params, IDS, 32, temperature=1.0, seed=0, num_samples=3)
    assert drawn.tolist() == sample.generate(config, params, IDS, 32, temperature=1.0, seed=0, num_samples=3).tolist()
    assert drawn.shape == (3, 32) and len({tuple(d) for d in drawn.tolist()}) == 3  # three draws, each repeatable


def test_sampling_reads_a_kept_round_and_refuses_what_the_model_cannot_do(trained):
    _, workdir = trained
    config, params, round = load.from_workdir(str(workdir), round=2)
    assert round == 2 and checksum(params) != checksum(load.from_workdir(str(workdir))[1])
    with pytest.raises(load.LoadError, match=r"holds no checkpoint of round 7; it keeps rounds \[1, 2, 3\]"):
        load.from_workdir(str(workdir), round=7)
    with pytest.raises(sample.SampleError, match=r"10 tokens and 60 new tokens make 70 positions, but the model "
                                                 r"learned 64 \(model.seq_len\)"):
        sample.generate(config, params, IDS, max_new_tokens=60)
    with pytest.raises(sample.SampleError, match="the prompt is empty; give at least one token"):
        sample.generate(config, params, [], max_new_tokens=4)
    with pytest.raises(sample.SampleError, match="the prompt is empty; give at least one character"):
        sample.continue_text(config, params, "", max_new_tokens=4)


def test_result_sample_gives_text(trained):
    _, workdir = trained
    result = experiment.Result.load(str(workdir))
    greedy = result.sample(PROMPT.decode(), max_new_tokens=16, temperature=0)
    ids = sample.greedy_without_cache(*load.from_workdir(str(workdir))[:2], IDS, 16)
    assert greedy == [bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")]  # the byte corpus: UTF-8


def test_an_export_loads_to_bit_identical_logits_and_refuses_another_model(trained, tmp_path):
    from island_jax import export

    config, workdir = trained
    umask = os.umask(0o022)
    try:
        done = export.export(str(workdir), str(tmp_path / "export"))
    finally:
        os.umask(umask)
    assert done["round"] == 3 and os.path.basename(done["weights"]) == "model.safetensors"
    assert done["tokenizer"] == ""  # the byte corpus: no file to carry
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):  # a new file's mode under umask 022
        assert stat.S_IMODE(os.stat(tmp_path / "export" / name).st_mode) == 0o644, name
    saved_config, params = load.from_workdir(str(workdir))[:2]
    loaded_config, loaded = load.from_export(str(tmp_path / "export"))
    assert loaded_config.to_dict() == saved_config.to_dict() and checksum(loaded) == done["checksum"]
    assert sample.export_tokenizer_record(str(tmp_path / "export")) == dict(
        kind="bytes", path="", eos_token="", tiktoken_name="", hash=sample.run_tokenizer(config).hash, vocab_size=256)
    # what the run itself says it held after round 3: the coordinator's view, every island's global parameters
    (last,) = [r for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "round" and r["round"] == 3]
    assert done["checksum"] == last["checksum"]
    graphdef, _, _ = init_params(config)
    tokens = np.frombuffer(b"class Foo(self):\n    return self" * 2, np.uint8).astype(np.int32)[None, :64]

    def logits(p):
        from flax import nnx

        with jax.set_mesh(island_mesh(1, 1, jax.devices()[:1])):
            return np.asarray(jax.jit(lambda q, t: nnx.merge(graphdef, nnx.State(q))(t)[0])(p, tokens))

    np.testing.assert_array_equal(logits(loaded), logits(params))

    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((tmp_path / "export" / "model.safetensors").read_bytes())
    wider = json.loads((tmp_path / "export" / "config.json").read_text())
    wider["model"]["d_model"] = 64
    (other / "config.json").write_text(json.dumps(wider))
    with pytest.raises(load.LoadError, match=r"holds blocks.0.attn.out.kernel as float32\[32, 32\] but the model of "
                                             r"its config has float32\[64, 64\]"):
        load.from_export(str(other))


@pytest.mark.slow  # starts python -m island_jax.export and python -m island_jax.sample
def test_the_command_lines_export_and_sample(trained, tmp_path):
    _, workdir = trained
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=120)
    exported = subprocess.run([sys.executable, "-m", "island_jax.export", f"--workdir={workdir}", "--round=2",
                               f"--out={tmp_path / 'export'}"], **run)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert exported.stdout.startswith("exported round 2 (") and (tmp_path / "export" / "model.safetensors").exists()
    sampled = subprocess.run([sys.executable, "-m", "island_jax.sample", f"--export={tmp_path / 'export'}",
                              f"--prompt={PROMPT.decode()}", "--temperature=0", "--max_new_tokens=20"], **run)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    _, params = load.from_export(str(tmp_path / "export"))
    config = load.read_config(str(tmp_path / "export" / "config.json"))
    expected = bytes(IDS.tolist() + sample.greedy_without_cache(config, params, IDS, 20).tolist()).decode(
        "utf-8", errors="replace")
    assert sampled.stdout.splitlines()[1:] == expected.splitlines()
    assert exported.stderr == "" and sampled.stderr == ""  # orbax's restore lines are quiet by default
    loud = subprocess.run([sys.executable, "-m", "island_jax.export", f"--workdir={workdir}", "--round=2",
                           f"--out={tmp_path / 'loud'}", "--verbosity=1"], **run)
    assert loud.returncode == 0 and "Given directory is read only=" in loud.stderr  # shown with --verbosity=1
    halves = subprocess.run([sys.executable, "experiments/heldout_halves.py", f"--workdir={workdir}", "--sizes=8",
                             "--draws=5"], **run)
    assert halves.returncode == 0, halves.stderr[-2000:]
    lines = halves.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"{workdir}, round 3: ") and lines[1].startswith("n=8: mean ")


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """One island of one device trained one round on records of a byte-level BPE (300 asked, 296 made) whose
    documents hold GREETING's words: (config, workdir), made once per pytest run (`shared_folder`)."""

    def bpe_config(folder):
        config = get_config()
        config.data.prepared = str(folder / "data" / "prepared")
        config.model.update(vocab_size=320, positions="rope")  # rows past the tokenizer's 296: padding
        del config.islands["b"]
        config.islands.a = island(1, 1, 1, 4, 2)
        config.outer.rounds = 1
        config.eval.every_rounds = 1
        return config

    def make(folder):
        words = ["def", "return", "self", "Grüße", "import", "class", "(", ")", ":", "\n    "]
        write_prepared(folder / "data", words=words, documents=60, seq_len=32)
        run_in_process(bpe_config(folder), str(folder / "workdir"))

    folder = shared_folder(tmp_path_factory, "sample_bpe", make)
    return bpe_config(folder), folder / "workdir"


def test_sampling_a_bpe_run_round_trips_a_non_ascii_prompt_through_its_tokenizer(bpe_run, tmp_path):
    config, workdir = bpe_run
    config, params, round = load.from_workdir(str(workdir))
    tokenizer = sample.run_tokenizer(config)
    dataset = PreparedDataset(config.data.prepared)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.hash) == ("bpe", 296, dataset.tokenizer_hash)  # 39 merges
    ids = tokenizer.encode(GREETING)
    assert len(ids) < len(GREETING.encode("utf-8")) and tokenizer.decode(ids) == GREETING

    (greedy,) = sample.continue_text(config, params, GREETING, tokenizer, max_new_tokens=12, temperature=0)
    assert greedy.prompt_ids.tolist() == ids.tolist()
    assert greedy.ids.tolist() == sample.greedy_without_cache(config, params, ids, 12, vocab_size=296).tolist()
    assert greedy.text == tokenizer.decode([*ids, *greedy.ids]) and greedy.text.startswith(GREETING)
    assert greedy.new_text == greedy.text[len(GREETING):]
    drawn = sample.continue_text(config, params, GREETING, tokenizer, max_new_tokens=12, temperature=1.0, seed=3,
                                 num_samples=4)
    every = np.stack([c.ids for c in drawn])
    assert every.max() >= 257 and every.max() < 296  # merged tokens drawn, never the model's padding rows
    for c in drawn:  # each sample's ids decoded whole, after the prompt's, by the tokenizer
        assert c.text == tokenizer.decode([*ids, *c.ids]) and c.text.startswith(GREETING)
    # Result.sample is the same function: the text after the prompt
    assert experiment.Result.load(str(workdir)).sample(GREETING, 12, temperature=0) == [greedy.new_text]

    # an export carries its tokenizer: sampled from it with the prepared dataset out of reach
    from island_jax import export

    done = export.export(str(workdir), str(tmp_path / "export"))
    assert os.path.basename(done["tokenizer"]) == "tokenizer.json"
    moved, loaded = load.from_export(str(tmp_path / "export"))
    moved.data.prepared = str(tmp_path / "nowhere")
    with pytest.raises(sample.SampleError, match=r"the run's tokenizer is that of data.prepared, and the prepared "
                                                 rf"dataset {tmp_path / 'nowhere'} does not exist"):
        sample.run_tokenizer(moved)
    carried = sample.run_tokenizer(moved, export=str(tmp_path / "export"))
    assert carried.hash == tokenizer.hash
    (again,) = sample.continue_text(moved, loaded, GREETING, carried, max_new_tokens=12, temperature=0)
    assert again.text == greedy.text

    # the command line prints the same text, and nothing on stderr (orbax's lines are quiet by default)
    sampled = subprocess.run([sys.executable, "-m", "island_jax.sample", f"--workdir={workdir}",
                              f"--prompt={GREETING}", "--temperature=0", "--max_new_tokens=12"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout == f"--- sample 0 ({workdir}, round 1, temperature 0.0, seed 0)\n{greedy.text}\n"
    assert sampled.stderr == ""


def test_a_bpe_runs_transformers_export_carries_its_tokenizer_and_a_run_from_it_needs_that_tokenizers_data(
        bpe_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from island_jax import export
    from island_jax.config.hf import InteropError, apply

    config, workdir = bpe_run
    tokenizer = sample.run_tokenizer(config)
    done = export.export(str(workdir), str(tmp_path / "hf"), format="hf")
    assert done["architecture"] == "mixtral"
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs(GREETING)["input_ids"] == tokenizer.encode(GREETING).tolist() and theirs.decode(
        tokenizer.encode(GREETING)) == GREETING
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == tokenizer.eos_id
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id
    # a run from it trains on data its tokenizer prepared: on the byte corpus it is refused, saying how to prepare
    started = apply(get_config(), str(tmp_path / "hf"))
    started.islands = config.islands
    with pytest.raises(InteropError, match=r"whose tokenizer is .*tokenizer.json, but the data is the byte corpus; "
                                           r"prepare the data with it \(python experiments/prepare_data.py "
                                           r"--tokenizer=tokenizer_json"):
        run_in_process(started, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    started.data.prepared = config.data.prepared
    load.check_init_from(started)  # the dataset that BPE prepared: accepted


def test_quiet_libraries_hides_orbax_below_error_and_keeps_island_jaxs_own_records(trained, caplog):
    _, workdir = trained
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="absl")  # orbax's INFO records are made, as under absl's app.run
    with logs.quiet_libraries(verbosity=0) as quiet:
        load.from_workdir(str(workdir))
        logging.getLogger("island_jax.test").info("ours")  # logged from this file: not island_jax's
        logging.getLogger("absl").error("an error shows")
    assert isinstance(quiet, logs.LibraryFilter)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", "an error shows")]
    ours = logging.LogRecord("absl", logging.INFO, os.path.join(logs.PACKAGE_DIR, "sample.py"), 1, "ours", None,
                             None)
    assert quiet.filter(ours) and not quiet.filter(logging.makeLogRecord(dict(levelno=logging.WARNING,
                                                                               pathname="/x/orbax/a.py")))
    caplog.clear()
    with logs.quiet_libraries(verbosity=1) as shown:  # --verbosity=1: every record
        load.from_workdir(str(workdir))
    assert shown is None and any("orbax" in r.pathname and r.levelno == logging.INFO for r in caplog.records)
    caplog.clear()
    load.from_workdir(str(workdir))  # the filter is gone after the block
    assert any("orbax" in r.pathname for r in caplog.records)
