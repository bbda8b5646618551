"""Quorum with a grace window, late contributions, refused NaN: the coordinator's round closing."""

import numpy as np
import pytest

from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import (
    ContributionError,
    ContributionHeader,
    Coordinator,
    FragmentCoordinator,
    HandshakeError,
    StaleRoundError,
    UpdateNotReady,
)
from island_jax.model.init import checksum
from island_jax.outer import codec


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _three_islands(min_islands=2, grace=10.0, kind=FragmentCoordinator):
    """A coordinator of one float32 parameter for islands a, b and c (all joined), and its clock."""
    c = default_config()
    for name in ("a", "b", "c"):
        c.islands[name] = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False, min_islands=min_islands, grace_seconds=grace)
    clock = Clock()
    coordinator = kind(c, {"w": np.zeros(1, np.float32)}, ["a", "b", "c"], clock=clock)
    for name in ("a", "b", "c"):
        coordinator.join(name, fingerprint_fields(c), coordinator.checksum)
    return coordinator, clock


def _pg(value):
    return codec.encode({"w": np.asarray([value], np.float32)}, "none", 256)


def test_quorum_merges_after_the_grace_window_and_discards_the_late_island(caplog):
    coordinator, clock = _three_islands()
    start = coordinator.view
    assert coordinator.contribute(ContributionHeader(0, "a", 1000), _pg(0.3)) == "accepted"
    assert coordinator.contribute(ContributionHeader(0, "b", 1000), _pg(0.1)) == "accepted"  # quorum reached at t=100
    clock.now = 109.9
    assert not coordinator.poll() and coordinator.round == 0
    with pytest.raises(UpdateNotReady, match=r"waiting for \['c'\]"):
        coordinator.fetch_update(0, "a")
    clock.now = 110.0
    assert coordinator.poll() and coordinator.round == 1
    rec = coordinator.history[-1]
    assert rec.contributors == ["a", "b"] and rec.weights == {"a": 0.5, "b": 0.5}
    # Merged pseudo-gradient [0.2] (c's tokens are not in the divisor): SGD lr 1 moves w from 0 to -0.2.
    np.testing.assert_array_equal(coordinator.state()["master"]["w"], np.asarray([-0.2], np.float32))
    assert coordinator.contribute(ContributionHeader(0, "c", 1000), _pg(0.5)) == "discarded"
    assert "island c's contribution to round 0 arrived after the round closed (at 1); discarded" in caplog.text
    np.testing.assert_array_equal(coordinator.state()["master"]["w"], np.asarray([-0.2], np.float32))
    update = coordinator.fetch_update(0, "c")  # the late island applies the same update as a and b
    c_view = codec.decode_and_apply(start, update, "none", 256)
    assert checksum(c_view) == checksum(coordinator.view)
    # Round 1 goes on with all three.
    for name in ("a", "b", "c"):
        coordinator.contribute(ContributionHeader(1, name, 1000, checksum(c_view)), _pg(0.0))
    assert coordinator.round == 2


def test_all_reporting_early_merges_at_once():
    coordinator, clock = _three_islands()
    for name, v in (("a", 0.3), ("b", 0.1), ("c", 0.2)):
        coordinator.contribute(ContributionHeader(0, name, 1000), _pg(v))
    assert coordinator.round == 1 and coordinator.history[-1].contributors == ["a", "b", "c"]
    np.testing.assert_allclose(coordinator.state()["master"]["w"], [-0.2], rtol=1e-6)


def test_nan_contribution_is_refused_and_the_round_merges_the_others(caplog):
    coordinator, _ = _three_islands(min_islands=0)
    with pytest.raises(ContributionError, match="island 'a', round 0: the pseudo-gradient holds NaN"):
        coordinator.contribute(ContributionHeader(0, "a", 1000), _pg(float("nan")))
    assert "island a: round 0's pseudo-gradient holds NaN or Inf; refused" in caplog.text
    coordinator.contribute(ContributionHeader(0, "b", 1000), _pg(0.1))
    coordinator.contribute(ContributionHeader(0, "c", 3000), _pg(0.5))
    assert coordinator.round == 1 and coordinator.history[-1].contributors == ["b", "c"]
    assert coordinator.history[-1].weights == {"b": 0.25, "c": 0.75}
    np.testing.assert_allclose(coordinator.state()["master"]["w"], [-0.4], rtol=1e-6)


def test_island_several_rounds_behind_rejoins_from_the_view():
    coordinator, clock = _three_islands(min_islands=2, grace=0.0, kind=Coordinator)
    start = coordinator.view
    for r in range(2):  # a and b close rounds 0 and 1 without c
        for name in ("a", "b"):
            coordinator.contribute(ContributionHeader(r, name, 1000, coordinator.checksum), _pg(0.1 * (r + 1)))
    assert coordinator.round == 2
    assert coordinator.contribute(ContributionHeader(0, "c", 1000), _pg(0.5)) == "discarded"
    with pytest.raises(StaleRoundError, match="older than the latest merged round 1; it rejoins from the island view"):
        coordinator.fetch_update(0, "c")
    rounds, payload = coordinator.fetch_view()
    assert rounds == [2] and len(payload) == 4  # one float32, whole
    view = codec.decode_view(payload, start)
    assert checksum(view) == coordinator.checksum
    coordinator.contribute(ContributionHeader(2, "c", 1000, checksum(view)), _pg(0.0))  # c carries on from the same bits


def _at_round_two(min_islands=2, grace=1.0):
    """Three islands; a and b closed rounds 0 and 1 without c (c is behind, as after its restart)."""
    coordinator, clock = _three_islands(min_islands=min_islands, grace=grace, kind=Coordinator)
    fields = fingerprint_fields(coordinator.config)
    for r in range(2):
        for name in ("a", "b"):
            coordinator.contribute(ContributionHeader(r, name, 1000, coordinator.checksum), _pg(0.1))
        clock.now += grace
        coordinator.poll()
    assert coordinator.round == 2
    return coordinator, clock, fields


def test_a_restarted_island_is_admitted_where_a_round_waits_for_it_else_at_the_next_boundary():
    coordinator, clock, fields = _at_round_two()
    old = checksum({"w": np.zeros(1, np.float32)})  # c's checkpoint of round 0
    # round 2 has no quorum yet: c is admitted to it, and its view is ready at once
    assert coordinator.join("c", fields, old, round=0) == dict(round=2, checksum=coordinator.checksum, rejoin=True)
    assert coordinator.view_ready(2)
    # with a and b in (the quorum reached), c waits for the next boundary: round 3, once round 2 closes
    for name in ("a", "b"):
        coordinator.contribute(ContributionHeader(2, name, 1000, coordinator.checksum), _pg(0.1))
    assert coordinator.join("c", fields, old, round=0)["round"] == 3 and not coordinator.view_ready(3)
    clock.now += 1.0
    assert coordinator.poll() and coordinator.view_ready(3)
    rounds, payload = coordinator.fetch_view("c")
    assert rounds == [3] and checksum(codec.decode_view(payload, {"w": np.zeros(1, np.float32)})) == coordinator.checksum
    # at the coordinator's round with other parameters (a round it merged again after a restart): the view
    assert coordinator.join("c", fields, old, round=3) == dict(round=3, checksum=coordinator.checksum, rejoin=True)
    # at round 0 with other parameters: another initialisation, refused
    fresh, _ = _three_islands(min_islands=2, grace=1.0, kind=Coordinator)
    with pytest.raises(HandshakeError, match="has parameter checksum"):
        fresh.join("c", fields, checksum({"w": np.ones(1, np.float32)}), round=0)


def test_an_island_that_took_the_view_mid_round_gets_as_long_as_the_others_had():
    coordinator, clock, fields = _at_round_two()
    started = clock.now  # round 2 began when round 1 merged
    clock.now += 4.0  # c takes the view 4 s into the round
    coordinator.join("c", fields, "", round=0)
    coordinator.fetch_view("c")
    joined = clock.now
    clock.now += 6.0  # a and b are in 10 s after the round's start
    for name in ("a", "b"):
        coordinator.contribute(ContributionHeader(2, name, 1000, coordinator.checksum), _pg(0.1))
    took = clock.now - started
    clock.now = joined + took + 1.0 - 0.01  # the grace window (1 s) has long passed, c's own has not
    assert not coordinator.poll() and coordinator.round == 2
    clock.now = joined + took + 1.0
    assert coordinator.poll() and coordinator.fragments[0].history[-1].contributors == ["a", "b"]
    # in the next round (it trains it whole) c is an island like the others: it is in
    for name in ("a", "b", "c"):
        coordinator.contribute(ContributionHeader(3, name, 1000, coordinator.checksum), _pg(0.1))
    assert coordinator.fragments[0].history[-1].weights == {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}


def test_a_round_waiting_for_a_dead_island_fails_after_the_rejoin_timeout():
    from island_jax.roles.coordinator import _check_stalled

    coordinator, clock = _three_islands(min_islands=0, kind=Coordinator)
    coordinator.config.outer.rejoin_timeout_seconds = 30.0
    for name in ("a", "b"):
        coordinator.contribute(ContributionHeader(0, name, 1000, coordinator.checksum), _pg(0.1))
    clock.now += 30.0
    _check_stalled(coordinator.config, coordinator)  # 30 s: not yet
    clock.now += 0.5
    with pytest.raises(TimeoutError, match=r"round 1 waited 30 s for islands \['c'\] after the first contribution "
                       r"\(outer.rejoin_timeout_seconds=30\).*or lower outer.min_islands=3 \(of 3 islands\)"):
        _check_stalled(coordinator.config, coordinator)


def test_a_resent_contribution_counts_once_and_held_updates_wait_for_the_checkpoint():
    coordinator, clock = _three_islands(min_islands=0, kind=Coordinator)
    start = coordinator.checksum
    assert coordinator.contribute(ContributionHeader(0, "a", 3000, start), _pg(0.4)) == "accepted"
    assert coordinator.contribute(ContributionHeader(0, "a", 3000, start), _pg(0.4)) == "accepted"  # a retry
    coordinator.hold_updates(0)
    for name in ("b", "c"):
        coordinator.contribute(ContributionHeader(0, name, 1000, start), _pg(0.0))
    assert coordinator.round == 1
    assert coordinator.fragments[0].history[-1].weights == {"a": 0.6, "b": 0.2, "c": 0.2}
    assert coordinator.contribute(ContributionHeader(0, "a", 3000, start), _pg(0.4)) == "accepted"  # merged already
    with pytest.raises(UpdateNotReady, match="waits for the coordinator's checkpoint"):
        coordinator.fetch_update(0, "a")
    coordinator.hold_updates(None)
    update = codec.decode_view(coordinator.fetch_update(0, "a"), {"w": np.zeros(1, np.float32)})
    # one contribution of a's: the merged pseudo-gradient is 0.6 x 0.4 (float32), and SGD at lr 1 steps by it
    np.testing.assert_array_equal(update["w"], -(np.float32(0.6) * np.float32(0.4))[None])


@pytest.mark.parametrize(
    "weighting, weights, master",
    [
        # tokens 3000 and 1000: 0.75 * 0.4 + 0.25 * 0.2 = 0.35
        ("tokens", {"a": 0.75, "b": 0.25}, np.float32(-0.75) * np.float32(0.4) - np.float32(0.25) * np.float32(0.2)),
        # 1/2 each whatever the tokens: 0.5 * 0.4 + 0.5 * 0.2 = 0.3
        ("uniform", {"a": 0.5, "b": 0.5}, np.float32(-0.5) * np.float32(0.4) - np.float32(0.5) * np.float32(0.2)),
    ],
)
def test_outer_weighting_weighs_contributions_by_tokens_or_uniformly(weighting, weights, master):
    c = default_config()
    for name in ("a", "b"):
        c.islands[name] = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False, weighting=weighting)
    coordinator = FragmentCoordinator(c, {"w": np.zeros(1, np.float32)}, ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(c), coordinator.checksum)
    coordinator.contribute(ContributionHeader(0, "a", 3000), _pg(0.4))
    coordinator.contribute(ContributionHeader(0, "b", 1000), _pg(0.2))
    assert coordinator.round == 1 and coordinator.history[-1].weights == weights
    np.testing.assert_allclose(coordinator.state()["master"]["w"], [master], rtol=1e-6)


def test_an_unknown_outer_weighting_is_refused_with_the_choices():
    from island_jax.config import ConfigError, validate

    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.outer.weighting = "equal"
    with pytest.raises(ConfigError, match=r"outer.weighting is 'equal'; choose 'tokens' .* or 'uniform'"):
        validate(c)


def test_the_start_barrier_waits_for_islands_that_can_still_come_and_says_why():
    c = default_config()
    for name in ("a", "b", "c"):
        c.islands[name] = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    clock = Clock()
    coordinator = Coordinator(c, {"w": np.zeros(1, np.float32)}, ["a", "b", "c"], clock=clock)
    fields = fingerprint_fields(c)
    assert coordinator.barrier_waits_for(set()) == dict.fromkeys("abc", "has not joined yet")
    coordinator.join("a", fields, coordinator.checksum)
    assert coordinator.barrier_waits_for({"a"}) == dict.fromkeys("bc", "has not joined yet")
    coordinator.join("b", fields, coordinator.checksum)
    assert coordinator.barrier_waits_for({"a"}) == {"b": "joined, not ready yet (evaluating or compiling)",
                                                    "c": "has not joined yet"}
    coordinator.join("c", fields, "0123456789abcdef", round=3)  # ahead of a restarted coordinator: it rejoins
    assert coordinator.barrier_waits_for({"a", "b"}) == {}
    clock.now += 1e6  # every island is needed (outer.min_islands 0): the barrier never gives up on one
    assert coordinator.barrier_waits_for({"a"}) == {"b": "joined, not ready yet (evaluating or compiling)"}


def test_resumed_with_a_quorum_the_start_barrier_waits_the_grace_window_for_the_rest():
    coordinator, clock = _three_islands(min_islands=2, grace=10.0, kind=Coordinator)
    clock.now += 100.0  # a new run waits for every island, however long
    assert coordinator.barrier_waits_for({"a", "b"}) == {"c": "joined, not ready yet (evaluating or compiling)"}
    for name in ("a", "b", "c"):  # round 1 merged: as after a restart from its checkpoint
        coordinator.contribute(ContributionHeader(0, name, 1000, coordinator.checksum), _pg(0.1))
    assert coordinator.round == 1
    assert coordinator.barrier_waits_for({"a"}) == dict.fromkeys("bc", "joined, not ready yet (evaluating or compiling)")
    clock.now += 100.0  # no quorum yet: no grace window runs
    assert coordinator.barrier_waits_for({"a", "b"}) == {"c": "joined, not ready yet (evaluating or compiling)"}
    clock.now += 9.5
    assert coordinator.barrier_waits_for({"a", "b"}) == {"c": "joined, not ready yet (evaluating or compiling)"}
    clock.now += 0.5
    assert coordinator.barrier_waits_for({"a", "b"}) == {}
