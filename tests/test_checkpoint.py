"""Checkpoints: a failed background save, what stays restorable, waiting for a save, each role's schedule."""

import json
import os
import re
import subprocess
import sys
import threading
from concurrent import futures

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity
from tiny_config import get_config, write_corpus

from island_jax.checkpoint import Checkpointer, CheckpointError
from island_jax.mesh import without_forced_device_count
from island_jax.model.init import leaf_checksums
from island_jax.workdir import checkpoint_schedule, island_dir, island_saves, open_role

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = OSError(28, "No space left on device")


def state(r):
    """A small role state that differs every round: parameters, an optax state, 0-d counters."""
    rng = np.random.default_rng(r)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(ml_dtypes.bfloat16)}
    opt_state = optax.adam(1e-3).init({"w": params["w"]})
    opt_state = jax.tree.map(lambda x: np.asarray(x) + r, opt_state)
    return dict(params=params, opt_state=opt_state, step=np.asarray(10 * r, np.int64), round=np.asarray(r, np.int64))


def assert_same_bits(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes())


def folder(tmp_path):
    return str(tmp_path / "islands" / "a" / "checkpoints")


def saved(ckpt, *rounds):
    """Saves `state(r)` for every round and waits until each checkpoint is complete."""
    for r in rounds:
        assert ckpt.save(r, state(r))
        ckpt.last_save().result()


def full_disk(round, host_state):
    """A writer that fails like a full disk, after starting a checkpoint the way orbax does (a temporary folder)."""
    del host_state
    raise FULL


def resumes_from(directory, round):
    return (
        rf"saving the checkpoint of round {round + 1} in {directory} failed \(OSError: \[Errno 28\] No space left on "
        rf"device\); the newest complete checkpoint is round {round}, which a restart resumes from"
    )


def test_a_failed_save_raises_at_the_next_save_once_and_the_previous_checkpoint_restores(tmp_path, monkeypatch):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    saved(ckpt, 1, 2)
    assert ckpt.rounds() == [1, 2] and ckpt.latest_round() == 2

    def partial_then_full(round, host_state):  # what orbax leaves when the disk fills mid-write
        os.makedirs(os.path.join(ckpt.directory, f"{round}.orbax-checkpoint-tmp-1"))
        with open(os.path.join(ckpt.directory, f"{round}.orbax-checkpoint-tmp-1", "part"), "wb") as f:
            f.write(b"\0" * 100)
        raise FULL

    monkeypatch.setattr(ckpt, "_write", partial_then_full)
    assert ckpt.save(3, state(3))  # started; it fails in the background
    futures.wait([ckpt.last_save()])
    assert isinstance(ckpt.last_save().exception(), CheckpointError)
    assert ckpt.rounds() == [1, 2] and ckpt.latest_round() == 2
    assert sorted(os.listdir(ckpt.directory)) == ["1", "2"]  # the partial folder is gone
    assert_same_bits(ckpt.restore(state(0)), state(2))
    assert_same_bits(ckpt.restore(state(0), round=1), state(1))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of round 3 .*\[1, 2\]"):
        ckpt.restore(state(0), round=3)

    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=resumes_from(ckpt.directory, 2)) as raised:
        ckpt.save(4, state(4))
    assert raised.value.__cause__ is FULL
    assert ckpt.rounds() == [1, 2]  # round 4 was not saved
    ckpt.close()  # reported once: the error is not raised again

    restarted = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    assert restarted.rounds() == [1, 2]
    assert_same_bits(restarted.restore(state(0)), state(2))
    saved(restarted, 3)  # the folder takes new checkpoints again
    assert restarted.rounds() == [2, 3]
    restarted.close()


def test_a_failed_save_raises_at_close(tmp_path, monkeypatch):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=2, max_to_keep=2)
    saved(ckpt, 2)
    monkeypatch.setattr(ckpt, "_write", full_disk)
    assert not ckpt.save(3, state(3))  # not due
    assert ckpt.save(3, state(3), force=True)
    with pytest.raises(CheckpointError, match=resumes_from(ckpt.directory, 2)):
        ckpt.close()
    ckpt.close()  # closed: nothing more to raise
    assert_same_bits(Checkpointer(folder(tmp_path), 2, 2).restore(state(0)), state(2))


def test_check_raises_a_failed_save_at_once_without_waiting_for_the_next(tmp_path, monkeypatch):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    saved(ckpt, 1)
    ckpt.check()  # nothing failed
    monkeypatch.setattr(ckpt, "_write", full_disk)
    assert ckpt.save(2, state(2))
    futures.wait([ckpt.last_save()])
    with pytest.raises(CheckpointError, match=resumes_from(ckpt.directory, 1)):
        ckpt.check()
    ckpt.check()  # raised once
    ckpt.close()


def test_after_a_rollback_the_rounds_past_it_are_saved_again(tmp_path):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=4)
    saved(ckpt, 1, 2, 3)
    assert ckpt.discard_after(1) == [2, 3] and ckpt.rounds() == [1]
    again = {r: state(10 + r) for r in (2, 3)}  # the rounds trained again after rolling back to round 1
    for r in (2, 3):
        assert ckpt.save(r, again[r])
    assert ckpt.rounds(wait=True) == [1, 2, 3]
    assert_same_bits(ckpt.restore(state(0), round=2), again[2])
    assert_same_bits(ckpt.restore(state(0)), again[3])
    ckpt.close()


def test_a_failed_first_save_says_a_restart_starts_from_the_beginning(tmp_path, monkeypatch):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    monkeypatch.setattr(ckpt, "_write", full_disk)
    ckpt.save(1, state(1))
    with pytest.raises(CheckpointError, match="there is no complete checkpoint, so a restart starts from the beginning"):
        ckpt.save(2, state(2))
    with pytest.raises(CheckpointError, match=f"no checkpoint in {ckpt.directory}"):
        ckpt.restore(state(0))
    ckpt.close()


def test_a_real_orbax_failure_at_commit_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """Orbax's own write, failing as it renames the temporary folder: its manager is replaced, nothing is lost."""
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    saved(ckpt, 1, 2)

    async def rename_fails(self):
        raise FULL

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", rename_fails)
    ckpt.save(3, state(3))
    futures.wait([ckpt.last_save()])
    monkeypatch.undo()
    assert ckpt.rounds() == [1, 2] and sorted(os.listdir(ckpt.directory)) == ["1", "2"]
    assert_same_bits(ckpt.restore(state(0)), state(2))
    with pytest.raises(CheckpointError, match=resumes_from(ckpt.directory, 2)):
        ckpt.save(4, state(4))
    saved(ckpt, 4)
    assert ckpt.rounds() == [2, 4]
    ckpt.close()


def test_restore_waits_for_the_save_in_progress_and_last_save_tells_when_it_is_complete(tmp_path, monkeypatch):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=2)
    assert ckpt.last_save() is None and ckpt.rounds() == []
    go, write = threading.Event(), ckpt._write

    def slow(round, host_state):
        assert go.wait(30)
        write(round, host_state)

    monkeypatch.setattr(ckpt, "_write", slow)
    ckpt.save(1, state(1))
    done = []
    ckpt.last_save().add_done_callback(lambda f: done.append((f.exception(), ckpt.rounds())))
    assert not ckpt.last_save().done()
    assert ckpt.rounds() == [] and ckpt.latest_round() is None  # a checkpoint counts once it is complete
    threading.Timer(0.2, go.set).start()
    assert_same_bits(ckpt.restore(state(0)), state(1))
    assert done == [(None, [1])]
    ckpt.close()


def test_checkpoint_schedule_keeps_the_coordinators_newest_round_on_every_island():
    config = get_config()

    def schedule(k, e, keep=1, coordinator=False):
        config.checkpoint.update(coordinator_every_rounds=k, every_rounds=e, max_to_keep=keep)
        return checkpoint_schedule(config, coordinator)

    assert schedule(1, 1) == (1, 3)
    assert schedule(2, 2) == (2, 2)
    assert schedule(4, 2) == (2, 3)
    assert schedule(1, 10) == (10, 3)  # islands save at the coordinator's rounds too: C, C + 1, C + 2
    assert schedule(1, 10, keep=2) == (10, 3)
    assert [island_saves(r, 4, 6) for r in range(1, 13)] == [r in (4, 6, 8, 12) for r in range(1, 13)]
    assert schedule(0, 3) == (3, 2)  # k = every_rounds: (3 + 1) // 3 + 1
    assert schedule(1, 1, keep=5) == (1, 5)
    assert schedule(4, 2, keep=2, coordinator=True) == (4, 2)
    assert schedule(0, 2, keep=2, coordinator=True) == (2, 2)
    config.outer.enabled = False  # no coordinator to fall back to
    assert schedule(1, 1) == (1, 1)


def test_open_role_gives_each_role_its_schedule(tmp_path):
    config = get_config()
    config.checkpoint.update(coordinator_every_rounds=4, every_rounds=2, max_to_keep=2)
    for path, coordinator, expected in ((tmp_path / "c", True, (4, 2)), (tmp_path / "i", False, (2, 3))):
        role = open_role(config, str(path), coordinator=coordinator)
        assert (role.checkpoints.every_rounds, role.checkpoints.max_to_keep) == expected
        role.close()


# An island trained alone by experiments/train.py, whose writer fails from round 2 on.
FAILING_RUN = """
import runpy, sys
from island_jax.checkpoint import Checkpointer
write = Checkpointer._write
def full_disk(self, round, host_state):
    if round >= 2:
        raise OSError(28, "No space left on device")
    write(self, round, host_state)
Checkpointer._write = full_disk
sys.argv = ["experiments/train.py"] + sys.argv[1:]
runpy.run_path("experiments/train.py", run_name="__main__")
"""

ALONE = """
import sys
sys.path.insert(0, {tests!r})
import tiny_config

def get_config():
    c = tiny_config.get_config()
    del c.islands["b"]
    c.outer.enabled = False
    return c
"""


@pytest.mark.slow  # starts a process
def test_a_role_whose_save_fails_exits_naming_the_folder_and_its_checkpoint_restores(tmp_path):
    from island_jax import data as data_lib
    from island_jax.island import Island
    from island_jax.metrics import read_jsonl
    from island_jax.model.init import checksum, init_params

    corpus = write_corpus(tmp_path / "corpus")
    (tmp_path / "alone.py").write_text(ALONE.format(tests=os.path.join(ROOT, "tests")))
    workdir = tmp_path / "workdir"
    env = without_forced_device_count(os.environ)  # the role sets its own devices
    result = subprocess.run(
        [sys.executable, "-c", FAILING_RUN, f"--config={tmp_path / 'alone.py'}", f"--workdir={workdir}",
         "--role=island", "--island=a", f"--config.data.files={corpus}", "--config.outer.rounds=3",
         "--config.checkpoint.every_rounds=1"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    directory = os.path.join(island_dir(str(workdir), "a"), "checkpoints")
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"CheckpointError: saving the checkpoint of round 2 in {directory} failed (OSError: [Errno 28] No space left "
        "on device); the newest complete checkpoint is round 1, which a restart resumes from"
    ), result.stderr[-3000:]

    config = get_config()
    del config.islands["b"]
    config.outer.enabled = False
    config.data.files = corpus
    graphdef, params, specs = init_params(config)
    train = data_lib.load_corpus(corpus, config.data.eval_fraction, ["a"]).train["a"]
    island = Island("a", config, jax.devices()[:4], graphdef, params, specs, train, 3)
    ckpt = Checkpointer(directory, 1, 2)
    assert ckpt.rounds() == [1]
    restored = ckpt.restore(island.state(0))
    ckpt.close()
    record = next(r for r in read_jsonl(workdir / "islands" / "a" / "metrics.jsonl") if r["kind"] == "checkpoint")
    assert record["round"] == 1 and int(restored["round"]) == 1
    assert {k: checksum(v) for k, v in restored.items()} == record["checksums"]
    assert json.loads((workdir / "islands" / "a" / "config.json").read_text())["outer"]["rounds"] == 3


def test_a_save_copies_a_sharded_array_to_the_host_once_and_orbax_copies_none(tmp_path, monkeypatch):
    """A checkpoint's host copy of a sharded array is one buffer read shard by shard (`mesh.host_copy`): no whole
    copy stays cached on the array, and orbax writes the private copy without copying it again."""
    import copy

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from island_jax.mesh import host_copy, island_mesh

    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = jax.device_put(values, NamedSharding(island_mesh(1, 1, jax.devices()[:4], fsdp=4), P("fsdp")))
    host = host_copy(x)
    np.testing.assert_array_equal(host, values)
    assert host.flags.writeable

    copied = []
    real = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda v, *a: copied.append(type(v)) or real(v, *a))
    checkpoints = Checkpointer(str(tmp_path / "checkpoints"), every_rounds=1, max_to_keep=2)
    assert checkpoints.save(1, {"x": x, "step": np.asarray(3, np.int64)})
    checkpoints.close()
    assert getattr(x, "_npy_value", None) is None  # the save cached no whole host copy on the array
    assert np.ndarray not in copied
    restored = Checkpointer(str(tmp_path / "checkpoints"), every_rounds=1, max_to_keep=2).restore(
        {"x": host, "step": np.asarray(0, np.int64)})
    np.testing.assert_array_equal(restored["x"], values)
    assert int(restored["step"]) == 3


def test_a_save_copies_device_arrays_and_takes_frozen_numpy_arrays_as_they_are():
    from island_jax.checkpoint import _host

    tree = {"fresh": np.arange(4, dtype=np.float32), "device": jax.device_put(np.ones(3, np.float32))}
    frozen, copied = _host(tree, frozen_numpy=True), _host(tree)
    assert frozen["fresh"] is tree["fresh"] and copied["fresh"] is not tree["fresh"]
    assert isinstance(frozen["device"], np.ndarray) and isinstance(copied["device"], np.ndarray)
    np.testing.assert_array_equal(copied["fresh"], tree["fresh"])
    np.testing.assert_array_equal(frozen["device"], np.ones(3, np.float32))


def test_a_compressed_checkpoint_of_an_earlier_version_is_restored_and_new_ones_are_written_plain(tmp_path):
    """Checkpoints were once written with orbax's standard handler, zstd-compressed; they are written plain now
    (the compressed chunks were held in memory until written), and an old one still restores bit for bit."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    directory = folder(tmp_path)
    old = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
    old.save(1, args=ocp.args.StandardSave(state(1)))
    old.wait_until_finished()
    old.close()
    ckpt = Checkpointer(directory, every_rounds=1, max_to_keep=3)
    assert_same_bits(ckpt.restore(state(0)), state(1))
    saved(ckpt, 2)
    assert_same_bits(ckpt.restore(state(0)), state(2))
    ckpt.close()
    compressors = {}
    for n in (1, 2):  # each array's zarr metadata, in the checkpoint's OCDBT database
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.join(directory, str(n), 'default')}"}).result()
        keys = [k.decode() for k in kv.list().result() if k.endswith(b"/.zarray")]
        compressors[n] = {json.loads(kv.read(k).result().value)["compressor"] is None for k in keys}
        assert len(keys) == len(jax.tree.leaves(state(n)))
    assert compressors == {1: {False}, 2: {True}}


def damage(directory, round, nbytes=4096):
    """Overwrites `nbytes` in the middle of the largest data file of checkpoint `round` (orbax's OCDBT files hold
    many arrays each), as a failing disk would; returns that file's path."""
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(directory, str(round))) for f in names]
    path = max((f for f in files if os.sep + "d" + os.sep in f), key=os.path.getsize)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(max(0, size // 2 - nbytes // 2))
        f.write(b"\xff" * min(nbytes, size))
    return path


def big_state(r):
    """`state(r)` with a leaf large enough that damage in its data file lands in its bytes."""
    out = state(r)
    out["params"]["big"] = np.full((64, 256), r, np.float32)
    return out


def test_a_damaged_checkpoint_is_named_moved_aside_and_the_previous_one_restores(tmp_path, caplog):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=3)
    for r in (1, 2):
        assert ckpt.save(r, big_state(r))
        ckpt.last_save().result()
    damage(ckpt.directory, 2)
    with caplog.at_level("ERROR"):
        assert_same_bits(ckpt.restore(big_state(0)), big_state(1))
    where = os.path.join(ckpt.directory, "2")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    saved_big = leaf_checksums(big_state(2)["params"]["big"])[0]  # the leaf the 4 KiB landed in, named
    assert len(errors) == 1 and re.fullmatch(
        rf"the checkpoint of round 2 in {re.escape(where)} is damaged: \['params'\]\['big'\] reads checksum "
        rf"(?!{saved_big})[0-9a-f]{{16}}, but was saved with {saved_big}; the previous checkpoint is tried", errors[0])
    assert ckpt.rounds() == [1] and sorted(os.listdir(ckpt.directory)) == ["1", "2.damaged"]
    assert ckpt.save(2, big_state(2))  # the round is saved again, over nothing
    ckpt.last_save().result()
    assert_same_bits(ckpt.restore(big_state(0)), big_state(2))
    ckpt.close()


def test_a_leaf_that_reads_other_bits_is_named_with_both_checksums(tmp_path, monkeypatch):
    from island_jax import checkpoint as checkpoint_lib

    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=3)
    saved(ckpt, 1, 2)
    real = checkpoint_lib.describe_leaves
    saved_b = real(state(2))["['params']['b']"][0]
    # what a flipped bit in the bytes of params.b reads as: the checksum of other values
    monkeypatch.setattr(checkpoint_lib, "describe_leaves", lambda tree: {
        k: (["0123456789abcdef", *v[1:]] if k == "['params']['b']" and int(np.asarray(tree["round"])) == 2 else v)
        for k, v in real(tree).items()})
    with pytest.raises(checkpoint_lib.CheckpointCorrupt) as raised:
        ckpt.restore(state(0), round=2)
    assert str(raised.value) == (
        f"the checkpoint of round 2 in {os.path.join(ckpt.directory, '2')} is damaged: ['params']['b'] reads "
        f"checksum 0123456789abcdef, but was saved with {saved_b}"
    )
    assert ckpt.rounds() == [1]
    ckpt.close()


def test_with_every_checkpoint_damaged_restore_names_each_and_says_what_to_do(tmp_path):
    from island_jax.checkpoint import CheckpointCorrupt

    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=3)
    for r in (1, 2):
        assert ckpt.save(r, big_state(r))
        ckpt.last_save().result()
    for r in (1, 2):
        damage(ckpt.directory, r)
    with pytest.raises(CheckpointCorrupt) as raised:
        ckpt.restore(big_state(0))
    message = str(raised.value)
    assert message.startswith(f"no intact checkpoint in {ckpt.directory}: the checkpoint of round 2 in ")
    assert f"; the checkpoint of round 1 in {os.path.join(ckpt.directory, '1')} is damaged: " in message
    assert message.endswith("Nothing was moved; if the cause passes (memory, a storage error), start again; "
                            "otherwise start the run again in a new --workdir, or restore these files from a copy")
    assert ckpt.rounds() == [1, 2] and sorted(os.listdir(ckpt.directory)) == ["1", "2"]  # nothing moved
    ckpt.close()


def test_a_checkpoint_of_another_structure_is_not_called_damaged(tmp_path):
    ckpt = Checkpointer(folder(tmp_path), every_rounds=1, max_to_keep=3)
    saved(ckpt, 1)
    with pytest.raises(CheckpointError) as raised:
        ckpt.restore(big_state(0))
    assert type(raised.value) is CheckpointError
    assert str(raised.value) == (
        f"the checkpoint of round 1 in {ckpt.directory} does not fit this run's model and optimizer (first "
        "difference: ['params']['big']: saved None, this run ['float32', [64, 256]]); resume with the config that "
        "wrote it, or pass a new --workdir"
    )
    assert ckpt.rounds() == [1]
    ckpt.close()


def test_a_checkpoint_written_without_checksums_restores_with_a_warning(tmp_path, caplog):
    import orbax.checkpoint as ocp

    directory = folder(tmp_path)
    old = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                                item_handlers=ocp.PyTreeCheckpointHandler(use_compression=False))
    old.save(3, args=ocp.args.PyTreeSave(state(3)))
    old.wait_until_finished()
    old.close()
    ckpt = Checkpointer(directory, every_rounds=1, max_to_keep=3)
    with caplog.at_level("WARNING", logger="absl"):
        assert_same_bits(ckpt.restore(state(0)), state(3))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"the checkpoint of round 3 in {directory} holds no checksums (written by an earlier version): restored "
        "without checking its bits"
    ]
    ckpt.close()
