"""Sampling from a run's checkpoint (KV cache), and exporting its weights as safetensors."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from processes import shared_folder
from tiny_config import get_config, write_corpus

from island_jax import experiment, sample
from island_jax.mesh import island_mesh
from island_jax.metrics import read_jsonl
from island_jax.model import load
from island_jax.model.init import checksum, init_params
from island_jax.run import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = b"def self(:"  # bytes of the tiny corpus's words


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
    fast = sample.generate(config, params, PROMPT, max_new_tokens=32, temperature=0)[0]
    slow = sample.greedy_without_cache(config, params, PROMPT, 32)
    assert len(fast) == 32 and fast == slow
    assert len(set(fast)) > 1  # not one byte repeated: the check compares real choices
    # a top-k of 1, or a nucleus smaller than any token's probability, leaves only the argmax at any temperature
    assert sample.generate(config, params, PROMPT, 32, temperature=1.5, top_k=1, seed=4)[0] == fast
    assert sample.generate(config, params, PROMPT, 32, temperature=1.5, top_p=1e-9, seed=4)[0] == fast
    # on a mesh of 2 x 2 devices (the samples split over data, the experts over expert): the same choices
    assert sample.generate(config, params, PROMPT, 32, temperature=0, num_samples=4, mesh=(2, 2)) == [fast] * 4
    drawn = sample.generate(config, params, PROMPT, 32, temperature=1.0, seed=0, num_samples=3)
    assert drawn == sample.generate(config, params, PROMPT, 32, temperature=1.0, seed=0, num_samples=3)
    assert len({*drawn}) == 3 and all(len(s) == 32 for s in drawn)  # three draws, each repeatable by its seed


def test_sampling_reads_a_kept_round_and_refuses_what_the_model_cannot_do(trained):
    _, workdir = trained
    config, params, round = load.from_workdir(str(workdir), round=2)
    assert round == 2 and checksum(params) != checksum(load.from_workdir(str(workdir))[1])
    with pytest.raises(load.LoadError, match=r"holds no checkpoint of round 7; it keeps rounds \[1, 2, 3\]"):
        load.from_workdir(str(workdir), round=7)
    with pytest.raises(sample.SampleError, match=r"10 bytes and 60 new tokens make 70 positions, but the model "
                                                 r"learned 64 \(model.seq_len\)"):
        sample.generate(config, params, PROMPT, max_new_tokens=60)
    with pytest.raises(sample.SampleError, match="the prompt is empty"):
        sample.generate(config, params, b"", max_new_tokens=4)


def test_result_sample_gives_text(trained):
    _, workdir = trained
    result = experiment.Result.load(str(workdir))
    greedy = result.sample(PROMPT.decode(), max_new_tokens=16, temperature=0)
    assert greedy == [sample.text(sample.greedy_without_cache(*load.from_workdir(str(workdir))[:2], PROMPT, 16))]


def test_an_export_loads_to_bit_identical_logits_and_refuses_another_model(trained, tmp_path):
    from island_jax import export

    config, workdir = trained
    done = export.export(str(workdir), str(tmp_path / "export"))
    assert done["round"] == 3 and os.path.basename(done["weights"]) == "model.safetensors"
    saved_config, params = load.from_workdir(str(workdir))[:2]
    loaded_config, loaded = load.from_export(str(tmp_path / "export"))
    assert loaded_config.to_dict() == saved_config.to_dict() and checksum(loaded) == done["checksum"]
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
    expected = PROMPT.decode() + sample.text(sample.greedy_without_cache(config, params, PROMPT, 20))
    assert sampled.stdout.splitlines()[1:] == expected.splitlines()
    halves = subprocess.run([sys.executable, "experiments/heldout_halves.py", f"--workdir={workdir}", "--sizes=8",
                             "--draws=5"], **run)
    assert halves.returncode == 0, halves.stderr[-2000:]
    lines = halves.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"{workdir}, round 3: ") and lines[1].startswith("n=8: mean ")
