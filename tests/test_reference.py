"""The coordinator's chunked, quantized, streamed merge against DiLoCo's outer step over whole trees in NumPy
(`island_jax/outer/reference.py`), for codec none and int8.

Where the two differ, and why: the chunk program is XLA, which fuses some multiply-adds of the merge and of the
Nesterov step (rounding once where NumPy rounds twice), and computes an int8 block's scale absmax / 127 as
absmax x float32(1/127), which may be one ulp off. Everything else is the same arithmetic, bit for bit.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tiny_config import get_config

from island_jax.config import fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator
from island_jax.model.init import checksum, init_params
from island_jax.outer import codec, reference
from island_jax.outer.optimizer import momentum_schedule

TOKENS = {"a": 300, "b": 100, "c": 200}  # tokens each island trains on per round: weights 1/2, 1/6, 1/3
ROUNDS = 4


def _config(kind: str):
    c = get_config()
    c.model.param_dtype = "bfloat16"  # bfloat16 leaves (the view rounds to them) beside the float32 router
    c.model.vocab_size = 2304  # embeddings of 73,728 elements: several pieces of one leaf, in several chunks
    c.islands.c = island(2, 1, 2, 4, 2)
    c.codec.kind = kind
    c.comm.update(chunk_bytes=4096, pipeline=True)  # chunks merged as soon as all three islands sent them
    c.outer.update(learning_rate=0.7, momentum=0.9, nesterov=True, momentum_warmup_rounds=3, fragments=2)
    return c


def _stream(coordinator, round, contributions, anchors, rng):
    """Every island's chunks of every fragment, interleaved in a random order, as parallel connections
    deliver them; each header carries the checksum of the island's anchor of the fragment (`anchors`, its
    leaves), which the coordinator checks against its view."""
    for p, fragment in enumerate(coordinator.fragments):
        for name in TOKENS:
            header = ContributionHeader(round, name, TOKENS[name], checksum(anchors[p]), fragment=p)
            assert fragment.begin_contribution(header) == "accepted"
        arrivals = [(name, chunk) for name in TOKENS for chunk in fragment.plan]
        for i in rng.permutation(len(arrivals)):
            name, chunk = arrivals[i]
            fragment.add_chunk(round, name, chunk.index, b"".join(contributions[name][p].chunk(chunk.index)))
        for name in TOKENS:
            assert fragment.end_contribution(round, name) == "accepted"


def _ulp_of_largest(x: np.ndarray) -> float:
    """One unit in the last place, in x's dtype, of x's largest magnitude."""
    return float(np.spacing(np.max(np.abs(x)).astype(x.dtype)))


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_the_chunked_streamed_merge_is_the_reference_outer_step(kind):
    config = _config(kind)
    params = init_params(config)[1]
    up, down = codec.Codec.of(config.codec), codec.Codec.of(config.codec, update=True)
    coordinator = Coordinator(config, params, list(TOKENS))
    for name in TOKENS:
        coordinator.join(name, fingerprint_fields(config), checksum(params))
    assert len(coordinator.fragments) == 2 and all(len(f.plan) >= 4 for f in coordinator.fragments)
    leaves, treedef = jax.tree.flatten(params)
    held = list(leaves)  # what every island holds: the updates' bytes applied with codec.decode_and_apply
    master, m, view = reference.init(params)  # the reference's own state, from the same parameters
    w = reference.weights(list(TOKENS.values()))
    assert w == [np.float32(1 / 2), np.float32(1 / 6), np.float32(1 / 3)]
    rng = np.random.default_rng(0)
    for r in range(ROUNDS):
        # Each island's pseudo-gradient (anchor - local parameters after its inner steps; random here, with an
        # all-zero leaf in island b's and values far below their block's scale in island c's).
        pseudo_gradients = {}
        for k, name in enumerate(TOKENS):
            pg = [(rng.standard_normal(np.shape(x)) * 0.01 * (k + 1)).astype(np.float32) for x in leaves]
            if name == "b":
                pg[0][...] = 0.0
            if name == "c":
                pg[1].reshape(-1)[::7] *= np.float32(1e-6)
            pseudo_gradients[name] = pg
        contributions = {  # one encoder per fragment, cut by the fragment's chunk plan, as islands send them
            name: [codec.ChunkEncoder([pg[i] for i in idx], up, None, f.plan)
                   for idx, f in zip(coordinator.partition, coordinator.fragments)]
            for name, pg in pseudo_gradients.items()
        }
        view_before = jax.tree.leaves(coordinator.view)
        _stream(coordinator, r, contributions, [[held[i] for i in idx] for idx in coordinator.partition], rng)
        assert coordinator.round == r + 1

        received = [reference.received(jax.tree.unflatten(treedef, pseudo_gradients[n]), up) for n in TOKENS]
        mu = np.float32(momentum_schedule(0.9, 3)(jnp.int32(r)))
        assert mu == np.float32(0.9) * min(np.float32(r) / np.float32(3), np.float32(1))
        master, m, update = reference.outer_step(master, m, view, received, w, 0.7, mu, down)
        view = reference.island_view(view, update)

        real_master, real_update = [None] * len(leaves), [None] * len(leaves)
        for p, (idx, fragment) in enumerate(zip(coordinator.partition, coordinator.fragments)):
            payload = coordinator.fetch_update(r, "a", p)
            assert all(coordinator.fetch_update(r, n, p) == payload for n in TOKENS)  # one update for every island
            for i, sent, got in zip(idx, codec.decode(payload, [leaves[i] for i in idx], down),
                                    fragment.state()["master"]):
                real_update[i], real_master[i] = sent, got
            for i, x in zip(idx, codec.decode_and_apply([held[i] for i in idx], payload, down)):
                held[i] = x
        real_view = jax.tree.leaves(coordinator.view)

        # The update and the island view, by the reference's rules from the coordinator's own master and view:
        # an update of codec none is master - view, bit for bit; in int8 the same codes, each value within two
        # ulps (code x scale, the scale one ulp off at most: a code one off would be 1/127 off). The view is
        # view + update in float32, rounded to the leaf's dtype, bit for bit, as every island holds it.
        for i, leaf in enumerate(real_master):
            want = reference.sent(leaf - view_before[i].astype(np.float32), down)
            if kind == "none":
                assert real_update[i].tobytes() == want.tobytes(), (r, i)
            else:
                np.testing.assert_allclose(real_update[i], want, rtol=2**-22, atol=0, err_msg=f"round {r}, leaf {i}")
            rule = reference.island_view([view_before[i]], [real_update[i]])[0]
            assert rule.dtype == real_view[i].dtype and rule.tobytes() == real_view[i].tobytes(), (r, i)
        assert checksum(held) == checksum(real_view) == coordinator.checksum

        # The master, the reference run on its own from round 0: each element within r + 2 ulps of its leaf's
        # largest value. Each round the fused and the twice-rounded sums may round to neighbours (one ulp of the
        # value at most), and so on for r + 1 rounds; the merge's own differences are ulps of the much smaller
        # pseudo-gradients. (Per element, a value that cancels to near zero can be many of its own ulps off.)
        for i, (got, want) in enumerate(zip(real_master, jax.tree.leaves(master))):
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=0, atol=(r + 2) * _ulp_of_largest(want), err_msg=f"leaf {i}")

        # The reference's own view carries its drift as the coordinator's does: each element within one ulp (in
        # its leaf's dtype) of the leaf's largest value, since a master a few float32 ulps off may round to the
        # neighbouring bfloat16, or change an int8 block's scale in its last bit; and the drift master - view,
        # what the codec and the bfloat16 view lost, is the coordinator's to 1e-4.
        for got, want in zip(real_view, jax.tree.leaves(view)):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0,
                                       atol=_ulp_of_largest(want))
        drift = [np.linalg.norm(np.concatenate([(p - v.astype(np.float32)).ravel() for p, v in zip(ps, vs)]))
                 for ps, vs in ((jax.tree.leaves(master), jax.tree.leaves(view)), (real_master, real_view))]
        assert drift[0] > 0 and drift[1] == pytest.approx(drift[0], rel=1e-4)

    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(view)}
    assert dtypes == {np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)}
