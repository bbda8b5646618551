"""Quorum with a grace window, late contributions, refused NaN: the coordinator's round closing."""

import numpy as np
import pytest

from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import (
    ContributionError,
    ContributionHeader,
    Coordinator,
    FragmentedCoordinator,
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


def _three_islands(min_islands=2, grace=10.0, kind=Coordinator):
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
    coordinator, clock = _three_islands(min_islands=2, grace=0.0, kind=FragmentedCoordinator)
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
