"""island_jax's model as a Hugging Face transformers architecture: which one a config maps onto, its config.json,
and the island_jax fields a transformers config.json sets (docs/interop.md has the table).

Three architectures (`ARCHITECTURES`), each a pre-norm RMSNorm decoder with rotary positions, SwiGLU experts and
softmax-then-top-k routing, no biases and an untied output head:

  mixtral    every block MoE, top-k weights renormalized, no shared experts (Mixtral, arXiv 2401.04088)
  qwen2_moe  MoE every `decoder_sparse_step`-th block, dense SwiGLU between; a shared expert gated by a sigmoid
  qwen3_moe  MoE every `decoder_sparse_step`-th block; RMSNorm on each query and key head; no shared experts

`architecture(config)` picks one or raises `InteropError` naming the field that prevents each; `hf_config` writes
its config.json; `island_fields(hf)` reads one back as dotted island_jax fields (refusing what the model cannot
represent, by name); `apply(config, folder)` starts a config from a checkpoint (`model.init_from`), and
`check_init_from` (from `validate`) refuses a config whose model differs from its `model.init_from`'s. Pure
JSON: no JAX, no transformers.
"""

from __future__ import annotations

import json
import os

import ml_collections

from island_jax.config.schema import ConfigError

HF_CONFIG_FILE = "config.json"
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
ARCHITECTURES = tuple(CLASSES)


class InteropError(ConfigError):
    """A model, config or checkpoint that a transformers architecture cannot represent (or the reverse); the
    message names the field or tensor and what to change."""


def refusals(config: ml_collections.ConfigDict, arch: str) -> list[str]:
    """Why `config`'s model is not `arch`: one sentence per field that prevents it (empty: it maps exactly)."""
    m, moe = config.model, config.moe
    out = []
    if m.get("positions", "learned") != "rope":
        out.append(f"model.positions is {m.get('positions', 'learned')!r}; transformers' MoE architectures use rotary "
                   "positions (set model.positions='rope')")
    if moe.routing_bias_update_rate > 0:
        out.append(f"moe.routing_bias_update_rate is {moe.routing_bias_update_rate}: a routing bias steers the top-k "
                   f"choice, which {arch} does not have (set it to 0)")
    shared, gate = moe.num_shared_experts, moe.get("shared_expert_gate", False)
    if arch == "mixtral":
        if moe.every_n_layers != 1:
            out.append(f"moe.every_n_layers is {moe.every_n_layers}; mixtral has an MoE layer in every block (1)")
        if not moe.renormalize:
            out.append("moe.renormalize is False; mixtral always renormalizes the top-k weights (set it True)")
        if shared:
            out.append(f"moe.num_shared_experts is {shared}; mixtral has no shared experts (0)")
    if arch == "qwen2_moe" and not (shared and gate):
        out.append(f"moe.num_shared_experts is {shared} and moe.shared_expert_gate {gate}; qwen2_moe always has a "
                   "shared expert gated by a sigmoid (set both)")
    if arch == "qwen3_moe" and shared:
        out.append(f"moe.num_shared_experts is {shared}; qwen3_moe has no shared experts (0)")
    if (arch == "qwen3_moe") != bool(m.get("qk_norm", False)):
        out.append(f"model.qk_norm is {m.get('qk_norm', False)}; {arch} "
                   f"{'always norms' if arch == 'qwen3_moe' else 'has no norm on'} each query and key head")
    return out


def architecture(config: ml_collections.ConfigDict, name: str = "") -> str:
    """The transformers architecture `config`'s model is: `name` if given, else the first of `ARCHITECTURES` it
    maps onto exactly.

    Raises:
      InteropError: `name` is not one of `ARCHITECTURES`, or the model is not it (or, with no name, none of them),
        naming for each the field that prevents it.
    """
    if name and name not in CLASSES:
        raise InteropError(f"architecture {name!r} is not one island_jax exports; choose one of {ARCHITECTURES}")
    for arch in [name] if name else ARCHITECTURES:
        if not refusals(config, arch):
            return arch
    reasons = "; ".join(f"{arch}: {' and '.join(refusals(config, arch))}" for arch in ([name] if name else ARCHITECTURES))
    raise InteropError(f"the model maps onto no transformers architecture island_jax exports ({reasons})")


def hf_config(config: ml_collections.ConfigDict, arch: str, eos_token_id: int | None = None) -> dict:
    """The transformers config.json (a dict) of `config`'s model as `arch` (`architecture`'s answer).

    Widths are island_jax's: heads of width d_model / num_heads, the experts' `moe.expert_hidden_dim`, the dense
    blocks' `model.mlp_hidden_dim`, max_position_embeddings = `model.seq_len` (the longest sequence it trained on).
    """
    m, moe = config.model, config.moe
    heads = m.num_heads
    out = dict(
        architectures=[CLASSES[arch]], model_type=arch, vocab_size=m.vocab_size, hidden_size=m.d_model,
        num_hidden_layers=m.num_layers, num_attention_heads=heads, num_key_value_heads=m.get("num_kv_heads", 0) or heads,
        head_dim=m.d_model // heads, hidden_act="silu", max_position_embeddings=m.seq_len,
        rms_norm_eps=m.get("norm_eps", 1e-6), rope_parameters=dict(rope_theta=float(m.rope_theta), rope_type="default"),
        tie_word_embeddings=False, num_experts_per_tok=moe.num_experts_per_token,
        router_aux_loss_coef=moe.load_balancing_loss_coef, output_router_logits=False, dtype=m.param_dtype,
        use_cache=True, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, attention_dropout=0.0,
        initializer_range=0.02,
    )
    if arch == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.expert_hidden_dim,
                   router_jitter_noise=0.0, sliding_window=None)  # moe.jitter_noise is not Mixtral's (docs/interop.md)
    else:  # the experts' count under the name transformers' save_pretrained writes for each
        out.update({"num_local_experts" if arch == "qwen3_moe" else "num_experts": moe.num_experts})
        out.update(moe_intermediate_size=moe.expert_hidden_dim,
                   intermediate_size=m.mlp_hidden_dim, decoder_sparse_step=moe.every_n_layers, mlp_only_layers=[],
                   norm_topk_prob=bool(moe.renormalize), use_sliding_window=False, sliding_window=None)
    if arch == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.num_shared_experts * moe.expert_hidden_dim, qkv_bias=False)
    if arch == "qwen3_moe":
        out.update(attention_bias=False)
    return out


def _get(hf: dict, key: str, source: str):
    if key not in hf:
        raise InteropError(f"{source} has no {key}; it is not a complete {hf.get('model_type')} config")
    return hf[key]


def _refuse_unless(ok: bool, source: str, field: str, value, why: str) -> None:
    if not ok:
        raise InteropError(f"{source}: {field} = {value!r}, which island_jax's model cannot represent ({why})")


def island_fields(hf: dict, source: str = HF_CONFIG_FILE) -> dict:
    """The island_jax fields (dotted name -> value) that a transformers config.json `hf` of a supported
    architecture sets: every field that shapes or changes the model's function.

    Raises:
      InteropError: an architecture other than `ARCHITECTURES` (model_type), or a setting the model cannot represent,
        named with its value: another activation, tied embeddings, attention biases, sliding windows, scaled rotary
        positions, MLP-only layers, heads of another width, a shared expert not a multiple of an expert's width.
    """
    arch = hf.get("model_type")
    if arch not in CLASSES:
        raise InteropError(f"{source}: model_type = {arch!r}, an architecture island_jax does not import; it reads "
                           f"{ARCHITECTURES} (docs/interop.md)")
    d, heads = _get(hf, "hidden_size", source), _get(hf, "num_attention_heads", source)
    # required even where transformers has a default: each architecture's defaults differ from island_jax's
    kv, eps = _get(hf, "num_key_value_heads", source), _get(hf, "rms_norm_eps", source)
    _refuse_unless(d % heads == 0, source, "hidden_size", d, f"a multiple of num_attention_heads = {heads}")
    _refuse_unless(heads % kv == 0, source, "num_key_value_heads", kv, f"a divisor of num_attention_heads = {heads}")
    _refuse_unless(hf.get("hidden_act", "silu") == "silu", source, "hidden_act", hf.get("hidden_act"), "SwiGLU: silu")
    _refuse_unless(not hf.get("tie_word_embeddings", False), source, "tie_word_embeddings", True, "an untied head")
    if arch == "qwen2_moe":  # its q, k and v projections have biases unless the config says otherwise
        _refuse_unless(hf.get("qkv_bias", True) is False, source, "qkv_bias", hf.get("qkv_bias", True), "no biases")
    _refuse_unless(not hf.get("attention_bias", False), source, "attention_bias", True, "no biases")
    _refuse_unless(not (hf.get("use_sliding_window") or (arch == "mixtral" and hf.get("sliding_window"))), source,
                   "sliding_window", hf.get("sliding_window"), "full causal attention")
    _refuse_unless(not hf.get("mlp_only_layers"), source, "mlp_only_layers", hf.get("mlp_only_layers"),
                   "dense blocks only every decoder_sparse_step-th")
    _refuse_unless(hf.get("head_dim") in (None, d // heads), source, "head_dim", hf.get("head_dim"),
                   f"heads of width hidden_size / num_attention_heads = {d // heads}")
    for key in ("rope_parameters", "rope_scaling"):  # the newer form and the older one, each checked
        rope = hf.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        _refuse_unless(kind == "default", source, f"{key}.rope_type", kind, "unscaled rotary positions")
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise InteropError(f"{source} has no rope_parameters.rope_theta (nor rope_theta); it is not a complete "
                           f"{arch} config")
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    _refuse_unless(dtype in ("float32", "bfloat16"), source, "dtype", dtype,
                   "float32 or bfloat16 parameters: save the model in one of them")
    k = _get(hf, "num_experts_per_tok", source)
    fields = {
        "model.vocab_size": _get(hf, "vocab_size", source), "model.d_model": d,
        "model.num_layers": _get(hf, "num_hidden_layers", source), "model.num_heads": heads,
        "model.num_kv_heads": 0 if kv == heads else kv, "model.positions": "rope", "model.rope_theta": float(theta),
        "model.qk_norm": arch == "qwen3_moe", "model.norm_eps": float(eps),
        "model.param_dtype": dtype, "moe.num_experts_per_token": k, "moe.routing_bias_update_rate": 0.0,
    }
    if arch == "mixtral":
        experts = _get(hf, "num_local_experts", source)
        _refuse_unless(1 <= k <= experts, source, "num_experts_per_tok", k, f"1 to num_local_experts = {experts}")
        fields.update({"moe.num_experts": experts,
                       "moe.expert_hidden_dim": _get(hf, "intermediate_size", source), "moe.renormalize": True,
                       "moe.every_n_layers": 1, "moe.num_shared_experts": 0, "moe.shared_expert_gate": False})
        return fields
    f = _get(hf, "moe_intermediate_size", source)
    step = hf.get("decoder_sparse_step", 1)
    experts = _get(hf, "num_local_experts" if "num_local_experts" in hf else "num_experts", source)  # qwen3: the former
    _refuse_unless(1 <= k <= experts, source, "num_experts_per_tok", k, f"1 to the experts' count {experts}")
    fields.update({"moe.num_experts": experts, "moe.expert_hidden_dim": f,
                   "moe.renormalize": bool(hf.get("norm_topk_prob", False)), "moe.every_n_layers": step})
    if step > 1:
        fields["model.mlp_hidden_dim"] = _get(hf, "intermediate_size", source)
    shared = hf.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    _refuse_unless(shared % f == 0 and (shared > 0 or arch != "qwen2_moe"), source, "shared_expert_intermediate_size",
                   shared, f"a positive multiple of moe_intermediate_size = {f}")
    fields.update({"moe.num_shared_experts": shared // f, "moe.shared_expert_gate": arch == "qwen2_moe"})
    return fields


def read_hf_config(folder: str) -> dict:
    """The transformers config.json of the checkpoint in `folder`.

    Raises:
      InteropError: `folder` has no config.json, or one that is not JSON.
    """
    path = os.path.join(folder, HF_CONFIG_FILE)
    if not os.path.exists(path):
        raise InteropError(f"{path} does not exist: give the folder of a transformers checkpoint (its config.json "
                           "and model.safetensors)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InteropError(f"{path} cannot be read as JSON ({e})") from e


def checkpoint_fields(folder: str) -> dict:
    """`island_fields` of the transformers checkpoint in `folder` (its config.json, `read_hf_config`)."""
    return island_fields(read_hf_config(folder), os.path.join(folder, HF_CONFIG_FILE))


def _set(config: ml_collections.ConfigDict, dotted: str, value) -> None:
    section, field = dotted.split(".")
    config[section][field] = value


def apply(config: ml_collections.ConfigDict, folder: str) -> ml_collections.ConfigDict:
    """`config` (changed in place, and returned) to start from the transformers checkpoint in `folder`:
    `model.init_from` = `folder` and every field `island_fields` reads from its config.json. The rest (islands,
    data, seq_len, optimizers) stays `config`'s.

    Raises:
      InteropError: as `read_hf_config` and `island_fields`.
    """
    for dotted, value in checkpoint_fields(folder).items():
        _set(config, dotted, value)
    config.model.init_from = folder
    return config


def check_init_from(config: ml_collections.ConfigDict) -> None:
    """With `model.init_from`, the model `config` describes is the checkpoint's.

    Raises:
      InteropError: its config.json is missing or unsupported (`island_fields`), or a field differs from the
        checkpoint's, named with both values (`apply` sets them all; `model.param_dtype` may differ: the tensors
        are cast to it).
    """
    folder = config.model.get("init_from", "")
    if not folder:
        return
    heads = config.model.num_heads
    for dotted, value in checkpoint_fields(folder).items():
        if dotted == "model.param_dtype":  # the tensors are cast to the config's dtype
            continue
        section, field = dotted.split(".")
        have = config[section].get(field)
        if dotted == "model.num_kv_heads":  # 0 and num_heads are one setting
            have, value = have or heads, value or heads
        if have != value:
            raise InteropError(f"model.init_from is {folder}, whose model has {dotted} = {value!r}, but the config has "
                               f"{have!r}; start the config with island_jax.config.hf.apply(config, folder) (or "
                               f"--config=experiments/configs/from_hf.py:{folder}), which sets every such field")
