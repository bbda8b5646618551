"""island_jax's parameters as a transformers checkpoint's tensors and back (`config.hf` picks the architecture).

Every tensor is a parameter of `init_params`' per-layer form, transposed where transformers stores a Linear's
weight [out, in] and island_jax a kernel [in, out], and cut where island_jax fuses:

  model.embed_tokens.weight [V, D]      = embedding             lm_head.weight [V, D] = head.kernel^T
  model.norm.weight [D]                 = final_norm.scale
  layers.i.input_layernorm.weight       = blocks.i.attn_norm.scale; post_attention_layernorm: ffn_norm.scale
  layers.i.self_attn.{q,k,v}_proj.weight [H Dh | K Dh, D] = columns [0, H Dh), [H Dh, (H+K) Dh), [(H+K) Dh, ..)
                                          of blocks.i.attn.qkv.kernel, transposed; o_proj = attn.out.kernel^T
  layers.i.self_attn.{q,k}_norm.weight  = attn.{q,k}_norm.scale (qwen3_moe)
  layers.i.MOE.gate.weight [E, D]       = moe.router^T (MOE: block_sparse_moe for mixtral, mlp for qwen)
  layers.i.MOE.experts.e.GATE.weight    = moe.w_gate[e]^T [F, D], UP = moe.w_up[e]^T, DOWN = moe.w_down[e]^T [D, F]
                                          (mixtral: w1, w3, w2; qwen: gate_proj, up_proj, down_proj)
  layers.i.mlp.shared_expert.*_proj, shared_expert_gate.weight [1, D] (qwen2_moe); layers.i.mlp.*_proj (dense)

the names transformers' own `save_pretrained` writes (per expert: transformers 5 fuses them into gate_up_proj
[E, 2F, D] and down_proj [E, D, F] only in memory). Conversions are transposes and slices: exact, both ways.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import ml_collections
import numpy as np

from island_jax.config.hf import InteropError
from island_jax.model import stacking

_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
_SWIGLU = ("w_gate", "w_up", "w_down")


def _moe_prefix(arch: str, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}"


def _dense(prefix: str, mlp: dict) -> dict:
    return {f"{prefix}.{name}.weight": mlp[w].T for name, w in zip(("gate_proj", "up_proj", "down_proj"), _SWIGLU)}


def to_tensors(config: ml_collections.ConfigDict, params: dict, arch: str, copy: bool = True) -> dict[str, np.ndarray]:
    """The transformers tensors (name -> C-contiguous array in the parameter's dtype; views of `params` without
    `copy`) of `params` (`init_params`' pure dict, either layout) as architecture `arch`
    (`config.hf.architecture(config)`)."""
    p = stacking.unstack(params)
    m = config.model
    h, kv = m.num_heads, m.get("num_kv_heads", 0) or m.num_heads
    dh = m.d_model // h
    out = {"model.embed_tokens.weight": p["embedding"], "lm_head.weight": p["head"]["kernel"].T,
           "model.norm.weight": p["final_norm"]["scale"]}
    for i in range(m.num_layers):
        block, pre = p["blocks"][i], f"model.layers.{i}"
        qkv = block["attn"]["qkv"]["kernel"]
        out.update({f"{pre}.input_layernorm.weight": block["attn_norm"]["scale"],
                    f"{pre}.post_attention_layernorm.weight": block["ffn_norm"]["scale"],
                    f"{pre}.self_attn.q_proj.weight": qkv[:, : h * dh].T,
                    f"{pre}.self_attn.k_proj.weight": qkv[:, h * dh: (h + kv) * dh].T,
                    f"{pre}.self_attn.v_proj.weight": qkv[:, (h + kv) * dh:].T,
                    f"{pre}.self_attn.o_proj.weight": block["attn"]["out"]["kernel"].T})
        if "q_norm" in block["attn"]:
            out[f"{pre}.self_attn.q_norm.weight"] = block["attn"]["q_norm"]["scale"]
            out[f"{pre}.self_attn.k_norm.weight"] = block["attn"]["k_norm"]["scale"]
        if "moe" not in block:
            out.update(_dense(f"{pre}.mlp", block["mlp"]))
            continue
        moe, mp = block["moe"], _moe_prefix(arch, i)
        out[f"{mp}.gate.weight"] = moe["router"].T
        for e in range(moe["router"].shape[1]):
            out.update({f"{mp}.experts.{e}.{name}.weight": moe[w][e].T for name, w in zip(_EXPERT_NAMES[arch], _SWIGLU)})
        if "shared_experts" in moe:
            out.update(_dense(f"{mp}.shared_expert", moe["shared_experts"]))
            out[f"{mp}.shared_expert_gate.weight"] = moe["shared_expert_gate"].T
    return {name: np.ascontiguousarray(value) if copy else value for name, value in out.items()}


def check_shapes(config: ml_collections.ConfigDict, like: dict, arch: str, held: dict[str, tuple], source: str) -> None:
    """Refuses a checkpoint whose tensors (`held`: name -> shape, as its safetensors headers say) are not those
    `to_tensors` writes for the model of `config` (`like`: `init_params`' leaves or their shapes, either
    layout), from the headers alone, before `from_tensors` reads them.

    Raises:
      InteropError: a missing tensor, one of another shape, or tensors the model has no place for (named).
    """
    import jax

    zeros = jax.tree.map(lambda leaf: np.broadcast_to(np.zeros((), np.float32), leaf.shape), unstack_shapes(like))
    expected = {name: tuple(v.shape) for name, v in to_tensors(config, zeros, arch, copy=False).items()}  # views
    for name, shape in expected.items():
        if name not in held:
            raise InteropError(f"{source} has no tensor {name} {list(shape)}, which {arch} needs here")
        if tuple(held[name]) != shape:
            raise InteropError(f"{source} holds {name} as {list(held[name])}, but the model of its config.json needs "
                               f"{list(shape)}")
    extra = sorted(set(held) - set(expected))
    if extra:
        raise InteropError(f"{source} holds tensors island_jax's model has no place for: {', '.join(extra[:5])}"
                           f"{' ...' if len(extra) > 5 else ''} ({len(extra)} in all)")


def unstack_shapes(like: dict) -> dict:
    """`stacking.unstack` of parameters or of their `jax.ShapeDtypeStruct`s (`init.abstract_params`): the per-layer
    form, each stacked leaf's slice a struct of the shape without the leading axis."""
    import jax

    def take(leaf, u):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf[u]

    return stacking.unstack(like, take)


def from_tensors(config: ml_collections.ConfigDict, like: dict, arch: str, get: Callable[[str], np.ndarray]) -> dict:
    """The parameters (`init_params`' per-layer pure dict, in the dtypes of `like`) held by a transformers
    checkpoint of architecture `arch` whose tensor `name` is `get(name)`: `to_tensors` undone. The checkpoint's
    names and shapes are `check_shapes`' to refuse, before it is read.

    Args:
      config: the model's config (`config.hf.island_fields` applied).
      like: `init_params(config)`'s parameters or their shapes in the per-layer form (`unstack_shapes`).
    """
    def take(name: str, leaf, transpose: bool = True) -> np.ndarray:
        value = np.asarray(get(name))
        return np.ascontiguousarray((value.T if transpose else value).astype(leaf.dtype))

    def dense(prefix: str, like_mlp: dict) -> dict:
        return {w: take(f"{prefix}.{name}.weight", like_mlp[w])
                for name, w in zip(("gate_proj", "up_proj", "down_proj"), _SWIGLU)}

    out = {"embedding": take("model.embed_tokens.weight", like["embedding"], transpose=False),
           "head": {"kernel": take("lm_head.weight", like["head"]["kernel"])},
           "final_norm": {"scale": take("model.norm.weight", like["final_norm"]["scale"], transpose=False)},
           "blocks": {}}
    for i in range(config.model.num_layers):
        lb, pre = like["blocks"][i], f"model.layers.{i}"
        qkv = lb["attn"]["qkv"]["kernel"]
        parts = [take(f"{pre}.self_attn.{x}_proj.weight", qkv) for x in "qkv"]  # [D, H Dh], [D, K Dh], [D, K Dh]
        attn = {"qkv": {"kernel": np.concatenate(parts, axis=1)},
                "out": {"kernel": take(f"{pre}.self_attn.o_proj.weight", lb["attn"]["out"]["kernel"])}}
        for norm in ("q_norm", "k_norm"):
            if norm in lb["attn"]:
                attn[norm] = {"scale": take(f"{pre}.self_attn.{norm}.weight", lb["attn"][norm]["scale"], False)}
        block = {"attn_norm": {"scale": take(f"{pre}.input_layernorm.weight", lb["attn_norm"]["scale"], False)},
                 "ffn_norm": {"scale": take(f"{pre}.post_attention_layernorm.weight", lb["ffn_norm"]["scale"], False)},
                 "attn": attn}
        if "moe" not in lb:
            block["mlp"] = dense(f"{pre}.mlp", lb["mlp"])
        else:
            lm, mp = lb["moe"], _moe_prefix(arch, i)
            moe = {"router": take(f"{mp}.gate.weight", lm["router"])}
            for name, w in zip(_EXPERT_NAMES[arch], _SWIGLU):
                moe[w] = np.stack([take(f"{mp}.experts.{e}.{name}.weight", lm[w]) for e in range(lm[w].shape[0])])
            if "shared_experts" in lm:
                moe["shared_experts"] = dense(f"{mp}.shared_expert", lm["shared_experts"])
                moe["shared_expert_gate"] = take(f"{mp}.shared_expert_gate.weight", lm["shared_expert_gate"])
            block["moe"] = moe
        out["blocks"][i] = block
    return out


WEIGHTS_FILE = "model.safetensors"  # one file; past `max_shard_size`, model-0000k-of-0000n.safetensors and:
INDEX_FILE = "model.safetensors.index.json"  # {"metadata": {"total_size"}, "weight_map": {tensor: file}}


def write_weights(folder: str, tensors: dict[str, np.ndarray], max_shard_size: int | str = "5GB",
                  metadata: dict | None = None) -> list[str]:
    """Writes `tensors` as transformers does: `model.safetensors`, or shards of at most `max_shard_size` (bytes, or
    "5GB"; a larger tensor alone in its shard) named by huggingface_hub's pattern with `model.safetensors.index.json`.
    Each file's header holds {"format": "pt"} and `metadata` (str -> str). Weights files already in `folder`
    (model*.safetensors, the index) are removed first, as transformers' `save_pretrained` does. Returns the files
    written, in order."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    split = split_state_dict_into_shards_factory(tensors, get_storage_size=lambda a: a.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=max_shard_size)
    header = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    for stale in _weight_files(folder):  # an earlier export's weights, which a reader could take for these
        os.remove(os.path.join(folder, stale))
    written = []
    for name, keys in split.filename_to_tensors.items():
        path = os.path.join(folder, name)
        save_file({k: tensors[k] for k in keys}, path, metadata=header)
        written.append(path)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return written


def _weight_files(folder: str) -> list[str]:

    if not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f == INDEX_FILE or (f.startswith("model") and f.endswith(".safetensors")))


def read_weights(folder: str):
    """(get, names, source): the tensors of the transformers checkpoint in `folder` (one `model.safetensors`, or
    the shards its index names), `get(name)` reading one as a NumPy array (None: absent); `model.safetensors` first where both are there, as
    transformers reads them.

    Raises:
      InteropError: neither file exists, an unreadable file or index, or an index naming a shard that is not there.
    """

    from safetensors import safe_open

    index, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, WEIGHTS_FILE)
    try:
        if os.path.exists(single):  # transformers' own order: the single file first, then the index
            with safe_open(single, framework="numpy") as f:
                where = {name: WEIGHTS_FILE for name in f.keys()}
            source = single
        elif os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                where = json.load(f)["weight_map"]
            source = index
        else:
            raise InteropError(f"{folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}: it is not a transformers "
                               "checkpoint in safetensors (save it with save_pretrained)")
    except (OSError, ValueError, KeyError, TypeError) as e:  # safetensors' errors are OSError or ValueError kinds
        raise InteropError(f"the weights of {folder} cannot be read ({type(e).__name__}: {e}); write them again "
                           "with save_pretrained") from e
    for file in sorted(set(where.values())):
        if not os.path.exists(os.path.join(folder, file)):
            raise InteropError(f"{source} names {file}, which is not in {folder}")
    opened: dict = {}

    def get(name: str):
        if name not in where:
            return None
        if where[name] not in opened:  # one handle per file (a large model has thousands of tensors)
            opened[where[name]] = safe_open(os.path.join(folder, where[name]), framework="numpy")
        return opened[where[name]].get_tensor(name)

    return get, set(where), source


def held_shapes(folder: str) -> tuple[dict[str, tuple], str]:
    """(name -> shape of every tensor, the checkpoint's file or index) of the transformers checkpoint in `folder`,
    from its safetensors headers alone (nothing read).

    Raises:
      InteropError: as `read_weights`.
    """

    from safetensors import safe_open

    _, names, source = read_weights(folder)
    files: dict[str, list[str]] = {}
    if source.endswith(INDEX_FILE):
        with open(source, encoding="utf-8") as f:
            for name, file in json.load(f)["weight_map"].items():
                files.setdefault(file, []).append(name)
    else:
        files[WEIGHTS_FILE] = sorted(names)
    shapes = {}
    for file, held in files.items():
        with safe_open(os.path.join(folder, file), framework="numpy") as f:
            inside = set(f.keys())
            for name in held:
                if name not in inside:
                    raise InteropError(f"{source} puts {name} in {file}, which does not hold it; write the "
                                       "checkpoint again with save_pretrained")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes, source
