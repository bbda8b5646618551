"""The configuration of a run: one `ml_collections.ConfigDict`, nested by concern.

  schema       every field with its default and meaning (`default_config`, `island`), `ConfigError`
  checks       `validate(config)`: everything that can be checked before JAX compiles anything
  fingerprint  what roles must share (`fingerprint_fields`) and what a resumed role may change; `read_json`
  overrides    `load_config(path)`, and fields set by dotted path (`apply_override`, `parse_override`)
  mixture      an island's own data (`parse_mixture`) and who reads which dataset (`sharing`)

Imports no JAX, so a launcher reads and checks a config without it. Nothing here imports `island_jax.data`.
"""

from island_jax.config.checks import validate
from island_jax.config.fingerprint import (
    RESUME_MAY_CHANGE,
    RESUME_NEVER_CHANGES,
    ConfigChangeError,
    config_changes,
    fingerprint_differences,
    fingerprint_fields,
    read_json,
    refuse_config_changes,
)
from island_jax.config.mixture import dataset_key, parse_mixture, sharing
from island_jax.config.overrides import (
    apply_override,
    field_paths,
    load_config,
    parse_override,
    unknown_field,
)
from island_jax.config.schema import (
    AUTO_FROM,
    BYTE_SYMBOLS,
    CODEC_KINDS,
    DISPATCH,
    DTYPES,
    KEEPALIVE_SECONDS,
    MAX_CHUNK_BYTES,
    MAX_CONNECTIONS,
    MIB,
    POSITIONS,
    RECONNECT_BACKOFF_CAP_SECONDS,
    REMAT,
    SYNC,
    WANDB_MODES,
    WEIGHTINGS,
    ConfigError,
    default_config,
    devices_per_process,
    error_feedback,
    evaluating_island,
    island,
    total_devices,
    update_kind,
)

__all__ = [
    "AUTO_FROM", "BYTE_SYMBOLS", "CODEC_KINDS", "DISPATCH", "DTYPES", "KEEPALIVE_SECONDS", "MAX_CHUNK_BYTES",
    "MAX_CONNECTIONS", "MIB", "POSITIONS", "RECONNECT_BACKOFF_CAP_SECONDS", "REMAT", "RESUME_MAY_CHANGE",
    "RESUME_NEVER_CHANGES", "SYNC", "WANDB_MODES", "WEIGHTINGS", "ConfigChangeError", "ConfigError",
    "apply_override", "config_changes", "dataset_key", "default_config", "devices_per_process", "error_feedback",
    "evaluating_island", "field_paths", "fingerprint_differences", "fingerprint_fields", "island", "load_config",
    "parse_mixture", "parse_override", "read_json", "refuse_config_changes", "sharing", "total_devices",
    "unknown_field", "update_kind", "validate",
]
