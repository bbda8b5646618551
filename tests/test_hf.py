"""Hugging Face transformers interop, checked by transformers itself (CPU, float32): every supported architecture
imported from a randomly initialised transformers model, trained 2 rounds of the tiny two-island run, exported
(`--format=hf`) and loaded back by `AutoModelForCausalLM`; imports exported again bit for bit; refusals."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from processes import shared_folder
from tiny_config import get_config, write_corpus

from island_jax import export, sample
from island_jax.config import ConfigError
from island_jax.config.hf import InteropError, apply, architecture
from island_jax.data.tokenizer import byte_level_json
from island_jax.model import hf, load
from island_jax.model.init import checksum
from island_jax.run import run_in_process


def _libraries():
    """(torch, transformers), imported when a test needs them (about 2 s; the test extra installs torch's CPU
    build and transformers), so that a worker that runs none of these tests does not pay for them."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


TOLERANCE = 1e-4  # rtol and atol of logits: float32 sums in another order (torch's kernels against XLA's)
COMMON = dict(vocab_size=256, hidden_size=32, num_attention_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_parameters=dict(rope_theta=10_000.0, rope_type="default"), num_experts_per_tok=2,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
# A tiny config.json of each architecture: grouped-query attention where it allows, dense blocks between MoE
# blocks and shared experts where it has them.
HF_CONFIGS = {
    "mixtral": dict(COMMON, model_type="mixtral", num_hidden_layers=1, num_key_value_heads=1, num_local_experts=4,
                    intermediate_size=32, sliding_window=None),
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", num_hidden_layers=2, num_key_value_heads=2, num_experts=4,
                      intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      decoder_sparse_step=2, norm_topk_prob=False, qkv_bias=False),
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
                      num_experts=4, intermediate_size=48, moe_intermediate_size=32, decoder_sparse_step=2,
                      norm_topk_prob=True),
}
ARCHITECTURES = list(HF_CONFIGS)
BATCH = np.random.default_rng(0).integers(0, 256, (4, 64)).astype(np.int32)  # 4 fixed sequences of byte ids
PROMPT = list(b"def self(:")


def _hf_model(arch: str, seed: int = 0):
    torch, transformers = _libraries()
    fields = dict(HF_CONFIGS[arch])
    kind = fields.pop("model_type")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(kind, **fields)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _save_hf_model(arch: str, folder) -> None:
    """A randomly initialised transformers model of `arch`, saved by `save_pretrained`, with a byte tokenizer."""
    _hf_model(arch).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(byte_level_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def _hf_logits(folder, tokens=BATCH) -> np.ndarray:
    torch, transformers = _libraries()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _tensors(folder) -> dict:
    get, names, _ = hf.read_weights(str(folder))
    return {name: get(name) for name in sorted(names)}


def _run_config(folder, checkpoint) -> object:
    config = get_config()
    config.data.files = str(folder / "corpus" / "*.py")
    config.model.seq_len = 64
    config.outer.rounds = 2
    config.eval.every_rounds = 2
    return apply(config, str(checkpoint))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def trained(request, tmp_path_factory):
    """Per architecture: a random transformers model (`imported/`), the tiny two-island run started from it
    (`model.init_from`) and trained 2 rounds (`workdir/`), and its `--format=hf` export (`export/`)."""
    arch = request.param

    def make(folder):
        write_corpus(folder / "corpus")
        _save_hf_model(arch, folder / "imported")
        run_in_process(_run_config(folder, folder / "imported"), str(folder / "workdir"))
        export.export(str(folder / "workdir"), str(folder / "export"), format="hf")

    return arch, shared_folder(tmp_path_factory, f"hf_{arch}", make)


def test_an_export_loads_in_transformers_to_the_same_logits_keys_and_greedy_tokens(trained, tmp_path):
    torch, transformers = _libraries()
    arch, folder = trained
    out = folder / "export"
    config, params, _ = load.from_workdir(str(folder / "workdir"))
    hf_config = json.loads((out / "config.json").read_text())
    name = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    assert (hf_config["model_type"], hf_config["architectures"]) == (arch, [name])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == name
    # the key set, shapes and dtypes are what transformers' own save_pretrained writes for that model
    model.save_pretrained(tmp_path / "resaved")
    ours, theirs = _tensors(out), _tensors(tmp_path / "resaved")
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    # logits at every position of 4 sequences
    with torch.no_grad():
        hf_logits = model(torch.tensor(BATCH, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(hf_logits, sample.logits(config, params, BATCH), rtol=TOLERANCE, atol=TOLERANCE)
    # greedy decoding, 32 tokens: the same up to the first step whose top-2 margin is within the tolerance
    ours_new = sample.greedy_without_cache(config, params, np.array(PROMPT, np.int32), 32)
    # the KV cache (K key/value heads of grouped-query attention, normed keys) decodes the same tokens
    assert sample.generate(config, params, PROMPT, 32, temperature=0)[0].tolist() == ours_new.tolist()
    with torch.no_grad():
        generated = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                   max_new_tokens=32, do_sample=False, pad_token_id=0)
    hf_new = generated[0, len(PROMPT):].numpy()
    steps = sample.logits(config, params, np.array([PROMPT + list(ours_new)], np.int32))[0, len(PROMPT) - 1: -1]
    top2 = np.sort(steps, axis=-1)[:, -2:]
    close = np.flatnonzero(top2[:, 1] - top2[:, 0] < TOLERANCE)
    sure = int(close[0]) if close.size else 32
    assert hf_new[:sure].tolist() == ours_new[:sure].tolist()
    # the tokenizer: transformers' AutoTokenizer encodes text to its UTF-8 bytes, the ids the run trained on
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def grüße(x):\n\treturn x  # €"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text


def test_an_import_has_the_transformers_logits_and_exports_again_bit_for_bit(trained, tmp_path):
    arch, folder = trained
    config, params = load.from_hf(str(folder / "imported"))
    np.testing.assert_allclose(sample.logits(config, params, BATCH), _hf_logits(folder / "imported"),
                               rtol=TOLERANCE, atol=TOLERANCE)
    record = dict(kind="bytes", path="", eos_token="", tiktoken_name="", hash="", vocab_size=256)
    # exported again, cut into shards of at most 40 kB: an index and the same tensors, bit for bit
    done = load.save_hf(str(tmp_path / "again"), config, params, record, max_shard_size=40_000)
    assert done["architecture"] == arch and len(done["files"]) > 1
    index = json.loads((tmp_path / "again" / hf.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(os.path.basename(f) for f in done["files"])
    original, again = _tensors(folder / "imported"), _tensors(tmp_path / "again")
    assert sorted(original) == sorted(again)
    for name in original:
        assert again[name].dtype == original[name].dtype and np.array_equal(again[name], original[name]), name
    # transformers reads the shards to the same model
    np.testing.assert_array_equal(_hf_logits(tmp_path / "again"), _hf_logits(folder / "imported"))
    # into scanned blocks (stacked parameters): the same logits, and the same file written again over the shards
    scanned_config = _run_config(folder, folder / "imported")
    scanned_config.model.scan_layers = True
    load.check_init_from(scanned_config)
    scanned_config, scanned = load.from_hf(str(folder / "imported"), scanned_config)
    assert "layers" in scanned and "blocks" not in scanned
    np.testing.assert_array_equal(sample.logits(scanned_config, scanned, BATCH), sample.logits(config, params, BATCH))
    load.save_hf(str(tmp_path / "again"), scanned_config, scanned, record)
    assert sorted(f for f in os.listdir(tmp_path / "again") if "safetensors" in f) == ["model.safetensors"]  # no stale shard
    assert all(np.array_equal(a, original[n]) for n, a in _tensors(tmp_path / "again").items())


def test_a_run_from_an_import_starts_at_its_checksum_and_the_islands_agree_every_round(trained):
    _, folder = trained
    _, imported = load.from_hf(str(folder / "imported"))
    workdir = folder / "workdir"
    coordinator = json.loads((workdir / "coordinator" / "summary.json").read_text())
    assert coordinator["initial_checksum"] == checksum(imported)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["checksums_agree"] is True and summary["checksums_agree_every_round"] is True
    assert summary["rounds"] == 2 and summary["params"] == sum(a.size for a in jax.tree.leaves(imported))


def test_what_maps_onto_no_architecture_is_refused_by_name(trained, tmp_path):
    arch, folder = trained
    learned = get_config()  # learned positions: no transformers MoE architecture has them
    with pytest.raises(InteropError, match=r"mixtral: model.positions is 'learned'.*qwen2_moe: model.positions"):
        architecture(learned)
    rope = get_config()
    rope.model.positions, rope.moe.routing_bias_update_rate = "rope", 0.001
    with pytest.raises(InteropError, match=r"moe.routing_bias_update_rate is 0.001"):
        architecture(rope, "mixtral")
    # an export as another architecture than the model's is refused, and nothing is written
    other = "mixtral" if arch != "mixtral" else "qwen3_moe"
    field = {"qwen2_moe": "moe.every_n_layers", "qwen3_moe": "moe.every_n_layers", "mixtral": "model.qk_norm"}[arch]
    with pytest.raises(InteropError, match=field):
        export.export(str(folder / "workdir"), str(tmp_path / "out"), format="hf", architecture=other)
    assert not (tmp_path / "out").exists()


def _broken_copy(folder, tmp_path, change) -> str:
    """A copy of the imported checkpoint whose tensors `change(dict)` altered."""
    target = tmp_path / "broken"
    shutil.copytree(folder / "imported", target)
    tensors = _tensors(target)
    change(tensors)
    from safetensors.numpy import save_file

    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


CONFIG_REFUSALS = {  # a config.json field the model cannot represent, or lacks: (change, the message's words)
    "config": (dict(tie_word_embeddings=True), "tie_word_embeddings = True"),
    "rope": (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope_scaling.rope_type = 'linear'"),
    "eps": (dict(rms_norm_eps=None), "has no rms_norm_eps"),
}


@pytest.mark.parametrize("case", ["missing", "shape", "extra", "architecture", *CONFIG_REFUSALS])
def test_a_checkpoint_the_model_cannot_take_is_refused_by_name_and_nothing_starts(trained, tmp_path, case):
    arch, folder = trained
    name = "model.layers.0.self_attn.o_proj.weight"
    if case == "missing":
        broken, match = _broken_copy(folder, tmp_path, lambda t: t.pop(name)), f"has no tensor {name} \\[32, 32\\]"
    elif case == "shape":
        broken = _broken_copy(folder, tmp_path, lambda t: t.update({name: t[name][:16]}))
        match = f"holds {name} as \\[16, 32\\], but the model of its config.json needs \\[32, 32\\]"
    elif case == "extra":
        broken = _broken_copy(folder, tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": t[name][0]}))
        match = "no place for: model.layers.0.self_attn.q_proj.bias"
    elif case == "architecture":
        broken = _broken_copy(folder, tmp_path, lambda t: None)
        hf_config = json.loads((folder / "imported" / "config.json").read_text())
        (tmp_path / "broken" / "config.json").write_text(json.dumps(dict(hf_config, model_type="deepseek_v3")))
        match = "model_type = 'deepseek_v3', an architecture island_jax does not import"
    else:  # a setting the model cannot represent, or one it cannot do without
        broken = _broken_copy(folder, tmp_path, lambda t: None)
        change, match = CONFIG_REFUSALS[case]
        hf_config = dict(json.loads((folder / "imported" / "config.json").read_text()), **change)
        hf_config = {k: v for k, v in hf_config.items() if v is not None}
        (tmp_path / "broken" / "config.json").write_text(json.dumps(hf_config))
        match = re.escape(match)
    with pytest.raises(InteropError, match=match):
        load.from_hf(broken)
    if case == "architecture" or case in CONFIG_REFUSALS:  # refused by apply, before a config exists
        with pytest.raises(InteropError, match=match):
            _run_config(folder, broken)
        return
    config = _run_config(folder, folder / "imported")
    config.model.init_from = broken
    with pytest.raises(InteropError, match=match):
        run_in_process(config, str(tmp_path / "workdir"))
    assert not (tmp_path / "workdir").exists()  # nothing written, nothing started


def test_a_config_whose_model_is_not_its_init_from_is_refused_naming_the_field(trained):
    _, folder = trained
    config = _run_config(folder, folder / "imported")
    config.model.d_model = 64
    with pytest.raises(ConfigError, match=r"whose model has model.d_model = 32, but the config has 64"):
        from island_jax.config import validate

        validate(config)
    assert jax.tree.leaves(load.from_hf(str(folder / "imported"))[1])  # the checkpoint itself still reads
