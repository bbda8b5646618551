"""A restarted island replays the rounds it missed (`outer.rejoin = "replay"`) and the run ends on the bits of the
run that was not interrupted; where it cannot match (a digest differs, a quorum went on without it) it takes the
view and says why. Every role runs in this process; an island "killed" at a round (`crash_at_round`) is started
again on a fresh thread with the same workdir, as a launcher's restart would."""

import os
import threading

import jax
import pytest
from tiny_config import get_config, write_corpus

from island_jax.comm.inprocess import InProcessExchange
from island_jax.coordinator.replay import KeptUpdates, replay_window
from island_jax.coordinator.shards import LocalBus
from island_jax.island.replay import ReplayEnded, ReplayPlan, short_reason
from island_jax.metrics import read_jsonl
from island_jax.protocol import ContributionHeader
from island_jax.roles.coordinator import run_coordinator
from island_jax.roles.island import run_island
from island_jax.workdir import combine_summaries

ROUNDS = 6


def replay_config(tmp_path, rounds=ROUNDS):
    """The tiny two-island run with every island needed and checkpoints every 2 rounds."""
    c = get_config()
    c.data.files = write_corpus(tmp_path / "corpus")
    c.outer.update(rounds=rounds, min_islands=0)
    c.checkpoint.every_rounds = 2
    c.eval.every_rounds = rounds
    return c


def run_restarting(config, workdir, kills: dict[str, list[int]] | None = None, hook=None) -> dict:
    """Every role of the run on threads of this process; island NAME fails as each round of `kills[NAME]`
    starts (after the previous one merged) and is started again at once. `hook(name, attempt, config)` may change
    a restarted island's config. Returns the run's combined summary."""
    kills = {name: list(rounds) for name, rounds in (kills or {}).items()}
    shards = config.coordinator.shards
    exchanges, lock, errors = [InProcessExchange() for _ in range(shards)], threading.Lock(), []
    exchange = exchanges[0] if shards == 1 else exchanges
    bus = LocalBus() if shards > 1 else None
    devices, at = {}, 0
    for name, cfg in config.islands.items():
        devices[name], at = jax.devices()[at : at + cfg.num_devices], at + cfg.num_devices

    def island(name):
        attempt = 0
        while True:
            cfg = config.copy_and_resolve_references()
            todo = kills.get(name, [])
            cfg.islands[name].crash_at_round = todo.pop(0) if todo else 0
            if hook is not None:
                hook(name, attempt, cfg)
            try:
                return run_island(cfg, str(workdir), name, exchange, devices[name], lock, allow_config_change=True)
            except RuntimeError as e:
                if "on purpose" not in str(e):
                    raise
                attempt += 1

    def role(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised on the test's thread
            errors.append(e)
            for ex in exchanges:
                ex.abort(repr(e))

    threads = [threading.Thread(target=role, args=(run_coordinator, config, str(workdir), ex, False, False, k, None,
                                                   bus)) for k, ex in enumerate(exchanges)]
    threads += [threading.Thread(target=role, args=(island, name)) for name in config.islands.keys()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return combine_summaries(config, str(workdir), 0.0)


def records(workdir, role, kind):
    return [r for r in read_jsonl(workdir / role / "metrics.jsonl") if r["kind"] == kind]


def view_checksums(workdir):
    return {r["round"]: r["checksum"] for r in records(workdir, "coordinator", "round")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    config = replay_config(tmp)
    summary = run_restarting(config, tmp / "workdir")
    return config, summary, tmp / "workdir"


def test_an_island_killed_after_a_merge_replays_to_the_uninterrupted_bits(straight, tmp_path):
    config, want, straight_dir = straight
    workdir = tmp_path / "killed"
    summary = run_restarting(config, workdir, kills=dict(b=[4]))  # round 3 merged; its checkpoint is of round 2
    assert view_checksums(workdir) == view_checksums(straight_dir)
    assert summary["eval_loss_final"] == want["eval_loss_final"]
    assert summary["checksums_agree"] is True
    replays = [r for r in records(workdir, "islands/b", "rejoin")]
    assert [(r["source"], r["rounds_before"], r["round"], r["replayed"]) for r in replays] == [("replay", 2, 3, 1)]
    assert [r["round"] for r in records(workdir, "islands/b", "round") if r.get("replayed")] == [3]
    assert summary["islands"]["b"]["rounds_replayed"] == 1 and summary["islands"]["b"]["rejoin_bitwise"] is True
    assert summary["islands"]["a"]["rounds_replayed"] == 0 and summary["islands"]["a"]["rejoin_bitwise"] is None


def test_an_island_killed_right_after_its_checkpoint_has_nothing_to_replay_and_ends_on_the_same_bits(straight, tmp_path):
    config, want, straight_dir = straight
    summary = run_restarting(config, tmp_path / "at_checkpoint", kills=dict(b=[5]))  # as round 5 starts: saved 4
    assert view_checksums(tmp_path / "at_checkpoint") == view_checksums(straight_dir)
    assert summary["eval_loss_final"] == want["eval_loss_final"]
    assert records(tmp_path / "at_checkpoint", "islands/b", "rejoin") == []  # at the run's round: it trains on
    assert summary["islands"]["b"]["rounds_replayed"] == 0 and summary["islands"]["b"]["rejoin_bitwise"] is None


def test_a_digest_mismatch_ends_the_replay_in_the_view_and_the_record_says_why(straight, tmp_path):
    config, _, straight_dir = straight
    workdir = tmp_path / "mismatch"

    def hook(name, attempt, cfg):
        if name == "b" and attempt == 1:  # the restarted island computes other bits: another inner setting
            cfg.inner.learning_rate = cfg.inner.learning_rate * 0.5

    summary = run_restarting(config, workdir, kills=dict(b=[4]), hook=hook)
    assert summary["checksums_agree"] is True
    assert view_checksums(workdir)[3] == view_checksums(straight_dir)[3]  # merged before the kill
    rejoins = records(workdir, "islands/b", "rejoin")
    assert [(r["source"], r["round"], r["replayed"]) for r in rejoins] == [("view", 3, 0)]
    assert rejoins[0]["reason"].startswith("digest mismatch at round 3: ")
    assert [r["rejoin"] for r in records(workdir, "islands/b", "round") if "rejoin" in r] == [
        "view (digest mismatch at round 3)"]
    assert summary["islands"]["b"]["rejoin_bitwise"] is False


def test_the_coordinator_keeps_the_updates_of_the_replay_window_on_disk(straight):
    config, _, workdir = straight
    kept = KeptUpdates(str(workdir / "coordinator" / "kept"), config)
    # islands save every 2 rounds and keep 2: after 6 rounds they hold 6 and 4, after 5 rounds 4 and 2
    assert [replay_window(config, r) for r in range(1, 7)] == [0, 0, 0, 2, 2, 4]
    assert kept.rounds() == [(4, 0), (5, 0)]
    record = kept.records("b")[0]
    b = config.islands.b
    assert (record["round"], record["merged_with"], record["tokens"]) == (4, True, b.batch_size * 32 * b.inner_steps)
    assert len(record["chunks"]) == 1 and len(next(iter(record["chunks"].values()))) == 64


def test_a_plan_refuses_a_round_merged_without_the_island_and_other_bits():
    records = [dict(round=0, fragment=0, merged_with=True, tokens=64, tau=None, chunks={"0": "aa", "1": "bb"}),
               dict(round=1, fragment=0, merged_with=False, tokens=0, tau=None, chunks={})]
    plan = ReplayPlan(records, 0, 2, 1, 32)
    # kept up to the run's round, or up to a round merged without the island (the replay ends there)
    assert ReplayPlan.covers(records, 0, 2, 1) and ReplayPlan.covers(records, 0, 5, 1)
    assert not ReplayPlan.covers(records[:1], 0, 2, 1) and not ReplayPlan.covers(records, 0, 1, 2)
    assert plan.steps(0, 0) == 2 and plan.round_steps(0, 10, [10]) == 2 and plan.due(0, 12, [10], set()) == [0]
    plan.check(ContributionHeader(0, "b", 64, fragment=0), {0: "aa", 1: "bb"})
    with pytest.raises(ReplayEnded, match="digest mismatch at round 1: 1 of 2 chunks differ") as e:
        plan.check(ContributionHeader(0, "b", 64, fragment=0), {0: "aa", 1: "cc"})
    assert short_reason(str(e.value)) == "digest mismatch at round 1"
    assert short_reason("process 1 of the island: " + str(e.value)) == "digest mismatch at round 1"
    with pytest.raises(ReplayEnded, match="round 2 merged without it") as e:
        plan.check(ContributionHeader(1, "b", 64, fragment=0), {})
    assert short_reason(str(e.value)) == "round 2 merged without it"


def test_streaming_fragments_with_overlap_and_int4_error_feedback_replay_to_the_same_bits(tmp_path):
    config = replay_config(tmp_path)
    config.outer.update(fragments=2, overlap_steps=1)
    config.codec.update(kind="int4", error_feedback=True)
    config.islands.a.inner_steps = config.islands.b.inner_steps = 4  # fragment 0 after step 2, fragment 1 after 4
    straight = run_restarting(config, tmp_path / "straight")
    workdir = tmp_path / "killed"
    summary = run_restarting(config, workdir, kills=dict(b=[4, 6]))  # replays round 3, then round 5
    assert {(r["round"], r.get("fragment")): r["checksum"] for r in records(workdir, "coordinator", "round")} == {
        (r["round"], r.get("fragment")): r["checksum"] for r in records(tmp_path / "straight", "coordinator", "round")}
    assert summary["eval_loss_final"] == straight["eval_loss_final"]
    # b's last contribution of round 3 (fragment 1, sent as the round ends) is in before the kill or not: the run is
    # then at round 3, or at round 2 with fragment 0 of round 3 merged; b replays from its checkpoint of round 2 alike
    first, second = [(r["source"], r["rounds_before"], r["round"]) for r in records(workdir, "islands/b", "rejoin")]
    assert first in {("replay", 2, 3), ("replay", 2, 2)} and second == ("replay", 4, 5)
    # the residual error feedback carries is in the checkpoints: the last ones equal the uninterrupted run's
    last = {r["round"]: r["checksums"] for r in records(tmp_path / "straight", "islands/b", "checkpoint")}
    assert records(workdir, "islands/b", "checkpoint")[-1]["checksums"] == last[ROUNDS]
    assert "residual" in last[ROUNDS]


def test_a_quorum_run_replays_up_to_the_first_round_merged_without_the_island_then_takes_the_view(tmp_path):
    config = replay_config(tmp_path, rounds=8)
    config.outer.update(min_islands=1, grace_seconds=2.0)
    merged = tmp_path / "quorum" / "coordinator" / "metrics.jsonl"

    def away_for_two_rounds(name, attempt, cfg):
        if name == "b" and attempt == 1:  # killed as round 4 starts; back once rounds 4 and 5 merged without it
            while not any(r["kind"] == "round" and r["round"] >= 5 for r in read_jsonl(merged)):
                threading.Event().wait(0.1)

    summary = run_restarting(config, tmp_path / "quorum", kills=dict(b=[4]), hook=away_for_two_rounds)
    assert summary["checksums_agree"] is True
    rejoins = records(tmp_path / "quorum", "islands/b", "rejoin")
    assert [(r["source"], r["rounds_before"], r["replayed"]) for r in rejoins] == [("view", 4, 1)]
    assert rejoins[0]["reason"].startswith("round 4 merged without it: ")
    assert summary["islands"]["b"]["rounds_replayed"] == 1 and summary["islands"]["b"]["rejoin_bitwise"] is False


def test_with_rejoin_view_a_view_fetch_cut_by_a_coordinator_restart_is_made_again(straight, tmp_path, monkeypatch):
    """`outer.rejoin = "view"`: the restarted island takes the view at once (not bitwise). Its view fetch, in flight
    when the coordinator restarts, is followed by a join to the restarted coordinator and a fetch again."""
    from island_jax.comm.inprocess import InProcessTransport
    from island_jax.protocol import CoordinatorRestarted

    config, _, _ = straight
    config = config.copy_and_resolve_references()
    config.outer.rejoin = "view"
    real, cut = InProcessTransport.fetch_view, []

    def cut_once(self, island, min_round=0, needed=None):
        if not cut:
            cut.append(island)
            raise CoordinatorRestarted(min_round, "fetch the island view: the coordinator restarted")
        return real(self, island, min_round, needed)

    monkeypatch.setattr(InProcessTransport, "fetch_view", cut_once)
    summary = run_restarting(config, tmp_path / "view", kills=dict(b=[4]))
    assert cut == ["b"] and summary["checksums_agree"] is True
    assert [(r["source"], r["rounds_before"], r["round"]) for r in records(tmp_path / "view", "islands/b", "rejoin")] == [
        ("view", 2, 3)]
    assert summary["islands"]["b"]["rejoin_bitwise"] is False and summary["islands"]["b"]["rounds_replayed"] == 0
    assert not (tmp_path / "view" / "coordinator" / "kept").exists()  # nothing kept for replays


def test_kept_updates_live_on_disk_survive_a_reopen_and_a_restore_discards_the_rounds_merged_again(tmp_path):
    config = replay_config(tmp_path)
    kept = KeptUpdates(str(tmp_path / "kept"), config)
    for r in range(3):  # islands keep 2 checkpoints, every 2 rounds: after 3 rounds they may still restart at 0
        kept.keep(r, 0, {0: bytes([r]) * 3, 1: bytes([r + 10]) * 2}, {"a": dict(tokens=64, tau=None, chunks={0: "x"})})
    again = KeptUpdates(str(tmp_path / "kept"), config)  # a restarted coordinator opens the same folder
    assert again.rounds() == [(0, 0), (1, 0), (2, 0)]
    assert again.chunks(2, 0) == {0: b"\x02\x02\x02", 1: b"\x0c\x0c"} and again.chunks(3, 0) is None
    assert [(r["round"], r["merged_with"]) for r in again.records("b")] == [(r, False) for r in range(3)]
    assert [(r["round"], r["chunks"]) for r in again.records("a")][0] == (0, {"0": "x"})
    again.discard_from(0, 1)  # restored at round 1: rounds 1 and 2 are merged again
    assert sorted(os.listdir(tmp_path / "kept")) == ["00000000-0.json", "00000000-0.update"]
    again.keep(5, 0, {0: b"z"}, {})  # after 6 rounds the oldest checkpoint an island holds is of round 4
    assert again.rounds() == [(5, 0)]


def test_with_two_coordinator_shards_an_island_replays_each_shards_range_to_the_same_bits(tmp_path):
    """Each shard keeps its range's updates and digests; the island checks its chunks against every shard's."""
    config = replay_config(tmp_path)
    config.coordinator.shards = 2
    config.comm.chunk_bytes = 8192  # the tiny model's payload in several chunks: both shards own a range
    straight = run_restarting(config, tmp_path / "straight")
    summary = run_restarting(config, tmp_path / "killed", kills=dict(b=[4]))
    assert view_checksums(tmp_path / "killed") == view_checksums(tmp_path / "straight")
    assert summary["eval_loss_final"] == straight["eval_loss_final"]
    assert [(r["source"], r["replayed"]) for r in records(tmp_path / "killed", "islands/b", "rejoin")] == [("replay", 1)]
    assert (tmp_path / "killed" / "coordinator-shard-1" / "kept").is_dir()
