"""The global parameters of a run, from its workdir or from an export, as the pure dict `init_params` makes.

`from_workdir(workdir, round)` reads a finished or running run's checkpoint:
the evaluating island's `anchor` (the global parameters after that round;
with no outer loop, the island's own `params`), as orbax wrote it, with no
optimizer built. `save(folder, config, params)` writes an export,
`model.safetensors` (one tensor per parameter, named by its path, e.g.
`blocks.0.attn.qkv.kernel`) beside `config.json` (the run's config), and
`from_export(folder)` reads it back, checked against the model its config
builds. Both return exactly the arrays saved: logits computed from them are
the checkpoint's, bit for bit.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from island_jax.config import evaluating_island, read_json
from island_jax.data.records import TOKENIZER_FILE
from island_jax.model import stacking

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class LoadError(ValueError):
    """Parameters cannot be read into the model their config describes; the message says which and why."""


def _paths(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, np.ndarray]]:
    out = []
    for key in sorted(tree, key=lambda k: (isinstance(k, str), k)):
        value = tree[key]
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _name(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _fill(like: dict, lookup, source: str) -> dict:
    """A copy of `like` (`init_params`' pure dict) with each leaf replaced by `lookup(name)` (an array or None),
    checked against the leaf's shape and dtype.

    Raises:
      LoadError: a parameter `source` lacks, or holds with another shape or dtype.
    """
    def walk(tree, prefix):
        out = {}
        for key, value in tree.items():
            path = (*prefix, key)
            if isinstance(value, dict):
                out[key] = walk(value, path)
                continue
            found = lookup(_name(path))
            if found is None:
                raise LoadError(f"{source} has no parameter {_name(path)} ({value.dtype}{list(value.shape)}); it was "
                                "written for another model config")
            found = np.asarray(found)
            if found.shape != value.shape or found.dtype != value.dtype:
                raise LoadError(
                    f"{source} holds {_name(path)} as {found.dtype}{list(found.shape)} but the model of its config "
                    f"has {value.dtype}{list(value.shape)}; the file was written for another model config"
                )
            out[key] = found
        return out

    return walk(like, ())


def _template(config: ml_collections.ConfigDict):
    from island_jax.model.init import init_params

    return init_params(config)


def read_config(path: str) -> ml_collections.ConfigDict:
    """A `config.json` a role or an export wrote, as the ConfigDict it was written from (`config.read_json`)."""
    return read_json(path)


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config of the run in `workdir`: the `config.json` of its first island folder that has one.

    Raises:
      FileNotFoundError: `workdir` holds no island folder with a config.json.
    """
    islands = os.path.join(workdir, "islands")
    names = sorted(os.listdir(islands)) if os.path.isdir(islands) else []
    found = [n for n in names if os.path.exists(os.path.join(islands, n, CONFIG_FILE))]
    if not found:
        raise FileNotFoundError(f"{workdir} holds no island's config.json: it is not a run's workdir (or no island "
                                "has started yet)")
    return read_config(os.path.join(islands, found[0], CONFIG_FILE))


def from_workdir(workdir: str, round: int | None = None) -> tuple[ml_collections.ConfigDict, dict, int]:
    """The global parameters of the run in `workdir` after `round` rounds (None: its newest checkpoint).

    Args:
      workdir: a finished or running run's folder (`island_jax.workdir`).
      round: completed rounds of a kept checkpoint of the run's first island (the evaluating one).

    Returns:
      (the run's config, its first island's `config.json`; the parameters, `init_params`' pure dict of NumPy
      arrays in their dtypes; the round).

    Raises:
      FileNotFoundError: `workdir` holds no island folder with a config.json.
      LoadError: no checkpoint (of `round`), one that does not fit the config's model, or one whose parameters
        read other bits than their saved checksums (`checkpoint.verify_leaves`; the leaf is named).
    """
    import orbax.checkpoint as ocp

    from island_jax.checkpoint import LEAVES, CheckpointCorrupt, verify_leaves

    config = run_config(workdir)
    folder = os.path.join(workdir, "islands", evaluating_island(config), "checkpoints")
    if not os.path.isdir(folder):
        raise LoadError(f"{folder} does not exist: the run's evaluating island has saved no checkpoint yet")
    # read only: nothing is created or changed in a run's folder, which may be running
    manager = ocp.CheckpointManager(os.path.abspath(folder),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        rounds = sorted(manager.all_steps())
        if not rounds:
            raise LoadError(f"{folder} holds no complete checkpoint yet; wait for the run's first save")
        if round is not None and round not in rounds:
            raise LoadError(f"{folder} holds no checkpoint of round {round}; it keeps rounds {rounds}")
        round = rounds[-1] if round is None else round
        state = manager.restore(round, args=ocp.args.StandardRestore())
        recorded = (manager.metadata(round).custom_metadata or {}).get(LEAVES)
    finally:
        manager.close()
    key = "anchor" if config.outer.enabled else "params"
    saved = state[key]
    if recorded is not None:  # a checkpoint written with its checksums: the parameters read are checked
        try:
            verify_leaves({key: saved}, recorded, f"the checkpoint of round {round} in {os.path.join(folder, str(round))}")
        except CheckpointCorrupt as e:
            older = [r for r in rounds if r < round]
            raise LoadError(f"{e}; {f'pass --round={older[-1]} (an older checkpoint)' if older else 'no older one is kept'}"
                            ", or let the run resume (it falls back to its newest intact checkpoint)") from e
    flat = {_name(path): value for path, value in _paths(saved)}
    _, like, _ = _template(config)
    return config, _fill(like, flat.get, f"the checkpoint of round {round} in {folder}"), round


def save(folder: str, config: ml_collections.ConfigDict, params: dict, metadata: dict | None = None) -> str:
    """Writes an export: `folder/model.safetensors` (every parameter of `params` in the per-layer form, named by
    its path: `blocks.{i}....`, the stacked form's leaves written slice by slice, `stacking.unstack`) and
    `folder/config.json` (`config`); returns the weights' path. `metadata` (str -> str) goes into the
    safetensors header."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {_name(path): np.ascontiguousarray(value) for path, value in _paths(stacking.unstack(params))}
    weights = os.path.join(folder, WEIGHTS_FILE)
    save_file(tensors, weights, metadata={k: str(v) for k, v in (metadata or {}).items()})
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    return weights


def from_export(folder: str, scan_layers: bool | None = None) -> tuple[ml_collections.ConfigDict, dict]:
    """Reads an export (`save`): (its config, the parameters as `init_params`' pure dict of NumPy arrays).

    Args:
      folder: the export's folder.
      scan_layers: the layout to load into (`model.scan_layers`, set so in the config returned); None: the
        export's config's. The file's per-layer tensors are stacked for a scanned model (`stacking.to_layout`).

    Raises:
      FileNotFoundError: `folder` lacks model.safetensors or config.json.
      LoadError: a parameter the config's model has is missing from the file, or has another shape or dtype
        (a file written for another model config), named with both shapes.
    """
    from safetensors.numpy import load_file

    weights = os.path.join(folder, WEIGHTS_FILE)
    for path in (weights, os.path.join(folder, CONFIG_FILE)):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing; an export holds {WEIGHTS_FILE} and {CONFIG_FILE} "
                                    "(python -m island_jax.export)")
    config = read_config(os.path.join(folder, CONFIG_FILE))
    tensors = load_file(weights)
    _, like, _ = _template(config)
    like = stacking.unstack(like)  # the file's form
    params = _fill(like, tensors.get, weights)
    extra = sorted(set(tensors) - {_name(p) for p, _ in _paths(like)})
    if extra:
        raise LoadError(f"{weights} holds parameters the model of its config does not have ({', '.join(extra[:5])}); "
                        "it was written for another model config")
    if scan_layers is not None:
        config.model.scan_layers = bool(scan_layers)
    return config, stacking.to_layout(params, config.model.get("scan_layers", False), config.moe.every_n_layers)


HF_ISLAND_CONFIG_FILE = "island_jax_config.json"  # an HF export's island_jax config, beside transformers' config.json
HF_TOKENIZER_FILE = TOKENIZER_FILE  # the file name both tokenizers and transformers read
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def save_hf(folder: str, config: ml_collections.ConfigDict, params: dict, tokenizer: dict, architecture: str = "",
            max_shard_size: int | str = "5GB", metadata: dict | None = None) -> dict:
    """Writes a transformers checkpoint of `params` (`init_params`' pure dict, either layout) in `folder`:
    config.json (`config.hf.hf_config`), the weights (`model.hf.to_tensors`, `model.hf.write_weights`: sharded
    past `max_shard_size`), tokenizer.json and tokenizer_config.json, and `config` as island_jax_config.json.
    `transformers.AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load
    it with no custom code.

    Args:
      tokenizer: the run's tokenizer record (`sample.tokenizer_record`): bytes get a byte-level tokenizer.json
        (`data.tokenizer.byte_level_json`), a BPE or tokenizer.json kind its own file.
      architecture: one of `config.hf.ARCHITECTURES`; "": the one the model maps onto.

    Returns:
      {"architecture", "files" (the weights' files), "tensors" (their count), "written" (every file written)}.

    Raises:
      InteropError: the model maps onto no architecture (or not `architecture`), naming the field; or its
        tokenizer is a SentencePiece model or a tiktoken encoding, which have no tokenizer.json here. Nothing is
        written then.
    """
    import json
    import shutil

    from island_jax.config.hf import InteropError, hf_config
    from island_jax.config.hf import architecture as choose
    from island_jax.data import tokenizer as tokenizer_lib
    from island_jax.model import hf

    arch = choose(config, architecture)
    kind = tokenizer["kind"]
    if kind not in ("bytes", "bpe", "tokenizer_json"):
        raise InteropError(f"the run's tokenizer is a {kind} file ({tokenizer['path']}); an HF export carries a "
                           "tokenizer.json, which island_jax makes for bytes, bpe and tokenizer_json tokenizers only")
    eos_token = tokenizer["eos_token"] or tokenizer_lib.EOS_TEXT
    if kind != "bytes":
        eos = tokenizer_lib.load(kind, tokenizer["path"], eos_token=eos_token).eos_id
    else:  # the byte corpus has no end-of-document token unless the model's vocabulary holds id 256
        eos = tokenizer_lib.BYTE_EOS if config.model.vocab_size > tokenizer_lib.BYTE_EOS else None
    tensors = hf.to_tensors(config, params, arch)
    os.makedirs(folder, exist_ok=True)
    files = hf.write_weights(folder, tensors, max_shard_size, metadata)
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:  # transformers' config.json
        json.dump(hf_config(config, arch, eos), f, indent=2, sort_keys=True)
    with open(os.path.join(folder, HF_ISLAND_CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    path = os.path.join(folder, HF_TOKENIZER_FILE)
    if kind == "bytes":
        with open(path, "w", encoding="utf-8") as f:
            f.write(tokenizer_lib.byte_level_json(eos is not None))
    else:
        shutil.copyfile(tokenizer["path"], path)
    special = {} if eos is None else {"eos_token": eos_token}
    with open(os.path.join(folder, HF_TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.model.seq_len,
                   "clean_up_tokenization_spaces": False, **special}, f, indent=2)
    index = [os.path.join(folder, hf.INDEX_FILE)] if len(files) > 1 else []
    written = [*files, *index, *(os.path.join(folder, name) for name in (
        CONFIG_FILE, HF_ISLAND_CONFIG_FILE, HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG_FILE))]
    return dict(architecture=arch, files=files, tensors=len(tensors), written=written)


def from_hf(folder: str, config: ml_collections.ConfigDict | None = None) -> tuple[ml_collections.ConfigDict, dict]:
    """Reads a transformers checkpoint of a supported architecture (`config.hf.ARCHITECTURES`; safetensors, one file
    or sharded) into island_jax's config and parameters.

    Args:
      folder: the checkpoint's folder (config.json, model.safetensors or its index and shards).
      config: the config to set the model of (a copy is changed); None: the island_jax_config.json an island_jax
        export holds beside it, else `default_config()`. Its model.* and moe.* fields become the checkpoint's
        (`config.hf.apply`, which also sets model.init_from = `folder`).

    Returns:
      (the config; the parameters, `init_params`' pure dict of NumPy arrays in the config's layout,
      `model.scan_layers`, and its dtypes).

    Raises:
      InteropError: an unsupported architecture or setting (named), a missing tensor, one of another shape, or
        tensors the model has no place for (named).
    """
    from island_jax.config import default_config
    from island_jax.config.hf import apply
    from island_jax.model.init import init_params

    beside = os.path.join(folder, HF_ISLAND_CONFIG_FILE)
    if config is None:
        config = read_config(beside) if os.path.exists(beside) else default_config()
    config = apply(ml_collections.ConfigDict(config.to_dict()), folder)
    _, params, _ = init_params(config)  # model.init_from: the checkpoint's tensors
    return config, params


def check_init_from(config: ml_collections.ConfigDict) -> None:
    """With `model.init_from`, before anything is written or started: the checkpoint holds every tensor of the
    model `config` describes, of its shape, and no other (`model.hf.check_shapes`, from the safetensors headers),
    and the run's data is tokenized as the checkpoint's tokenizer.json says: a byte-level one
    (`data.tokenizer.is_byte_level`) reads the byte corpus (no `data.prepared`); any other, a dataset prepared
    with that file (the same `Tokenizer.hash`).

    Raises:
      InteropError: a missing, misshapen or unplaced tensor (named); no tokenizer.json, or data of another
        tokenizer (the command that prepares the data with it is given).
    """
    from island_jax.config.hf import InteropError, read_hf_config
    from island_jax.data import tokenizer as tokenizer_lib
    from island_jax.data.records import PreparedDataset
    from island_jax.model import hf
    from island_jax.model.init import abstract_params

    folder = config.model.get("init_from", "")
    if not folder:
        return
    held, source = hf.held_shapes(folder)
    hf.check_shapes(config, abstract_params(config)[1], read_hf_config(folder)["model_type"], held, source)
    path, prepared = os.path.join(folder, HF_TOKENIZER_FILE), config.data.get("prepared", "")
    if not os.path.exists(path):
        raise InteropError(f"model.init_from is {folder}, which has no {HF_TOKENIZER_FILE}: the run's data must be "
                           "tokenized by the checkpoint's own tokenizer; put its tokenizer.json beside it")
    prepare = (f"prepare the data with it (python experiments/prepare_data.py --tokenizer=tokenizer_json "
               f"--tokenizer_path={path} --eos_token=TOKEN --input=... --out=DIR) and set data.prepared=DIR")
    if tokenizer_lib.is_byte_level(path):
        if prepared:
            raise InteropError(f"model.init_from is {folder}, whose tokenizer is island_jax's bytes, but data.prepared "
                               f"is {prepared}; leave data.prepared empty to train on the byte corpus")
        return
    if not prepared:
        raise InteropError(f"model.init_from is {folder}, whose tokenizer is {path}, but the data is the byte corpus; "
                           + prepare)
    dataset = PreparedDataset(prepared)
    eos = dataset.manifest["settings"].get("eos_token") or tokenizer_lib.EOS_TEXT
    if tokenizer_lib.load("tokenizer_json", path, eos_token=eos).hash != dataset.manifest["tokenizer"]["hash"]:
        raise InteropError(f"data.prepared ({prepared}) was tokenized by another tokenizer than {path}; " + prepare)
