"""Exports a run's global parameters as safetensors, with the config that builds their model.

  python -m island_jax.export --workdir=DIR [--round=R] --out=DIR [--format=hf [--architecture=mixtral]]

writes OUT/model.safetensors (one tensor per parameter, named by its path, e.g. `blocks.0.moe.w_gate`, in the
parameters' dtypes; one per block whatever `model.scan_layers`) and OUT/config.json (the run's config), from the
checkpoint of round R (default: the newest) of the run's evaluating island (`model.load.from_workdir`). The
safetensors header holds the round, the parameters' `model.init.checksum` (the same for either layout) and the
run's tokenizer (`sample.tokenizer_record`), whose file is copied beside them, so that
`python -m island_jax.sample --export=OUT` needs nothing else, and `island_jax.model.load.from_export(OUT)` reads
it back to the same bits, into either layout. Files get a new file's mode (0666 less the umask).

`--format=hf` writes a Hugging Face transformers checkpoint instead (`model.load.save_hf`: config.json of the
architecture the model maps onto, `config.hf`; model.safetensors, sharded past `--max_shard_size`; tokenizer.json;
island_jax's config as island_jax_config.json), which `transformers.AutoModelForCausalLM.from_pretrained(OUT)`
loads and `island_jax.model.load.from_hf(OUT)` reads back (docs/interop.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

FORMATS = ("island_jax", "hf")


def _umask() -> int:
    """This process's umask (the bits a new file's mode 0666 loses)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def export(workdir: str, out: str, round: int | None = None, format: str = "island_jax", architecture: str = "",
           max_shard_size: int | str = "5GB") -> dict:
    """Writes the export of the run in `workdir` (round `round`, None: the newest) to `out`.

    Args:
      workdir: a finished or running run's folder.
      out: the export's folder (created): `model.safetensors` and `config.json` (`model.load.save`); with
        `format` "hf", a transformers checkpoint (`model.load.save_hf`).
      round: completed rounds of a kept checkpoint of the run's evaluating island; None: the newest.
      format: "island_jax" or "hf".
      architecture, max_shard_size: of an "hf" export (`model.load.save_hf`).

    Returns:
      {"weights": the (first) safetensors path, "round", "checksum" (`model.init.checksum` of the parameters),
      "params" (their count), "tokenizer" (the tokenizer file's path; "" for bytes in island_jax's format)}, and
      "architecture" with "hf".

    Raises:
      FileNotFoundError, model.load.LoadError: as `model.load.from_workdir`.
      sample.SampleError: the run's tokenizer cannot be read, or is not the one it trained with.
      config.hf.InteropError: with "hf", a model no architecture represents (the field named); nothing is written.
      ValueError: an unknown `format`.
    """
    if format not in FORMATS:
        raise ValueError(f"--format={format}: choose one of {FORMATS}")
    from island_jax import sample
    from island_jax.model import load
    from island_jax.model.init import checksum, count

    config, params, round = load.from_workdir(workdir, round)
    record = sample.tokenizer_record(config)
    sample.load_tokenizer(record)  # the file is there and is the run's, before anything is written
    digest = checksum(params)
    if format == "hf":
        done = load.save_hf(out, config, params, record, architecture, max_shard_size,
                            metadata={"round": round, "checksum": digest})
        for path in done["written"]:
            os.chmod(path, 0o666 & ~_umask())
        return dict(weights=done["files"][0], round=round, checksum=digest, params=count(params),
                    tokenizer=os.path.join(out, load.HF_TOKENIZER_FILE), architecture=done["architecture"])
    described = {k: v for k, v in record.items() if k != "path"}  # the file's place is the export's own
    weights = load.save(out, config, params, metadata={"round": round, "checksum": digest, "workdir": workdir,
                                                      sample.EXPORT_TOKENIZER_KEY: json.dumps(described)})
    os.chmod(weights, 0o666 & ~_umask())  # safetensors writes 0600
    copied = ""
    if record["kind"] != "bytes":
        copied = os.path.join(out, sample.EXPORT_TOKENIZER_FILES[record["kind"]])
        shutil.copyfile(record["path"], copied)
    return dict(weights=weights, round=round, checksum=digest, params=count(params), tokenizer=copied)


def _main(argv) -> int:
    from absl import flags

    from island_jax.config.hf import InteropError
    from island_jax.logs import quiet_libraries
    from island_jax.model.load import LoadError
    from island_jax.sample import SampleError

    del argv
    f = flags.FLAGS
    if not f.workdir or not f.out:
        sys.exit("island_jax.export: give --workdir=DIR (a run) and --out=DIR (where the export goes)")
    try:
        with quiet_libraries():
            done = export(f.workdir, f.out, f.round, f.format, f.architecture, f.max_shard_size)
    except (LoadError, FileNotFoundError, SampleError, InteropError) as e:
        sys.exit(f"island_jax.export: {e}")
    print(f"exported round {done['round']} ({done['params']} parameters, checksum {done['checksum']}) to "
          f"{done['weights']}" + (f" as transformers {done['architecture']}" if "architecture" in done else ""))
    return 0


if __name__ == "__main__":
    from absl import app, flags

    from island_jax.cli import parse_flags

    flags.DEFINE_string("workdir", "", "A run's folder (finished or running).")
    flags.DEFINE_integer("round", None, "The checkpoint of this round (default: the newest).")
    flags.DEFINE_string("out", "", "The export's folder (created).")
    flags.DEFINE_enum("format", "island_jax", list(FORMATS), "island_jax's own safetensors, or a transformers checkpoint.")
    flags.DEFINE_string("architecture", "", "With --format=hf: mixtral, qwen2_moe or qwen3_moe ('': the one the model "
                        "maps onto).")
    flags.DEFINE_string("max_shard_size", "5GB", "With --format=hf: the largest weights file, e.g. 5GB or 500MB; "
                        "past it the weights are sharded with an index.")
    app.run(_main, flags_parser=parse_flags)
