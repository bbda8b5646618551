"""Routing diagnostics across islands, per round, from what the contributions carry (docs/moe.md defines each).

For island k and MoE layer l, with c_k[l, e] the assignments it routed to expert e over the contribution's steps
(`expert_merge.check_routed_counts`) and p_k[l] = c_k[l] / sum_e c_k[l, e] its expert load (a distribution over the
E experts):

  js_divergence[l]     = H(sum_k p_k[l] / K) - sum_k H(p_k[l]) / K, in bits (log 2): 0 for identical loads, at most
                         log2 K (1 for two islands) for loads on disjoint experts (the generalised Jensen-Shannon
                         divergence with equal weights, Lin 1991)
  entropy[k][l]        = H(p_k[l]) / ln E: the expert-utilization entropy, 1 for a uniform load, 0 for one expert
  topk_overlap[a/b][l] = mean over the probe's tokens t of |S_a(t) & S_b(t)| / k, S_k(t) the top-k experts island k's
                         router chose for token t of layer l on the fixed probe batch: 1 for the same choices, 0 for
                         disjoint ones
  router_distance[k]   = ||R_k - R|| / ||R|| over every MoE layer's router (Frobenius): R_k = anchor - pg_k the
                         island's router at the end of its round (as its contribution decodes), R the merged one
                         islands hold after the update
  post_sync_loss_change[k] = loss(first inner step after the previous round's update) - loss(the step before it)

with H(p) = -sum_e p_e log p_e. The functions are pure, on NumPy arrays.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def expert_load(counts) -> np.ndarray:
    """p[l] = c[l] / sum_e c[l, e]: float64 [L, E] from int counts [L, E]; a layer with no assignments is NaN."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return counts / total


def _entropy(p: np.ndarray, log) -> np.ndarray:
    """-sum_e p_e log p_e over the last axis (0 log 0 = 0)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(p > 0, -p * log(np.where(p > 0, p, 1.0)), 0.0)
    return np.where(np.isnan(p).any(axis=-1), np.nan, terms.sum(axis=-1))


def js_divergence(loads: np.ndarray) -> np.ndarray:
    """The Jensen-Shannon divergence (bits) between K islands' expert loads, per layer.

    Args:
      loads: float [K, L, E], each [l] a distribution (`expert_load`).

    Returns:
      float64 [L]: H(mean_k p_k) - mean_k H(p_k), in [0, log2 K]; NaN for a layer some island routed nothing in.
    """
    loads = np.asarray(loads, np.float64)
    return _entropy(loads.mean(axis=0), np.log2) - _entropy(loads, np.log2).mean(axis=0)


def utilization_entropy(load: np.ndarray) -> np.ndarray:
    """H(p[l]) / ln E per layer: float64 [L] in [0, 1] from an expert load [L, E] (1: every expert alike)."""
    load = np.asarray(load, np.float64)
    return _entropy(load, np.log) / np.log(load.shape[-1]) if load.shape[-1] > 1 else np.ones(load.shape[0])


def topk_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The share of top-k choices two islands' routers make alike on the same tokens, per layer.

    Args:
      a, b: int [L, T, k]: the experts each chose for each of the probe's T tokens (k distinct per token).

    Returns:
      float64 [L]: mean over tokens of |set(a[l, t]) & set(b[l, t])| / k.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"top-k choices of shapes {a.shape} and {b.shape}; both islands route the same probe")
    same = (a[..., :, None] == b[..., None, :]).any(axis=-1).sum(axis=-1)  # [L, T]: choices a shares with b
    return same.mean(axis=-1) / a.shape[-1]


DECIMALS = 6  # the round record's floats are rounded to this many decimals


def round_diagnostics(routed: Mapping[str, np.ndarray | None], probes: Mapping[str, np.ndarray | None],
                      spikes: Mapping[str, float | None], router_sq: Mapping[str, float] | None = None,
                      router_norm_sq: float = 0.0, unrouted: Mapping[str, int] | None = None,
                      decimals: int = DECIMALS) -> dict | None:
    """A round record's `routing` field, JSON-ready (floats rounded to `decimals`), from the contributions.

    Args:
      routed: island -> its routed counts int [L, E], or None (sent none); contributor order.
      probes: island -> its top-k choices on the probe int [L, T, k], or None; a pair of other shapes (islands
        resumed under other `metrics.routing_probe_tokens`) has no overlap.
      spikes: island -> its post-sync loss change, or None.
      router_sq: island -> sum over the routers' elements of (R_k - R)^2; router_norm_sq: sum of R^2.
      unrouted: island -> the padding positions among its tokens, which its counts do not cover.

    Returns:
      None when no island sent counts; else `load` {island: [L][E]}, `entropy` {island: [L]}, `js_divergence` [L]
      (over the islands that sent counts; with fewer than two, zeros), and where there is something to measure
      `topk_overlap` {"a/b": [L]}, `router_distance` {island: float}, `post_sync_loss_change` {island: float},
      `unrouted_tokens` {island: int} (those with padding).
    """
    counted = {n: np.asarray(c) for n, c in routed.items() if c is not None}
    if not counted:
        return None
    loads = {n: expert_load(c) for n, c in counted.items()}
    r = lambda x: np.round(np.asarray(x, np.float64), decimals).tolist()  # noqa: E731
    out = dict(
        load={n: r(p) for n, p in loads.items()},
        entropy={n: r(utilization_entropy(p)) for n, p in loads.items()},
        js_divergence=r(js_divergence(np.stack(list(loads.values())))),
    )
    probed = {n: p for n, p in probes.items() if p is not None}
    names = list(probed)
    overlap = {f"{a}/{b}": r(topk_overlap(probed[a], probed[b])) for i, a in enumerate(names) for b in names[i + 1:]
               if np.shape(probed[a]) == np.shape(probed[b])}  # probes of other lengths route other tokens
    if overlap:
        out["topk_overlap"] = overlap
    out = with_router_distance(out, router_sq, router_norm_sq, decimals)
    measured = {n: round(float(s), decimals) for n, s in spikes.items() if s is not None}
    if measured:
        out["post_sync_loss_change"] = measured
    padded = {n: int(u) for n, u in (unrouted or {}).items() if u and n in counted}
    if padded:
        out["unrouted_tokens"] = padded
    return out


def with_router_distance(routing: dict, router_sq: Mapping[str, float] | None, router_norm_sq: float,
                         decimals: int = DECIMALS) -> dict:
    """`routing` with `router_distance` {island: sqrt(router_sq[island] / router_norm_sq)} (rounded to
    `decimals`) where there are routers to measure (of a coordinator of shards: every shard's sums added)."""
    if router_sq and router_norm_sq > 0:
        routing = dict(routing, router_distance={n: round(float(np.sqrt(s / router_norm_sq)), decimals)
                                                 for n, s in router_sq.items()})
    return routing
