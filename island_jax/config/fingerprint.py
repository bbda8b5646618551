"""What roles must share and what a resumed role may change: the fingerprint and the resume policy.

`fingerprint_fields` is what an island's join carries and the coordinator compares (`fingerprint_differences`
names the fields that differ). `config_changes` and `refuse_config_changes` compare a role's recorded
`config.json` with the config it would resume under (`RESUME_MAY_CHANGE` may change freely), and `read_json`
rebuilds a recorded `config.json` into the ConfigDict it was written from, with the schema's types.
"""

from __future__ import annotations

import fnmatch
import json

import ml_collections

from island_jax.config.mixture import sharing
from island_jax.config.schema import ConfigError, default_config, flat_fields, island, update_kind


def fingerprint_fields(config: ml_collections.ConfigDict) -> dict:
    """What islands and coordinator must share, as {dotted field name: value}.

    Covers the model and MoE shapes, the codecs both ways and their sizes, the held-out
    share of the corpus and the seed; not island sizes, batch sizes or learning
    rates or `model.remat`, which may differ per island, nor `data.files`, whose path may differ
    per host (an island's join carries its corpus's fingerprint, checked
    against the first island's: `coordinator.handshake.check_corpus`).
    """
    # model.remat changes what is recomputed, not the model: an island in a process of its own may differ
    fields = {f"model.{k}": v for k, v in config.model.items() if k != "remat"}
    shapes = ("num_experts", "num_experts_per_token", "expert_hidden_dim", "num_shared_experts", "every_n_layers")
    fields.update({f"moe.{k}": config.moe[k] for k in shapes})
    fields["moe.routing_bias"] = config.moe.routing_bias_update_rate > 0
    fields.update({f"codec.{k}": v for k, v in config.codec.items()})
    fields["codec.update_kind"] = update_kind(config.codec)  # "" and codec.kind's name are the same codec
    fields["comm.chunk_bytes"] = config.comm.chunk_bytes  # the payload's piece layout depends on it
    fields["outer.fragments"] = config.outer.fragments  # the payloads are per fragment
    fields["data.eval_fraction"] = config.data.eval_fraction  # the split of the corpus (an island sends its corpus)
    # who reads which prepared records: islands that spread them otherwise would train on overlapping records
    if config.data.get("prepared", ""):
        fields["data.sharing"] = sharing(config, list(config.islands.keys()))
    fields["seed"] = config.seed
    shards = config.coordinator.shards if "coordinator" in config else 1
    if shards > 1:  # which shard owns which chunks (a single coordinator's fingerprint is as it was)
        fields["coordinator.shards"] = shards
    return fields


def fingerprint_differences(mine: dict, theirs: dict) -> list[str]:
    """Fields in which two `fingerprint_fields` differ, as "field (theirs X, here Y)"."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k} (theirs {theirs.get(k)!r}, here {mine.get(k)!r})" for k in keys if mine.get(k) != theirs.get(k)]


# Fields a resumed role may find changed in its config without `--allow_config_change` (`config_changes`):
# fault injection, the run extended by more rounds (never fewer), and where credentials are read from.
RESUME_MAY_CHANGE = ("islands.*.crash_at_round", "outer.rounds", "comm.tls.*", "comm.auth.*", "metrics.*")
# Fields a resumed role never finds changed, not even with `--allow_config_change`: its checkpoints hold the
# parameters (and their optimizer state) in the layout the field chose.
RESUME_NEVER_CHANGES = ("model.scan_layers",)


class ConfigChangeError(ConfigError):
    """A role would resume under another config than the one its folder was started with.

    Attributes:
      changes: `config_changes`'s list.
    """

    def __init__(self, message: str, changes: list[tuple[str, object, object]]):
        super().__init__(message)
        self.changes = changes


_MISSING = object()  # not a field of the defaults


def _may_change(path: str, started, now) -> bool:
    if path == "outer.rounds":
        return isinstance(started, int) and isinstance(now, int) and now >= started
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in RESUME_MAY_CHANGE if pattern != "outer.rounds")


def config_changes(
    started: dict, config: ml_collections.ConfigDict, allowed: bool = False
) -> list[tuple[str, object, object]]:
    """The fields in which `config` differs from the config a role started with, leaving out `RESUME_MAY_CHANGE`
    (unless `allowed`: then every field that differs).

    Args:
      started: the role's `config.json`, as parsed JSON.
      config: the config it would resume under.
      allowed: also list the fields of `RESUME_MAY_CHANGE` that differ.

    Returns:
      [(dotted field, the value it started with, the value now)], sorted by field; a field only one side has
      shows None on the other.
    """
    old, new = flat_fields(started), flat_fields(json.loads(config.to_json_best_effort()))
    # A field the role's config.json lacks (it was written before the field existed) is unchanged while the
    # config holds its default: runs started by an earlier version resume.
    defaults = flat_fields(json.loads(default_config().to_json_best_effort()))
    island_defaults = flat_fields(json.loads(ml_collections.ConfigDict(island(1, 1, 1, 1, 1)).to_json_best_effort()))
    for k in set(new) - set(old):
        parts = k.split(".")
        default = island_defaults.get(".".join(parts[2:]), _MISSING) if parts[0] == "islands" else defaults.get(
            k, _MISSING)
        if default == new[k]:
            old[k] = default
    return [
        (k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and (allowed or not _may_change(k, old.get(k), new.get(k)))
    ]


def refuse_config_changes(folder: str, started: dict, config: ml_collections.ConfigDict,
                          allow_config_change: bool = False) -> None:
    """Refuses to resume the role in `folder` under a config other than the one it `started` with.

    A change of `RESUME_NEVER_CHANGES` (`model.scan_layers`: the parameters' layout in the checkpoints) is
    refused even when `allow_config_change`; any other change only without it.

    Raises:
      ConfigChangeError: `config_changes` is not empty; the message lists every field with both values and
        says what to do. For `model.scan_layers`, it says that the run resumes under the layout it started with.
    """
    layout = [c for c in config_changes(started, config, allowed=True) if c[0] in RESUME_NEVER_CHANGES]
    if layout:
        (_, before, now), = layout
        before = bool(before)  # None: a config.json written before the field, whose blocks were unrolled
        held = "stacked on a leading layers axis" if before else "one block at a time (blocks.{i})"
        raise ConfigChangeError(
            f"{folder} was started with model.scan_layers={before} but would resume with model.scan_layers="
            f"{bool(now)}: the parameters' layout differs (its checkpoints hold them {held}), and a run resumes "
            f"under the layout it started with, --allow_config_change or not. Resume with model.scan_layers="
            f"{before}, or pass a new --workdir (its export, python -m island_jax.export, loads into either layout)",
            layout,
        )
    changes = [] if allow_config_change else config_changes(started, config)
    if changes:
        listed = ", ".join(f"{k} (started with {a!r}, now {b!r})" for k, a, b in changes)
        raise ConfigChangeError(
            f"{folder} was started with another config: {listed}. Resume with the config it started with (its "
            "config.json), pass a new --workdir, or pass --allow_config_change to go on under this one and record "
            "the change",
            changes,
        )


def _typed_from_json(value, template):
    """`value` (parsed JSON) as the ConfigDict field it was written from, with `template`'s types where JSON
    loses them: a tuple (JSON writes a list) and a `FieldReference` of a declared type (`outer.overlap_steps`,
    of `object`); nested dicts become ConfigDicts. A field the template lacks keeps its JSON type."""
    if isinstance(template, ml_collections.FieldReference):
        return ml_collections.FieldReference(value, field_type=template.get_type())
    if isinstance(value, dict):
        fields = template._fields if isinstance(template, ml_collections.ConfigDict) else {}
        return ml_collections.ConfigDict({k: _typed_from_json(v, fields.get(k)) for k, v in value.items()})
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def read_json(path: str) -> ml_collections.ConfigDict:
    """The `ml_collections.ConfigDict` a role's `config.json` at `path` was written from
    (`ConfigDict.to_json_best_effort`), rebuilt field by field with the types of `config.default_config()`
    (and of `config.island` under `islands`), so that it equals the config the run started with and its
    overrides parse as that config's would.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not a JSON object (`json.JSONDecodeError` for text that is not JSON).
    """
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds no recorded config (a JSON object): it holds a {type(raw).__name__}")
    template = default_config()
    islands = raw.get("islands")
    if isinstance(islands, dict):  # every island from the one template
        one = island(1, 1, 1, 1, 1)
        template.islands = ml_collections.ConfigDict({name: one for name in islands})
    return _typed_from_json(raw, template)
