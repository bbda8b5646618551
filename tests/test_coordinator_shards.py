"""A coordinator of several shards (`coordinator.shards`): the same bits as one, each shard holding its range."""

import pytest
from tiny_config import get_config, write_corpus

from island_jax.metrics import read_jsonl
from island_jax.run import run_in_process

ROUNDS = 3


def sharded_config(tmp_path, shards: int):
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.rounds = ROUNDS
    c.comm.chunk_bytes = 8192  # several chunks per payload, so that every shard owns some
    c.coordinator.shards = shards
    return c


def round_checksums(workdir, role="coordinator"):
    return [r["checksum"] for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == "round"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for shards in (1, 2):
        tmp = tmp_path_factory.mktemp(f"shards{shards}")
        out[shards] = (run_in_process(sharded_config(tmp, shards), str(tmp / "workdir")), tmp / "workdir")
    return out


def test_two_shards_end_every_round_on_the_bits_of_one(runs):
    one, two = round_checksums(runs[1][1]), round_checksums(runs[2][1])
    assert len(one) == ROUNDS and len(set(one)) == ROUNDS
    assert two == one
    for name in ("a", "b"):
        assert round_checksums(runs[2][1], f"islands/{name}") == one
    assert runs[2][0]["checksums_agree_every_round"] is True
