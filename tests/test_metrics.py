"""Metric writers (`metrics.writers`): JSON lines always, TensorBoard, Weights & Biases offline, another tracker."""

import glob
import json
import struct
import time

import pytest

from island_jax import metrics
from island_jax.config import ConfigError, default_config, island, validate

RECORDS = [
    dict(kind="inner", round=1, step=1, loss=2.5, moe=dict(expert_load=[[0.25, 0.75]])),
    dict(kind="inner", round=1, step=2, loss=2.0, moe=dict(expert_load=[[0.5, 0.5]])),
    dict(kind="round", round=1, train_loss=2.25, weights=dict(a=1.0)),
    dict(kind="exchange", pipelined=True),  # no number: nothing for the trackers
]


def _config(writers):
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.metrics.writers = writers
    c.metrics.wandb.mode = "offline"
    return c


class ListWriter(metrics.Writer):
    """A tracker of its own, named in metrics.writers as test_metrics:ListWriter."""

    made: list = []

    def __init__(self, folder, role, config):
        super().__init__(folder, role, config)
        self.records, self.closed = [], False
        ListWriter.made.append(self)

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def test_another_tracker_is_a_class_named_by_module_and_name(tmp_path):
    ListWriter.made.clear()
    config = _config("jsonl,test_metrics:ListWriter")
    validate(config)
    writer = metrics.MetricsWriter(str(tmp_path), metrics.make_writers(config.metrics.writers, str(tmp_path),
                                                                       "island a", config))
    start = time.time()
    for record in RECORDS:
        writer.write(dict(record, checksum=lambda: "ab"))  # a value computed when written
    end = time.time()
    writer.close()
    (made,) = ListWriter.made
    assert (made.folder, made.role, made.closed) == (str(tmp_path), "island a", True)
    written = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert made.records == written
    times = [r.pop("time") for r in written]  # when each was logged, Unix seconds
    assert all(type(t) is float for t in times) and start <= times[0] <= times[-1] <= end and times == sorted(times)
    assert written == [dict(r, checksum="ab") for r in RECORDS]
    assert "time" not in RECORDS[0]  # the caller's record is left as it was
    assert metrics.scalars(dict(RECORDS[0], time=start)) == {"inner/loss": 2.5, "inner/moe/expert_load/0/0": 0.25,
                                           "inner/moe/expert_load/0/1": 0.75}


@pytest.mark.parametrize("writers,message", [
    ("tensorboard", r"metrics.writers is 'tensorboard'; it must include jsonl"),
    ("jsonl,mlflow", r"metrics.writers names 'mlflow'; use jsonl, tensorboard, wandb or MODULE:CLASS"),
])
def test_writers_are_checked_before_the_run(writers, message):
    with pytest.raises(ConfigError, match=message):
        validate(_config(writers))


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file (`run-ID.wandb`): a 7-byte header (":W&B", magic, version),
    then LevelDB log records in 32 KiB blocks, each a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pieces, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pieces + chunk)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind in (2, 3):  # the first or a middle piece
            pieces += chunk
    return rows


def test_wandb_offline_run_holds_every_scalar_on_its_kinds_axis(tmp_path, monkeypatch):
    import wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = _config("jsonl,tensorboard,wandb")
    folder = tmp_path / "workdir" / "islands" / "a"
    writer = metrics.MetricsWriter(str(folder), metrics.make_writers(config.metrics.writers, str(folder), "island a",
                                                                     config))
    for record in RECORDS:
        writer.write(record)
    writer.close()
    # `finish` can return before wandb's service has flushed the offline file (seen on a busy machine: the file
    # held its 7-byte header alone); `teardown` waits for the service to stop, and so for the file.
    wandb.teardown()
    (run_file,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in _wandb_history(run_file)]
    assert rows == [
        {"inner/step": 1, "inner/loss": 2.5, "inner/moe/expert_load/0/0": 0.25, "inner/moe/expert_load/0/1": 0.75},
        {"inner/step": 2, "inner/loss": 2.0, "inner/moe/expert_load/0/0": 0.5, "inner/moe/expert_load/0/1": 0.5},
        {"round/round": 1, "round/train_loss": 2.25, "round/weights/a": 1.0},
    ]
    assert glob.glob(str(folder / "events.out.tfevents.*")) and len(metrics.read_jsonl(folder / "metrics.jsonl")) == 4


def test_tensorboard_scalars_carry_the_records_time_as_wall_time(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = metrics.MetricsWriter(str(tmp_path), [metrics.TensorBoardWriter(str(tmp_path), "island a", None)])
    writer.write(dict(RECORDS[0], time=1700000000.25))  # a time of its own is kept
    writer.write(RECORDS[2])
    writer.close()
    written = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "inner/time" not in events.Tags()["scalars"] and "round/time" not in events.Tags()["scalars"]
    (loss,) = events.Scalars("inner/loss")
    (train_loss,) = events.Scalars("round/train_loss")
    assert (loss.step, loss.value, loss.wall_time) == (1, 2.5, 1700000000.25) == (1, 2.5, written[0]["time"])
    assert (train_loss.step, train_loss.wall_time) == (1, written[1]["time"])


def test_the_learning_rate_logged_is_the_one_the_inner_update_steps_by():
    import jax.numpy as jnp
    import numpy as np

    from island_jax.island.step import inner_optimizer, learning_rates

    config = default_config()
    config.inner.update(learning_rate=0.01, warmup_steps=2, weight_decay=0.0)
    tx = inner_optimizer(config, 6)
    logged = learning_rates(tx, 0, 6)
    assert logged == [float(tx.learning_rate(n)) for n in range(6)]
    assert logged[0] == 0.0 and logged[2] == float(np.float32(0.01))  # warm-up from 0 to the peak at count 2
    params, state, moved = jnp.zeros(1, jnp.float32), tx.init(jnp.zeros(1, jnp.float32)), []
    for _ in range(6):  # gradient 0.5 every step: Adam's step is the learning rate itself (|m / sqrt(v)| = 1)
        updates, state = tx.update(jnp.full(1, 0.5, jnp.float32), state, params)
        moved.append(-float(updates[0]))
    np.testing.assert_allclose(moved, logged, rtol=1e-6)
    assert learning_rates(tx, 4, 2) == logged[4:]


def test_a_runs_records_carry_their_time_and_the_inner_learning_rate(tmp_path):
    """One island with no outer loop, 2 rounds of 3 inner steps (about 5 s)."""
    import numpy as np
    from tiny_config import get_config, write_corpus

    from island_jax.island.step import inner_optimizer
    from island_jax.run import run_in_process

    config = get_config()
    config.data.files = write_corpus(tmp_path / "corpus")
    del config.islands["b"]
    config.islands.a = island(1, 1, 1, 4, 3)
    config.outer.update(enabled=False, rounds=2)
    config.inner.warmup_steps = 2
    config.metrics.writers = "jsonl"
    start = time.time()
    run_in_process(config, str(tmp_path / "workdir"))
    end = time.time()
    records = metrics.read_jsonl(tmp_path / "workdir" / "islands" / "a" / "metrics.jsonl")
    assert {r["kind"] for r in records} >= {"inner", "round", "eval", "checkpoint"}
    times = [r["time"] for r in records]
    assert all(type(t) is float for t in times) and start <= times[0] and times == sorted(times) and times[-1] <= end
    inner = [r for r in records if r["kind"] == "inner"]
    schedule = inner_optimizer(config, 6).learning_rate  # the island's: 3 steps x 2 rounds
    assert [r["step"] for r in inner] == [1, 2, 3, 4, 5, 6]
    assert [r["learning_rate"] for r in inner] == [float(schedule(r["step"] - 1)) for r in inner]
    assert inner[0]["learning_rate"] == 0.0 and inner[2]["learning_rate"] == float(np.float32(config.inner.learning_rate))


def test_progress_seconds_is_checked_before_the_run():
    config = _config("jsonl")
    config.metrics.progress_seconds = -1.0
    with pytest.raises(ConfigError, match=r"metrics.progress_seconds is -1.0; give the seconds between progress lines "
                                          r"within a round \(0: none\)"):
        validate(config)


@pytest.mark.slow  # a fresh interpreter: torch is imported by other tests of this process
def test_the_tensorboard_writer_leaves_torch_unimported_and_importable():
    pytest.importorskip("torch")  # installed by the test extra
    import subprocess
    import sys

    script = ("import sys; from island_jax import metrics; metrics._summary_writer(); "
              "assert 'torch' not in sys.modules, 'tensorboardX imported torch'; "
              "import torch; print(torch.tensor([1.0, 2.0]).sum().item())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "3.0\n"
