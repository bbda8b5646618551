"""The per-expert merge weights (`coordinator.expert_merge`) and the checks of a contribution's routed counts."""

import numpy as np
import pytest

from island_jax.coordinator.contribution import Contribution
from island_jax.coordinator.expert_merge import check_routed_counts, expert_merge_weights
from island_jax.coordinator.partial_merge import merge_weights


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
