"""Progress: the launcher's line per round, once every island has logged it or gone past it; an island's lines
within a long round."""

import json
import logging
import re
import time

from island_jax.config import default_config, island
from island_jax.island import StreamingSync
from island_jax.island.accounting import RoundProgress
from island_jax.progress import Progress


def _log(workdir, name, rounds):
    folder = workdir / "islands" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "a") as f:
        for r in rounds:
            sent, received = {"a": (1e5, 2e5), "b": (3e5, 4e5)}[name]
            rec = dict(kind="round", round=r, train_loss=1.0 / r, bytes_sent=sent, bytes_received=received,
                       seconds_blocked=0.5, achieved_gbps=1.0, compute_utilization=0.9)
            f.write(json.dumps(rec) + "\n")


def test_a_round_an_island_missed_is_shown_once_it_went_past_it(tmp_path):
    progress = Progress(str(tmp_path), ["a", "b"], 4)
    _log(tmp_path, "a", [1, 2, 3])
    _log(tmp_path, "b", [1])  # b died after round 1
    lines = progress.poll()
    assert [line.split(" | ")[:2] for line in lines] == [["round 1/4", "loss a=1.0000 b=1.0000"]]
    assert progress.poll() == []  # round 2 waits for b
    _log(tmp_path, "b", [3])  # b rejoined at round 3: it missed round 2
    lines = progress.poll()
    assert [line.split(" | ")[:2] for line in lines] == [["round 2/4", "loss a=0.5000 b=-"],
                                                          ["round 3/4", "loss a=0.3333 b=0.3333"]]
    assert "blocked a=0.50s b=-" in lines[0] and "utilization a=0.90 b=-" in lines[0]
    # every island's bytes, not the first one's for all
    assert "sent/received a=0.10/0.20 b=- MB" in lines[0] and "sent/received a=0.10/0.20 b=0.30/0.40 MB" in lines[1]


def test_a_round_logs_its_steps_every_progress_seconds_and_a_short_round_logs_none():
    lines = []
    progress = RoundProgress("a", 10, every_seconds=30.0, tokens_per_step=1000, log=lines.append)
    progress.begin(2, steps=400)
    assert [progress.after_step(n, 0.25 * n, 1200 + n) for n in range(1, 120)] == [None] * 119  # 29.75 s in
    line = progress.after_step(120, 30.0, 1320)
    assert line == lines[0] == ("island a round 3/10: inner step 120/400 (step 1320), 0.25 s/step, 4000 tokens/s, "
                                "30s in, ~1m10s left")
    assert progress.after_step(200, 59.0, 1400) is None  # 29 s after the last line
    assert progress.after_step(240, 66.0, 1440) == ("island a round 3/10: inner step 240/400 (step 1440), 0.3 s/step, "
                                                     "3333 tokens/s, 1m06s in, ~48s left")  # the mean since the last
    progress.begin(3, seconds=600.0)  # outer.sync = "time": a budget of seconds, not of steps
    assert progress.after_step(10, 31.0, 1450) == ("island a round 4/10: inner step 10 (step 1450), 3.1 s/step, "
                                                    "323 tokens/s, 31s in, ~9m29s left")
    quiet = RoundProgress("a", 10, every_seconds=0.0, tokens_per_step=1000, log=lines.append)
    quiet.begin(0, steps=4)
    assert quiet.after_step(4, 1e6, 4) is None and len(lines) == 3


class _SleepyIsland:
    """A stand-in island (`OuterLoopIsland`'s parts that a run with no outer loop uses) whose steps sleep."""

    name, multi_process, last_step_compiled, tokens_per_step, partition = "a", False, False, 64, [[0]]

    def __init__(self, inner_steps, step_seconds):
        self.inner_steps, self.step_seconds, self.step = inner_steps, step_seconds, 0

    def train_round(self, num_steps=None, after_step=None, seconds=None):
        start, times = time.perf_counter(), []
        for k in range(self.inner_steps):
            time.sleep(self.step_seconds)
            times.append(self.step_seconds)
            self.step += 1
            after_step(k + 1, time.perf_counter() - start, self.step_seconds)
        return dict(steps=self.inner_steps, step_times=times)


def test_the_outer_loop_logs_progress_lines_within_a_long_round(caplog):
    config = default_config()
    config.islands.a = island(1, 1, 1, 1, 6)
    config.outer.rounds = 2
    config.metrics.progress_seconds = 0.025
    sync = StreamingSync(_SleepyIsland(6, 0.01), None, config)  # no outer loop: the inner steps alone
    with caplog.at_level(logging.INFO, logger="absl"):
        sync.run_round(0)
        sync.run_round(1)
    sync.close()
    lines = [r.getMessage() for r in caplog.records if "s/step" in r.getMessage()]
    assert lines and all(line.startswith(("island a round 1/2: inner step ", "island a round 2/2: inner step "))
                         for line in lines)
    second = [re.match(r"island a round 2/2: inner step (\d)/6 \(step (\d+)\), [\d.]+ s/step", line) for line in lines
              if "round 2/2" in line]
    assert second and all(m and int(m[2]) == 6 + int(m[1]) for m in second)  # the run's step goes on from round 1
    config.metrics.progress_seconds = 60.0  # rounds shorter than it: silent
    caplog.clear()
    sync = StreamingSync(_SleepyIsland(6, 0.001), None, config)
    with caplog.at_level(logging.INFO, logger="absl"):
        sync.run_round(0)
    sync.close()
    assert not [r for r in caplog.records if "s/step" in r.getMessage()]


def test_the_eta_after_the_last_round_is_zero_and_before_two_rounds_names_the_next():
    from island_jax.progress import Eta

    clock = iter([0.0, 10.0, 20.0, 30.0])
    eta = Eta(4, clock=lambda: next(clock))
    assert [eta.after(r) for r in (1, 2, 3, 4)] == ["after round 2", "0m20s", "0m10s", "0m00s"]
