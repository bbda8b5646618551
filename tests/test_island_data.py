"""Islands training on prepared records: the shared dataset split between islands, data of an island's own
(a dataset or a mixture), held-out sets, resume, and the errors of bad data settings."""

import json
import os

import numpy as np
import pytest
from tiny_config import get_config, write_prepared

from island_jax import data as data_lib
from island_jax.config import ConfigError, fingerprint_fields, sharing, validate
from island_jax.data import DataError
from island_jax.data.records import PreparedDataset
from island_jax.metrics import read_jsonl
from island_jax.run import run_in_process

PROSE = ["the", "island", "sends", "its", "update", "over", "a", "slow", "link", "and", "waits", ".", "\n"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """A shared dataset of code-like words, and one of prose made with its tokenizer (b's own data)."""
    tmp = tmp_path_factory.mktemp("datasets")
    shared = write_prepared(tmp / "shared")
    own = write_prepared(tmp / "own", seed=1, words=PROSE, tokenizer=f"{shared}/tokenizer.json")
    return shared, own


def _config(shared, own="", rounds=3):
    c = get_config()
    c.data.prepared = shared
    c.model.update(vocab_size=300, positions="rope")
    c.islands.b.data = own
    c.outer.rounds = rounds
    return c


def _rows(dataset):
    return {tuple(np.asarray(dataset[i]).ravel()) for i in range(len(dataset))}


def test_islands_split_the_shared_records_and_an_island_with_its_own_data_reads_only_that(datasets):
    shared, own = datasets
    records = _rows(PreparedDataset(shared).records("train"))
    split = data_lib.load(_config(shared), ["a", "b"])
    a, b = _rows(split.train["a"]), _rows(split.train["b"])
    assert a | b == records and not a & b and len(a) == (len(records) + 1) // 2  # record i to island i mod 2
    assert split.own_eval == {}
    mine = data_lib.load(_config(shared, own), ["a", "b"])
    assert _rows(mine.train["a"]) == records  # a reads the whole shared dataset, b none of it
    assert _rows(mine.train["b"]) == _rows(PreparedDataset(own).records("train"))
    assert _rows(mine.own_eval["b"]) == _rows(PreparedDataset(own).records("eval"))
    assert _rows(mine.eval) == _rows(PreparedDataset(shared).records("eval"))  # the shared held-out set
    both = _config(shared, own)
    both.islands.a.data = own  # two islands naming one dataset split its records, as they split the shared one
    both = data_lib.load(both, ["a", "b"])
    a, b = _rows(both.train["a"]), _rows(both.train["b"])
    assert a | b == _rows(PreparedDataset(own).records("train")) and not a & b
    assert _rows(both.own_eval["a"]) == _rows(both.own_eval["b"]) == _rows(PreparedDataset(own).records("eval"))
    # an island opens only its own data: a's host need not hold b's dataset
    alone = data_lib.load(_config(shared, "/nowhere/else"), ["a", "b"], island="a")
    assert list(alone.train) == ["a"]


def test_a_mixture_draws_from_each_dataset_by_its_weight(datasets):
    shared, own = datasets
    c = _config(shared, f"{shared},3;{own},1")
    train = data_lib.load(c, ["a", "b"], island="b").train["b"]
    prose, code = _rows(PreparedDataset(own).records("train")), _rows(PreparedDataset(shared).records("train"))
    drawn = [tuple(np.asarray(train[i]).ravel()) for i in range(400)]
    assert sum(d in prose for d in drawn) == 100 and sum(d in code for d in drawn) == 300
    batches = data_lib.train_dataset(train, 32, 4, seed=0)
    assert np.asarray(batches[7]).shape == (4, 2, 33)
    np.testing.assert_array_equal(np.reshape(batches[7], (4, -1)), np.stack(drawn[28:32]))  # endless and shuffled already: in order


def test_bits_per_byte_of_records_counts_each_targets_text_bytes(datasets):
    shared, _ = datasets
    dataset = PreparedDataset(shared)
    windows = data_lib.eval_windows(dataset.records("eval"), 32, 1000, seed=0)
    targets, text = data_lib.scored(windows, dataset.token_bytes)
    manifest = dataset.manifest["splits"]["eval"]
    # every record scored: each token of a shard but its first is a target once, with its bytes of text
    records = dataset.records("eval")
    starts = np.cumsum([0] + [s["records"] for s in manifest["shards"]])[:-1]
    assert int(targets.sum()) == manifest["tokens"] - len(manifest["shards"])
    assert int(text.sum()) == manifest["bytes"] - sum(int(dataset.token_bytes[records[int(i)][0, 0]]) for i in starts)
    assert len(windows) == sum(s["records"] for s in manifest["shards"])


@pytest.fixture(scope="module")
def own_run(datasets, tmp_path_factory):
    shared, own = datasets
    workdir = tmp_path_factory.mktemp("own_run") / "workdir"
    return _config(shared, own), run_in_process(_config(shared, own), str(workdir)), workdir


def test_an_island_with_its_own_data_scores_its_own_held_out_split_beside_the_shared_one(own_run, datasets):
    config, summary, workdir = own_run
    assert summary["checksums_agree"] is True
    assert summary["corpus"] == PreparedDataset(datasets[0]).fingerprint()
    own = [r for r in read_jsonl(workdir / "islands" / "b" / "metrics.jsonl") if r["kind"] == "own_eval"]
    assert [r["round"] for r in own] == [0, 3]
    windows = data_lib.eval_windows(PreparedDataset(datasets[1]).records("eval"), 32, 8, 0)
    assert own[-1]["own_eval_windows_sha256"] == data_lib.windows_sha256(windows)
    assert summary["islands"]["b"]["own_eval_loss_final"] == own[-1]["own_eval_loss"]
    assert "own_eval_loss_final" not in summary["islands"]["a"]
    assert summary["eval_loss_initial"] == pytest.approx(np.log(300), abs=1e-5)  # a zero head: uniform


def test_an_island_reading_records_stopped_and_resumed_trains_the_same_batches(own_run, tmp_path):
    config, _, straight = own_run
    config = _config(config.data.prepared, config.islands.b.data)
    config.islands.b.crash_at_round = 2
    workdir = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="island b crashes at round 2 on purpose"):
        run_in_process(config, str(workdir))
    config.islands.b.crash_at_round = 0
    assert run_in_process(config, str(workdir))["checksums_agree"] is True
    for role in ("coordinator", "islands/a", "islands/b"):
        def rounds(folder):
            return {r["round"]: r["checksum"] for r in read_jsonl(folder / role / "metrics.jsonl") if r["kind"] == "round"}

        assert rounds(workdir) == rounds(straight)


def test_bad_data_settings_are_refused_naming_the_field_and_the_fix(datasets, tmp_path):
    shared, own = datasets
    c = _config(shared)
    c.model.vocab_size = 256
    assert PreparedDataset(shared).vocab_size == 299  # the BPE ran out of pairs seen twice before 300
    with pytest.raises(ConfigError, match="model.vocab_size is 256 but the tokenizer of .* has 299 tokens; set "
                                          "model.vocab_size to at least 299"):
        data_lib.load(c, ["a", "b"])
    c = _config(shared)
    c.model.seq_len = 64
    with pytest.raises(ConfigError, match="model.seq_len is 64 but .* holds records of 32 predictions \\(33 tokens\\); "
                                          "set model.seq_len=32, or prepare the data with --seq_len=64"):
        data_lib.load(c, ["a", "b"])
    with pytest.raises(DataError, match="data.prepared: the prepared dataset .*missing does not exist; prepare it"):
        data_lib.load(_config(str(tmp_path / "missing")), ["a", "b"])
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(DataError, match="islands.b.data: .*unfinished holds no manifest.json: it is not a prepared "
                                        "dataset, or its preparation did not finish"):
        data_lib.load(_config(shared, str(tmp_path / "unfinished")), ["a", "b"], island="b")
    with pytest.raises(ConfigError, match="islands.b.data is .* but data.prepared is empty"):
        validate(_config("", own))
    with pytest.raises(ConfigError, match="islands.b.data is 'x,0;y,1'; give a prepared dataset's folder, or a "
                                          "mixture 'PATH,WEIGHT;PATH,WEIGHT' with positive weights"):
        validate(_config(shared, "x,0;y,1"))
    other = write_prepared(tmp_path / "other", vocab_size=280)  # a tokenizer of its own
    with pytest.raises(DataError, match="islands.b.data names .*other/prepared, prepared with tokenizer .* but "
                                        "data.prepared .* prepare it with the shared dataset's tokenizer "
                                        "\\(--tokenizer=tokenizer_json --tokenizer_path=.*shared/prepared/tokenizer.json\\)"):
        data_lib.load(_config(shared, other), ["a", "b"], island="b")
    longer = write_prepared(tmp_path / "longer", seq_len=48, tokenizer=f"{shared}/tokenizer.json")
    with pytest.raises(DataError, match="islands.b.data names .*longer/prepared, whose records hold 48 predictions, "
                                        "but data.prepared's hold 32; prepare it with --seq_len=32"):
        data_lib.load(_config(shared, longer), ["a", "b"], island="b")
    few = write_prepared(tmp_path / "few", documents=2, tokenizer=f"{shared}/tokenizer.json")
    n = len(PreparedDataset(few).records("train")) + 1  # one island more than records
    c = _config(shared)
    for k in range(n):
        c.islands[f"i{k}"] = c.islands.b.copy_and_resolve_references()
        c.islands[f"i{k}"].data = few
    with pytest.raises(DataError, match=f"islands.i0.data: the {n - 1} training records of .*few/prepared cannot be "
                                        f"split between the {n} islands that read it; prepare more text"):
        data_lib.load(c, [f"i{k}" for k in range(n)], island="i0")
    noeval = write_prepared(tmp_path / "noeval", documents=3, tokenizer=f"{shared}/tokenizer.json")
    assert PreparedDataset(noeval).manifest["splits"]["eval"]["documents"] == 0
    with pytest.raises(DataError, match="islands.b.data: the eval split of .*noeval/prepared has no record; prepare "
                                        "it with more documents or a larger --eval_fraction \\(an island with data of "
                                        "its own scores its eval split: own_eval\\)"):
        data_lib.load(_config(shared, noeval), ["a", "b"], island="b")
    os.remove(os.path.join(noeval, "token_bytes.npy"))
    with pytest.raises(DataError, match="token_bytes.npy cannot be read .*; copy the whole folder, or prepare it"):
        PreparedDataset(noeval)
    os.remove(os.path.join(few, PreparedDataset(few).manifest["splits"]["train"]["shards"][0]["file"]))
    with pytest.raises(DataError, match="islands.b.data: .*few/prepared lacks its shard .*train-00000.array_record; "
                                        "copy the whole folder, or prepare it again"):
        data_lib.load(_config(shared, few), ["a", "b"], island="b")
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(DataError, match="was prepared in format 1, .* reads format 2; prepare it again"):
        PreparedDataset(str(old))


def test_islands_join_with_who_reads_which_records():
    c = _config("/data/shared", "/data/prose")
    c.islands.c = c.islands.b.copy_and_resolve_references()
    c.islands.c.data = "/data/prose,1;~/../root/../root/x,2"
    assert sharing(c, ["a", "b", "c"]) == {
        "a": [["a:0", 0, 1, 1.0]],
        "b": [["b:0", 0, 2, 1.0]],
        "c": [["b:0", 1, 2, 1.0], ["c:1", 0, 1, 2.0]],
    }
    moved = _config("/data/shared", "/data/prose")
    moved.islands.c = c.islands.c
    moved.islands.a.data = "/data/prose"  # a now splits b's dataset with it: the plan, and the fingerprint, differ
    assert fingerprint_fields(moved)["data.sharing"] != fingerprint_fields(c)["data.sharing"]
    assert sharing(get_config(), ["a", "b"]) == {} and "data.sharing" not in fingerprint_fields(get_config())


def test_islands_reading_padded_records_send_their_routed_counts_every_round(own_run):
    config, _, workdir = own_run
    rounds = [r for r in read_jsonl(workdir / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
    assert [sorted(r["routing"]["load"]) for r in rounds] == [["a", "b"]] * config.outer.rounds
    # each shard's last record is padded: the counts cover the tokens less those positions, which the record names
    padded = [r["routing"].get("unrouted_tokens", {}) for r in rounds]
    assert any(padded) and all(0 < n < r["tokens"][name] for p, r in zip(padded, rounds) for name, n in p.items())
