"""The per-expert merge weights (`coordinator.expert_merge`) and the checks of a contribution's routed counts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionError, ContributionHeader, Coordinator
from island_jax.coordinator.contribution import Contribution
from island_jax.coordinator.expert_merge import check_routed_counts, expert_leaves, expert_merge_weights
from island_jax.coordinator.partial_merge import PartialMerge, merge_weights
from island_jax.coordinator.routing import (
    expert_load,
    js_divergence,
    round_diagnostics,
    topk_overlap,
    utilization_entropy,
)
from island_jax.coordinator.state import FragmentState
from island_jax.island import step as step_lib
from island_jax.island.placement import Shardings
from island_jax.mesh import island_mesh
from island_jax.metrics import scalars
from island_jax.model.init import init_params
from island_jax.outer import codec
from island_jax.outer.optimizer import outer_optimizer
from island_jax.protocol import ExchangeError


def test_an_expert_is_weighted_by_the_assignments_routed_to_it_and_other_leaves_by_tokens():
    # one MoE layer, k = 1, 2 experts: a trained on 40 tokens, b on 10; a routed (30, 10), b (10, 0)
    contributions = [Contribution("a", 40), Contribution("b", 10)]
    routed = {"a": check_routed_counts([[30, 10]], 1, 2, 40, 1), "b": check_routed_counts([[10, 0]], 1, 2, 10, 1)}
    weights = expert_merge_weights(routed)
    assert list(weights) == ["a", "b"]
    assert weights["a"].tolist() == [[0.75, 1.0]] and weights["b"].tolist() == [[0.25, 0.0]]
    assert merge_weights(contributions, "tokens") == {"a": 0.8, "b": 0.2}  # the router and shared leaves


def test_an_expert_no_island_routed_to_gets_weight_zero_from_every_island():
    weights = expert_merge_weights({"a": np.array([[4, 0, 2]]), "b": np.array([[1, 0, 5]])})
    assert weights["a"].tolist() == [[0.8, 0.0, 2 / 7]] and weights["b"].tolist() == [[0.2, 0.0, 5 / 7]]


@pytest.mark.parametrize("tokens", [(40, 10), (3, 7, 11), (1000, 1)])
def test_counts_in_proportion_to_tokens_give_the_token_weights_bit_for_bit(tokens):
    names = "abc"[: len(tokens)]
    shares = merge_weights([Contribution(n, t) for n, t in zip(names, tokens)], "tokens")
    # two layers, top_k 2, four experts: island k covers 4 t_k tokens and routes pattern x t_k assignments
    pattern = np.array([[3, 1, 0, 4], [2, 2, 2, 2]])
    routed = {n: check_routed_counts(pattern * t, 2, 4, 4 * t, 2) for n, t in zip(names, tokens)}
    weights = expert_merge_weights(routed)
    for n in names:
        expected = np.where(pattern > 0, shares[n], 0.0)
        assert weights[n].tobytes() == expected.tobytes(), n


@pytest.mark.parametrize(
    "counts, match",
    [
        ([[30, 10], [20, 20]], r"shape \[2, 2\]; the model has 1 MoE layers of 2 experts: send \[1, 2\] integers"),
        ([[30, 10, 0]], r"shape \[1, 3\]; the model has 1 MoE layers of 2 experts"),
        ([[41, -1]], r"layer 0, expert 1 is -1; counts are assignments and cannot be negative"),
        ([[30, 9]], r"layer 0 sum to 39; 40 tokens routed to 1 experts each make 40"),
        ([[30.0, 10.0]], r"routed counts are float64; send integers"),
    ],
)
def test_counts_of_the_wrong_shape_sign_or_sum_are_refused(counts, match):
    with pytest.raises(ValueError, match=match):
        check_routed_counts(counts, 1, 2, 40, 1)


def test_counts_of_different_shapes_or_no_contributors_are_refused():
    with pytest.raises(ValueError, match="routed counts of different shapes"):
        expert_merge_weights({"a": np.zeros((1, 2), np.int64), "b": np.zeros((2, 2), np.int64)})
    with pytest.raises(ValueError, match="a merge needs at least one contribution"):
        expert_merge_weights({})


# -- through the coordinator: one MoE layer of 2 experts, k = 1 ----------------------------------------------

D, F = 4, 8  # d_model, expert hidden width: an expert's slice (32 elements) is part of a row (256): per element
ROWS = 16, 32  # ... and one of 512 elements, two whole rows: per row


def _moe_config(expert_weighting, momentum=0.0, kind="none", width=(D, F)):
    c = default_config()
    c.model.update(num_layers=1, d_model=width[0])
    c.moe.update(num_experts=2, num_experts_per_token=1, every_n_layers=1, expert_hidden_dim=width[1])
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.update(kind=kind, topk_group=64, topk_k=16)
    c.outer.update(learning_rate=1.0, momentum=momentum, nesterov=False, expert_weighting=expert_weighting)
    return c


def _params(width=(D, F)):
    """A per-layer parameter tree with one MoE layer (router, 2 routed experts of `width` (d_model, hidden)) and
    an embedding."""
    D, F = width
    rng = np.random.default_rng(0)
    leaf = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return {"blocks": {0: {"moe": {"router": leaf(D, 2), "w_gate": leaf(2, D, F), "w_up": leaf(2, D, F),
                                   "w_down": leaf(2, F, D)}}}, "embedding": leaf(16, D)}


def _merge(config, pseudo_gradients, tokens, routed, width=(D, F)):
    """A coordinator of `_params(width)` after one round of the islands' `pseudo_gradients` (pytrees)."""
    params = _params(width)
    coordinator = Coordinator(config, params, ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(config), coordinator.checksum)
    for name in ("a", "b"):
        payload = codec.encode(pseudo_gradients[name], codec.Codec.of(config.codec))
        coordinator.contribute(ContributionHeader(0, name, tokens[name], routed_counts=routed[name]), payload)
    return coordinator


def _master(coordinator):
    """The coordinator's master parameters (one fragment) as `_params()`' tree."""
    return jax.tree.unflatten(jax.tree.structure(_params()), list(coordinator.fragments[0].state()["master"]))


def _pseudo_gradients(fill, width=(D, F)):
    """Each leaf of `_params(width)` filled with `fill[island]` (whole numbers: every weighted sum below is exact)."""
    return {n: jax.tree.map(lambda x, v=v: np.full(x.shape, v, np.float32), _params(width)) for n, v in fill.items()}


@pytest.mark.parametrize("width, per_row", [((D, F), False), (ROWS, True)], ids=["per_element", "per_row"])
def test_the_coordinator_merges_each_expert_by_its_routed_counts_and_other_leaves_by_tokens(width, per_row):
    start = _params(width)
    pgs = _pseudo_gradients({"a": 4.0, "b": 8.0}, width)
    config = _moe_config("tokens_routed", width=width)
    coordinator = _merge(config, pgs, {"a": 40, "b": 10}, {"a": [[30, 10]], "b": [[10, 0]]}, width)
    state = coordinator.fragments[0]._state
    slots = state.expert_slots[0]  # the one chunk's weight slot per row, or per element
    assert slots.size == state.num_rows * (1 if per_row else state.width)
    assert sorted(set(slots.tolist())) == [0, 1, 2]
    master = _master(coordinator)
    moe, moe0 = master["blocks"][0]["moe"], start["blocks"][0]["moe"]
    for name in ("w_gate", "w_up", "w_down"):  # lr 1, no momentum: master = start - merged
        np.testing.assert_array_equal(moe[name][0], moe0[name][0] - np.float32(0.75 * 4 + 0.25 * 8))  # 5
        np.testing.assert_array_equal(moe[name][1], moe0[name][1] - np.float32(4.0))  # a alone
    same = _merge(_moe_config("same", width=width), pgs, {"a": 40, "b": 10}, {"a": [[30, 10]], "b": [[10, 0]]}, width)
    same = _master(same)
    for leaf in (lambda t: t["embedding"], lambda t: t["blocks"][0]["moe"]["router"]):  # 0.8 / 0.2, as `same`
        np.testing.assert_array_equal(leaf(master), leaf(same))
    np.testing.assert_allclose(master["embedding"], start["embedding"] - 4.8, rtol=1e-6)
    np.testing.assert_allclose(same["blocks"][0]["moe"]["w_up"], moe0["w_up"] - 4.8, rtol=1e-6)
    record = coordinator.fragments[0].history[-1]
    assert record.weights == {"a": 0.8, "b": 0.2}
    assert record.expert_weights == {"a": [[0.75, 1.0]], "b": [[0.25, 0.0]]}


@pytest.mark.parametrize("kind", ["none", "int8", "topk"])
@pytest.mark.parametrize("width", [(D, F), ROWS], ids=["per_element", "per_row"])
def test_counts_in_proportion_to_tokens_merge_bit_for_bit_as_same(kind, width):
    rng = np.random.default_rng(1)
    pgs = {n: jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), _params(width)) for n in "ab"}
    tokens, routed = {"a": 30, "b": 10}, {"a": [[21, 9]], "b": [[7, 3]]}
    routed_merge = _merge(_moe_config("tokens_routed", 0.9, kind, width), pgs, tokens, routed, width)
    same = _merge(_moe_config("same", 0.9, kind, width), pgs, tokens, routed, width)
    for x, y in zip(jax.tree.leaves(routed_merge.state()), jax.tree.leaves(same.state())):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert routed_merge.fetch_update(0, "a") == same.fetch_update(0, "a")


def test_an_expert_no_island_routed_to_takes_the_outer_step_on_zero():
    config = _moe_config("tokens_routed", momentum=0.9)
    params = _params()
    coordinator = Coordinator(config, params, ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(config), coordinator.checksum)
    tx = outer_optimizer(config)
    w = params["blocks"][0]["moe"]["w_up"][1]
    expected, state = jnp.asarray(w), tx.init(jnp.asarray(w))
    for round, (routed, pg) in enumerate([({"a": [[20, 20]], "b": [[5, 5]]}, 2.0),
                                          ({"a": [[40, 0]], "b": [[10, 0]]}, 3.0)]):
        for name in ("a", "b"):
            payload = codec.encode(_pseudo_gradients({name: pg})[name], "none", config.codec.block_size)
            coordinator.contribute(ContributionHeader(round, name, 40 if name == "a" else 10,
                                                      routed_counts=routed[name]), payload)
        # expert 1 merged from pg (round 0: both routed to it), then from nothing (round 1): zero
        merged = jnp.full(w.shape, pg if round == 0 else 0.0, jnp.float32)
        updates, state = tx.update(merged, state, expected)
        expected = optax.apply_updates(expected, updates)
        got = _master(coordinator)["blocks"][0]["moe"]["w_up"][1]
        assert got.tobytes() == np.asarray(expected).tobytes(), round
    assert not np.array_equal(got, w - 2.0)  # momentum alone moved it in round 1
    assert coordinator.fragments[0].history[-1].expert_weights == {"a": [[0.8, 0.0]], "b": [[0.2, 0.0]]}


@pytest.mark.parametrize(
    "counts, match",
    [
        ([[30, 10], [0, 0]], r"the model has 1 MoE layers of 2 experts: send \[1, 2\] integers"),
        ([30, 5, 5], r"shape \[3\]; the model has 1 MoE layers of 2 experts"),
        ([[45, -5]], r"layer 0, expert 1 is -5"),
        ([[30, 5]], r"layer 0 sum to 35; 40 tokens routed to 1 experts each make 40"),
    ],
)
def test_counts_that_do_not_fit_the_model_are_refused_with_invalid_argument_and_nothing_is_merged(counts, match):
    config = _moe_config("tokens_routed")
    coordinator = Coordinator(config, _params(), ["a", "b"])
    server, _, port = serve(coordinator, "localhost:0", config.comm.chunk_bytes)
    try:
        a = GrpcTransport(f"localhost:{port}", config.comm.chunk_bytes, join_timeout=30, round_timeout=30)
        a.join("a", fingerprint_fields(config), coordinator.checksum)
        payload = codec.encode(_pseudo_gradients({"a": 1.0})["a"], "none", config.codec.block_size)
        with pytest.raises(ExchangeError) as refused:
            a.contribute(ContributionHeader(0, "a", 40, routed_counts=counts), payload)
        assert "refused it (INVALID_ARGUMENT: WireError: island 'a', round 0, fragment 0: " in str(refused.value)
        assert re.search(match, str(refused.value)), str(refused.value)
        assert coordinator.fragments[0].pending == {} and coordinator.round == 0
        assert a.contribute(ContributionHeader(0, "a", 40, routed_counts=[[30, 10]]), payload) == "accepted"
        a.close()
    finally:
        server.stop(grace=0)
    with pytest.raises(ContributionError, match=match):  # the coordinator's own method, called directly
        Coordinator(config, _params(), ["a"]).fragments[0].routed_counts_of("a", 0, 40, counts)


# -- routing diagnostics (coordinator/routing.py) --------------------------------------------------------------


def test_identical_islands_give_js_zero_and_overlap_one_and_disjoint_ones_their_bounds():
    a = np.array([[[0, 1], [2, 3], [1, 2]]])  # one layer, 3 tokens, k = 2
    disjoint = np.array([[[2, 3], [0, 1], [0, 3]]])
    assert topk_overlap(a, a).tolist() == [1.0] and topk_overlap(a, disjoint).tolist() == [0.0]
    assert topk_overlap(a, np.array([[[1, 0], [3, 0], [0, 3]]])).tolist() == [0.5]  # 2 + 1 + 0 of 6, in any order
    same = expert_load([[10, 30, 0, 60], [5, 5, 5, 5]])
    assert same.tolist() == [[0.1, 0.3, 0.0, 0.6], [0.25, 0.25, 0.25, 0.25]]
    assert js_divergence(np.stack([same, same])).tolist() == [0.0, 0.0]
    apart = np.stack([expert_load([[1, 1, 0, 0]]), expert_load([[0, 0, 1, 1]])])
    assert js_divergence(apart).tolist() == [1.0]  # log2 K bits for K = 2 islands on disjoint experts
    three = np.stack([expert_load([[1, 0, 0]]), expert_load([[0, 1, 0]]), expert_load([[0, 0, 1]])])
    assert js_divergence(three).tolist() == [np.log2(3)]
    assert utilization_entropy(expert_load([[5, 5, 5, 5], [7, 0, 0, 0], [1, 1, 0, 0]])).tolist() == [1.0, 0.0, 0.5]


def test_the_round_record_holds_the_diagnostics_of_the_contributions():
    routed = {"a": np.array([[30, 10]]), "b": np.array([[10, 30]])}
    probes = {"a": np.array([[[0], [1], [1], [0]]]), "b": np.array([[[0], [0], [1], [1]]])}
    out = round_diagnostics(routed, probes, {"a": 0.25, "b": None}, {"a": 1.0, "b": 4.0}, 16.0)
    assert out == dict(load={"a": [[0.75, 0.25]], "b": [[0.25, 0.75]]}, entropy={"a": [0.811278], "b": [0.811278]},
                       js_divergence=[0.188722], topk_overlap={"a/b": [0.5]},
                       router_distance={"a": 0.25, "b": 0.5}, post_sync_loss_change={"a": 0.25})
    assert round_diagnostics({"a": None, "b": None}, probes, {}, None) is None  # no counts: nothing to say
    other = dict(probes, b=np.array([[[0], [0]]]))  # b's probe of 2 tokens: other tokens, no overlap
    assert "topk_overlap" not in round_diagnostics(routed, other, {})
    tensorboard = scalars(dict(kind="round", round=1, routing=out))  # the coordinator's record, as TensorBoard tags
    assert tensorboard["round/routing/js_divergence/0"] == 0.188722
    assert tensorboard["round/routing/load/b/0/1"] == 0.75 and tensorboard["round/routing/topk_overlap/a/b/0"] == 0.5


def test_router_distance_is_each_islands_router_against_the_merged_one():
    params = _params()
    params["blocks"][0]["moe"]["router"][...] = 4.0  # R = 4 - (1 + 3) / 2 = 2; R_a = 3, R_b = 1: |R_k - R| = |R| / 2
    pgs = _pseudo_gradients({"a": 1.0, "b": 3.0})
    config = _moe_config("same")
    coordinator = Coordinator(config, params, ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(config), coordinator.checksum)
    for name, probe in (("a", [[[0], [1]]]), ("b", [[[0], [0]]])):
        header = ContributionHeader(0, name, 20, routed_counts=[[10, 10]], routing_probe=np.array(probe, np.uint8),
                                    post_sync_loss_change=None)
        coordinator.contribute(header, codec.encode(pgs[name], "none", config.codec.block_size))
    routing = coordinator.fragments[0].history[-1].routing
    assert routing["router_distance"] == {"a": 0.5, "b": 0.5}
    assert routing["topk_overlap"] == {"a/b": [0.5]} and routing["js_divergence"] == [0.0]


def test_the_probe_routes_each_token_alike_on_any_mesh_and_layout():
    c = _moe_config("same")
    c.model.update(num_layers=2, d_model=32, num_heads=2, seq_len=16)
    c.moe.update(num_experts=4, num_experts_per_token=2, expert_hidden_dim=32, capacity_factor=0.5)
    inputs = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
    choices = []
    for scan in (False, True):
        c.model.scan_layers = scan
        graphdef, params, specs = init_params(c)
        probe = step_lib.build_probe_step(graphdef)
        for data, expert in ((1, 1), (2, 2)):
            mesh = island_mesh(data, expert, jax.devices()[: data * expert])
            shardings = Shardings(mesh, specs, params)
            with jax.set_mesh(mesh):
                top = probe(shardings.place(params), shardings.rows_of(inputs, 4),
                            shardings.rows_of(np.ones((4, 16), np.float32), 4))
            choices.append(np.asarray(top))
    assert choices[0].shape == (2, 4, 16, 2) and len(np.unique(choices[0])) == 4
    for other in choices[1:]:  # capacity 0.5 would drop; the probe drops nothing, so meshes agree
        np.testing.assert_array_equal(other, choices[0])


def test_a_round_with_a_contributor_without_counts_merges_the_experts_by_tokens():
    rng = np.random.default_rng(2)
    pgs = {n: jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), _params()) for n in "ab"}
    without = _merge(_moe_config("tokens_routed", 0.9), pgs, {"a": 30, "b": 10}, {"a": [[25, 5]], "b": None})
    same = _merge(_moe_config("same", 0.9), pgs, {"a": 30, "b": 10}, {"a": [[25, 5]], "b": None})
    for x, y in zip(jax.tree.leaves(without.state()), jax.tree.leaves(same.state())):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # nothing of b's experts dropped
    assert without.fragments[0].history[-1].expert_weights is None


def test_a_coordinator_shard_without_expert_rows_still_weighs_experts_by_their_counts():
    class Owner:  # a coordinator shard that owns the plan's last chunk alone
        def owned(self, plan):
            return range(len(plan) - 1, len(plan))

    config = _moe_config("tokens_routed", width=ROWS)
    config.comm.chunk_bytes = 4096  # several chunks: the last holds the embedding alone
    params = jax.tree.leaves(_params(ROWS))
    experts = expert_leaves(_params(ROWS))
    state = FragmentState(config, params, owner=Owner(), expert_layers=experts)
    assert len(state.plan) > 2 and all(s is None for s in state.expert_slots) and state.has_experts
    merge = PartialMerge.start([Contribution("a", 40, routed=np.array([[30, 10]])),
                                Contribution("b", 10, routed=np.array([[10, 0]]))], state, "tokens", "tokens_routed")
    assert merge.record(0, [], lambda: "").expert_weights == {"a": [[0.75, 1.0]], "b": [[0.25, 0.0]]}


def test_counts_cover_the_tokens_less_the_unrouted_padding():
    assert check_routed_counts([[30, 5]], 1, 2, 40, 1, unrouted=5).tolist() == [[30, 5]]
    with pytest.raises(ValueError, match=r"layer 0 sum to 35; 38 tokens \(40 less 2 unrouted\) routed to 1 experts"):
        check_routed_counts([[30, 5]], 1, 2, 40, 1, unrouted=2)
    with pytest.raises(ValueError, match="unrouted tokens are 40 of the contribution's 40; send 0..39"):
        check_routed_counts([[0, 0]], 1, 2, 40, 1, unrouted=40)
    config = _moe_config("tokens_routed")
    coordinator = Coordinator(config, _params(), ["a", "b"])
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(config), coordinator.checksum)
    pgs = _pseudo_gradients({"a": 4.0, "b": 8.0})
    for name, routed, unrouted in (("a", [[28, 10]], 2), ("b", [[10, 0]], 0)):  # a: 2 of its 40 tokens padding
        header = ContributionHeader(0, name, 40 if name == "a" else 10, routed_counts=routed, unrouted_tokens=unrouted)
        coordinator.contribute(header, codec.encode(pgs[name], "none", config.codec.block_size))
    record = coordinator.fragments[0].history[-1]
    assert record.weights == {"a": 0.8, "b": 0.2}  # by the tokens, padding included, as before
    assert record.expert_weights == {"a": [[round(28 / 38, 6), 1.0]], "b": [[round(10 / 38, 6), 0.0]]}
    assert record.routing["unrouted_tokens"] == {"a": 2}
