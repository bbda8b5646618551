"""An island's own data, read from the config alone: `islands.NAME.data` parsed into a mixture of prepared
datasets (`parse_mixture`), and who reads which dataset's training records (`sharing`).

Every dataset's training records are split between the islands that read it: record i to the (i mod n)-th
of those n islands, in config order. The plan joins the fingerprint (`config.fingerprint_fields`), so roles
whose configs spread the data otherwise are refused before they train on overlapping records. Opening the
datasets is `island_jax.data`'s work; nothing here reads a file.
"""

from __future__ import annotations

import os
from typing import Sequence

from island_jax.config.schema import ConfigError


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """`islands.NAME.data`: "PATH" or "PATH,WEIGHT;PATH,WEIGHT;..." -> [(path, weight)], weights as given.

    Raises:
      ConfigError: a weight that is not a positive number, or an empty part.
    """
    parts = []
    for part in spec.split(";"):
        path, _, weight = part.strip().rpartition(",") if "," in part else (part.strip(), "", "1")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not path.strip() or not w > 0:
            raise ConfigError(f"islands.*.data is {spec!r}; give a prepared dataset's folder, or a mixture "
                              "'PATH,WEIGHT;PATH,WEIGHT' with positive weights")
        parts.append((path.strip(), w))
    return parts


def dataset_key(path: str) -> str:
    """A prepared dataset's identity in a config: its path with `~` and `..` resolved."""
    return os.path.normpath(os.path.expanduser(path))


def sharing(config, island_names: Sequence[str]) -> dict:
    """Who reads which dataset, from the config alone: {island: [[dataset, reader index, readers, weight], ...]},
    a dataset named by its first reader's island and the index in that island's mixture. Every dataset's
    training records are split between the islands that read it (record i to the (i mod n)-th of those n
    islands, in config order); islands join with this plan (`config.fingerprint_fields`), so that roles whose
    configs spread the data otherwise are refused before they train on overlapping records. Datasets are the
    same when their paths are, after `~` and `..` are resolved ({} without `data.prepared`).
    """
    if not config.data.get("prepared", ""):
        return {}
    specs = {n: config.islands[n].get("data", "") for n in island_names}
    mixtures = {n: parse_mixture(specs[n]) if specs[n] else [(config.data.prepared, 1.0)] for n in island_names}
    names: dict[str, str] = {}  # path -> the dataset's name in the plan
    readers: dict[str, list[str]] = {}
    for n in island_names:
        for k, (path, _) in enumerate(mixtures[n]):
            key = dataset_key(path)
            names.setdefault(key, f"{n}:{k}")
            if n not in readers.setdefault(key, []):
                readers[key].append(n)
    return {n: [[names[key], readers[key].index(n), len(readers[key]), w]
                for key, w in ((dataset_key(p), w) for p, w in mixtures[n])]
            for n in island_names}
