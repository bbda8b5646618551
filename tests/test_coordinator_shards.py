"""A coordinator of several shards (`coordinator.shards`): the same bits as one, each shard holding its range."""

import os
from concurrent import futures

import jax
import numpy as np
import pytest
from test_checkpoint import damage
from tiny_config import get_config, write_corpus

from island_jax.checkpoint import CheckpointCorrupt
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionError, ContributionHeader, Coordinator, HandshakeError
from island_jax.coordinator.shards import LocalBus, Shard, ShardError
from island_jax.metrics import read_jsonl
from island_jax.outer import codec
from island_jax.roles.checkpoint_sets import commits_dir, restorable
from island_jax.roles.coordinator import run_coordinator
from island_jax.run import run_in_process
from island_jax.workdir import coordinator_dir, open_role

ROUNDS = 3


def sharded_config(tmp_path, shards: int):
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.rounds = ROUNDS
    c.comm.chunk_bytes = 8192  # several chunks per payload, so that every shard owns some
    c.coordinator.shards = shards
    c.outer.expert_weighting = "tokens_routed"  # every share's header carries the routed counts to every shard
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
    # the leader's record: the per-expert weights, and the routing diagnostics from every shard's sums, as one's
    records = {k: [r for r in read_jsonl(runs[k][1] / "coordinator" / "metrics.jsonl") if r["kind"] == "round"]
               for k in (1, 2)}
    for one_record, two_record in zip(records[1], records[2]):
        assert two_record["expert_weights"] == one_record["expert_weights"]
        assert two_record["routing"] == one_record["routing"] and "router_distance" in one_record["routing"]


# -- shards by hand: K coordinators of one process over a LocalBus ----------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _params():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((1024, 512)).astype(np.float32), "v": rng.standard_normal(700).astype(np.float32)}


def _config(islands=("a", "b", "c"), min_islands=0, grace=10.0):
    c = default_config()
    for name in islands:
        c.islands[name] = island(1, 1, 1, 1, 1)
    c.codec.update(kind="int8", block_size=64)
    c.comm.chunk_bytes = 65536  # 9 chunks: the 700 of v, and 65,536 codes of w each (with their scales)
    c.outer.update(min_islands=min_islands, grace_seconds=grace)
    return c


def _coordinators(config, shards, clock):
    """`shards` coordinators of one run over one LocalBus (one process), every island joined."""
    bus, names = LocalBus(), list(config.islands.keys())
    made = [Coordinator(config, _params(), names, clock=clock, shard=Shard(k, shards, bus, timeout=5.0) if shards > 1
                        else None) for k in range(shards)]
    for c in made:  # the leader admits; the others only learn of the island
        for name in names:
            c.join(name, fingerprint_fields(config), made[0].checksum)
    return made


def _payload(seed):
    rng = np.random.default_rng(seed)
    tree = {k: 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in _params().items()}
    return codec.encode(tree, "int8", 64)


def _contribute(c, round, island, seed, tokens=1000):
    return c.contribute(ContributionHeader(round, island, tokens), _payload(seed))


def _merge(coordinators, round, island="a", seed=1):
    """`island`'s contribution of `round` on every shard, then their polls until each merged it."""
    for c in coordinators:
        _contribute(c, round, island, seed)
    for c in coordinators:  # the leader closes the round once its contribution is complete on every shard
        c.poll()
    assert [c.round for c in coordinators] == [round + 1] * len(coordinators)


def test_every_shard_merges_the_leaders_set_even_an_island_that_reached_one_shard_in_time():
    clock = Clock()
    config = _config(min_islands=2)
    leader, other = _coordinators(config, 2, clock)
    (single,) = _coordinators(config, 1, clock)
    for c in (leader, other, single):
        assert _contribute(c, 0, "a", 1) == "accepted" and _contribute(c, 0, "b", 2) == "accepted"
    assert _contribute(leader, 0, "a", 1) == "accepted"  # a retry, of a contribution in: counted once
    assert _contribute(other, 0, "c", 3) == "accepted"  # c reaches shard 1 before the quorum closes
    assert not leader.poll() and not other.poll()  # the grace window is open; shard 1 waits for the leader's set
    clock.now = 110.0
    assert leader.poll() and leader.round == 1  # closed without c: complete on shard 1 only
    assert other.poll() and other.round == 1  # merged the leader's set, not its own
    assert _contribute(leader, 0, "c", 3) == "discarded"  # and c reaches shard 0 after the close
    assert single.poll() and single.fragments[0].history[-1].contributors == ["a", "b"]
    for c in (leader, other):
        assert c.fragments[0].history[-1].contributors == ["a", "b"]
        assert c.fragments[0].history[-1].checksum == single.fragments[0].history[-1].checksum
    assert leader.checksum == single.checksum
    # the update each island fetches is the two shards' chunks put together: the single coordinator's bytes
    joined = np.frombuffer(leader.fetch_update(0, "a"), np.uint8) | np.frombuffer(other.fetch_update(0, "a"), np.uint8)
    assert joined.tobytes() == single.fetch_update(0, "a")
    # so is the view a rejoining island takes, each shard's range of it put together
    (r0, view0), (r1, view1) = leader.fetch_view(), other.fetch_view()
    assert r0 == r1 == single.fetch_view()[0] == [1]
    assert (np.frombuffer(view0, np.uint8) | np.frombuffer(view1, np.uint8)).tobytes() == single.fetch_view()[1]
    record = leader.complete_record(leader.fragments[0].history[-1], 0)
    assert record.update_bytes == single.fragments[0].history[-1].update_bytes == len(single.fetch_update(0, "a"))


def _held_bytes(c) -> int:
    """Bytes of the master rows, outer optimizer state and view rows a coordinator holds (each array once)."""
    state = c.fragments[0]._state
    arrays = {id(x): x for x in [*state.master_rows, *state.view_rows, *jax.tree.leaves(state.opt)] if x is not None}
    return sum(np.asarray(x).nbytes for x in arrays.values())


def test_each_of_two_shards_holds_half_the_rows_within_one_chunk():
    clock = Clock()
    config = _config(islands=("a",))
    (single,) = _coordinators(config, 1, clock)
    shards = _coordinators(config, 2, clock)
    _merge([single], 0)  # after a merge, master and view are arrays of their own
    _merge(shards, 0)
    plan = single.fragments[0].plan
    per_chunk = _held_bytes(single) // len(plan)  # every chunk's rows are padded to the same count
    assert len(plan) == 9 and [c.fragments[0].owned for c in shards] == [range(5), range(5, 9)]
    for c in shards:
        assert abs(_held_bytes(c) - _held_bytes(single) / 2) <= per_chunk
        assert sum(x is not None for x in c.fragments[0]._state.master_rows) == len(c.fragments[0].owned)


def _agree(config, workdir, shards=2):
    """Every shard's `restorable` round, agreed over a fresh bus as a restarted shard job agrees."""
    bus = LocalBus()
    roles = [open_role(config, coordinator_dir(str(workdir), k), coordinator=True) for k in range(shards)]
    with futures.ThreadPoolExecutor(shards) as pool:
        return list(pool.map(lambda k: restorable(Shard(k, shards, bus, timeout=5.0), roles[k], str(workdir), 5.0),
                             range(shards))), roles


def test_shard_checkpoints_restore_what_each_held_and_a_set_missing_a_part_is_not_used(tmp_path):
    clock = Clock()
    config = _config(islands=("a",))
    config.checkpoint.max_to_keep = 3
    shards = _coordinators(config, 2, clock)
    workdir = tmp_path / "workdir"
    roles = [open_role(config, coordinator_dir(str(workdir), k), coordinator=True) for k in range(2)]
    held, checksums = {}, {}
    for r in (1, 2, 3):
        _merge(shards, r - 1, seed=10 + r)
        checksums[r] = shards[0].checksum
        for k, (c, role) in enumerate(zip(shards, roles)):
            held[(k, r)] = [np.asarray(x).copy() for x in jax.tree.leaves(c.state())]
            assert role.checkpoints.save(r, c.state(), force=True)
            role.checkpoints.rounds(wait=True)
        if r < 3:  # the set of round 3 is never committed: shard 0 died before it saw shard 1's part
            os.makedirs(commits_dir(str(workdir)), exist_ok=True)
            open(os.path.join(commits_dir(str(workdir)), str(r)), "w").close()
    for role in roles:
        role.close()
    assert _agree(config, workdir)[0] == [2, 2]
    # every shard restores the bytes it held at round 2, into a shard made afresh; its later parts are discarded
    fresh = _coordinators(config, 2, clock)
    agreed, again = _agree(config, workdir)
    for k, (c, role) in enumerate(zip(fresh, again)):
        assert role.checkpoints.rounds() == [1, 2]
        c.load_state(role.checkpoints.restore(c.state(), round=2))
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(c.state()), held[(k, 2)]))
        assert c.round == 2
    assert fresh[0].checksum == checksums[2] != checksums[3]
    for role in again:
        role.close()
    # shard 1's part of round 2 is damaged: named, set aside, and the shards agree on round 1's set
    damage(os.path.join(workdir, "coordinator-shard-1", "checkpoints"), 2, nbytes=512)
    agreed, again = _agree(config, workdir)
    with pytest.raises(CheckpointCorrupt, match="the checkpoint of round 2 in .*coordinator-shard-1.* is damaged"):
        again[1].checkpoints.restore(fresh[1].state(), round=2)
    for role in again:
        role.close()
    agreed, again = _agree(config, workdir)
    assert agreed == [1, 1]
    for role in again:
        role.close()


def test_a_shard_whose_address_list_or_index_disagrees_with_the_config_is_refused_before_serving(tmp_path):
    config = sharded_config(tmp_path, 2)
    workdir = tmp_path / "workdir"
    with pytest.raises(ShardError) as raised:
        run_coordinator(config, str(workdir), "localhost:5", shard=1)
    assert str(raised.value) == (
        "--coordinator lists 1 addresses (localhost:5) but coordinator.shards is 2; give one HOST:PORT per shard, "
        "shard 0 first, or set coordinator.shards to the list's length")
    with pytest.raises(ShardError, match=r"^--shard=2 but coordinator.shards is 2; give a shard from 0 to 1$"):
        run_coordinator(config, str(workdir), "localhost:5,localhost:6", shard=2)
    with pytest.raises(ShardError, match=r"give --shard_service=HOST:PORT"):
        run_coordinator(config, str(workdir), "localhost:5,localhost:6", shard=1)
    assert not workdir.exists()  # refused before anything was written


def test_an_island_with_another_shard_count_is_refused_naming_the_setting():
    clock = Clock()
    config = _config(islands=("a",))
    config.coordinator.shards = 2
    leader, _ = _coordinators(config, 2, clock)
    theirs = _config(islands=("a",))
    with pytest.raises(HandshakeError, match=r"coordinator\.shards \(theirs None, here 2\)"):
        leader.join("a", fingerprint_fields(theirs), leader.checksum)


def test_a_shard_started_with_other_settings_than_shard_0_is_refused_naming_them():
    bus = LocalBus()
    ours = {"coordinator.shards": 2, "--coordinator": ["h0:1", "h1:1"]}
    Shard(0, 2, bus).check_settings(ours, 1.0)
    Shard(1, 2, bus).check_settings(dict(ours), 1.0)  # the same: it serves
    with pytest.raises(ShardError) as raised:
        Shard(1, 3, bus).check_settings({"coordinator.shards": 3, "--coordinator": ["h0:1", "h1:1", "h2:1"]}, 1.0)
    assert str(raised.value) == (
        "shard 1 disagrees with shard 0: --coordinator is ['h0:1', 'h1:1', 'h2:1'] here but ['h0:1', 'h1:1'] on "
        "shard 0; coordinator.shards is 3 here but 2 on shard 0; start every shard with the same config and "
        "--coordinator list")


def test_a_contribution_one_shard_refused_or_held_whole_decides_alike_on_every_shard():
    clock = Clock()
    leader, other = _coordinators(_config(islands=("a", "b", "c")), 2, clock)
    for c in (leader, other):
        _contribute(c, 0, "a", 1)
        _contribute(c, 0, "b", 2)
    nan = codec.encode({k: np.full(v.shape, np.nan, np.float32) for k, v in _params().items()}, "int8", 64)
    with pytest.raises(ContributionError, match="NaN or Inf"):  # c's range on shard 1 holds NaN; none reaches 0
        other.contribute(ContributionHeader(0, "c", 1000), nan)
    # a failed retry of b's share on shard 1 would drop it, but shard 1 said it holds b whole: kept
    other.fragments[0].abandon("b", "a retried share failed", keep_complete=False)
    assert leader.poll() and other.poll()  # c is out on every shard, without waiting for its grace window
    for c in (leader, other):
        assert c.round == 1 and c.fragments[0].history[-1].contributors == ["a", "b"]
    assert leader.checksum == other.checksum
