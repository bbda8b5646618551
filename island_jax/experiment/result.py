"""What a finished run wrote, read back from its workdir as pandas DataFrames (`Result.load`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


@dataclasses.dataclass
class Result:
    """What a finished run wrote, as pandas DataFrames (`Result.load`).

    Attributes:
      workdir: the run's folder.
      summary: one row, `WORKDIR/summary.json` with nested dicts flattened with dots
        (e.g. `islands.a.bytes_sent`); losses in nats per byte (per token on prepared records), times in seconds,
        bytes in bytes.
      rounds: one row per round record (kind "round") of the coordinator and every island,
        `role` ("coordinator" or "island"), `island` (the island's name; None for the
        coordinator), then the record's fields flattened with dots (e.g. `weights.a`).
        A round logged twice (a resumed run trains it again) appears once, with its latest record.
      steps: one row per inner-step record (kind "inner") of every island, with an `island`
        column; a step logged twice appears once, with its latest record.
    """

    workdir: str
    summary: Any  # pandas.DataFrame
    rounds: Any  # pandas.DataFrame
    steps: Any  # pandas.DataFrame

    @classmethod
    def load(cls, workdir: str) -> Result:
        """Reads a finished run's workdir.

        Raises:
          FileNotFoundError: `WORKDIR/summary.json` is missing (the run did not finish).
        """
        import pandas as pd

        from island_jax.metrics import read_jsonl
        from island_jax.workdir import coordinator_dir, island_dir

        with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
            summary = pd.json_normalize(json.load(f), sep=".")
        rounds, steps = [], []
        coordinator = os.path.join(coordinator_dir(workdir), "metrics.jsonl")
        if os.path.exists(coordinator):
            rounds += _latest(
                [dict(role="coordinator", island=None, **r) for r in read_jsonl(coordinator) if r.get("kind") == "round"],
                "round",
            )
        islands = os.path.join(workdir, "islands")
        for name in sorted(os.listdir(islands)) if os.path.isdir(islands) else []:
            path = os.path.join(island_dir(workdir, name), "metrics.jsonl")
            if not os.path.exists(path):
                continue
            records = read_jsonl(path)
            rounds += _latest([dict(role="island", island=name, **r) for r in records if r.get("kind") == "round"], "round")
            steps += _latest([dict(island=name, **r) for r in records if r.get("kind") == "inner"], "step")
        return cls(workdir, summary, pd.json_normalize(rounds, sep="."), pd.json_normalize(steps, sep="."))

    def sample(self, prompt: str = "\n", max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, num_samples: int = 1, round: int | None = None) -> list[str]:
        """Text the run's model writes after `prompt`: `island_jax.sample.continue_text` (the run's tokenizer,
        as `python -m island_jax.sample`) on the global parameters of the checkpoint of `round` (None: the
        newest), in this process, on its first device.

        Args:
          prompt: the text to continue (encoded with the run's tokenizer: `sample.run_tokenizer`).
          max_new_tokens: tokens to generate; with the prompt's, at most `model.seq_len`.
          temperature, top_k, top_p, seed, num_samples: as `sample.generate`.
          round: completed rounds of a kept checkpoint; None: the newest.

        Returns:
          `num_samples` continuations as text, the prompt left out (`sample.Continuation.new_text`: the
          tokenizer's decoding of the prompt's ids and the new ones together, past the prompt's text).

        Raises:
          FileNotFoundError, model.load.LoadError: no checkpoint (of `round`) to read.
          sample.SampleError: an empty prompt, too many positions, bad settings, or no readable tokenizer.
        """
        from island_jax import sample
        from island_jax.model import load

        config, params, _ = load.from_workdir(self.workdir, round)
        samples = sample.continue_text(config, params, prompt, None, max_new_tokens, temperature, top_k, top_p,
                                       seed, num_samples)
        return [s.new_text for s in samples]

    @property
    def bytes_per_round(self) -> float:
        """Mean bytes an island sent per round (its round records' `bytes_sent`); NaN without any."""
        if "bytes_sent" not in self.rounds:
            return math.nan
        sent = self.rounds.loc[self.rounds["role"] == "island", "bytes_sent"]
        return float(sent.mean()) if len(sent) else math.nan


def _latest(records: list[dict], key: str) -> list[dict]:
    """Records with one per `key` value (the latest logged), in order of that value."""
    by_key = {r[key]: r for r in records}
    return [by_key[k] for k in sorted(by_key)]
