"""Chunk-wise pipelined sync against the whole-payload merge, over gRPC with parallel connections."""

import threading

import jax
import numpy as np
import pytest

from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.comm.link import LinkEmulator
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionError, ContributionHeader, Coordinator, FragmentCoordinator
from island_jax.model.init import checksum
from island_jax.outer import codec


def _config(pipeline: bool, connections: int, kind: str = "int8", update_kind: str = ""):
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.update(kind=kind, update_kind=update_kind)
    c.comm.update(chunk_bytes=64 * 1024, pipeline=pipeline, connections=connections)
    c.outer.update(learning_rate=0.7, momentum=0.9, nesterov=True)
    return c


def _params():
    # A leaf of 200,000 elements (4 pieces), a small one and a scalar: 4 chunks of at most 64 KiB and more.
    return {"w": np.zeros((400, 500), np.float32), "b": np.zeros(77, np.float32), "s": np.zeros((), np.float32)}


def _run(pipeline: bool, connections: int, link_gbps: float = 0.0, kind: str = "int8", update_kind: str = ""):
    """Three rounds of two islands; returns (update bytes per round, master, island parameters, stats)."""
    c = _config(pipeline, connections, kind, update_kind)
    up, down = codec.Codec.of(c.codec), codec.Codec.of(c.codec, update=True)
    params = _params()
    coordinator = Coordinator(c, params, ["a", "b"])
    server, _, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    islands = {}
    for name in ("a", "b"):
        link = LinkEmulator(link_gbps) if link_gbps else None
        t = GrpcTransport(f"localhost:{port}", c.comm.chunk_bytes, 30, 60, connections, pipeline, link)
        t.join(name, fingerprint_fields(c), checksum(params))
        islands[name] = dict(transport=t, params=jax.tree.map(np.copy, params), stats=[])
    rng = np.random.default_rng(0)
    updates = []
    try:
        for r in range(3):
            pseudo_gradients = {
                n: jax.tree.map(lambda x: (rng.standard_normal(np.shape(x)) * 0.01).astype(np.float32), params)
                for n in islands
            }
            got = {}

            def sync(name):
                isl = islands[name]
                if pipeline:  # encoded chunk by chunk as the connections send it
                    plan = codec.chunk_plan(params, up, None, c.comm.chunk_bytes, down)
                    payload = codec.ChunkEncoder(pseudo_gradients[name], up, None, plan)
                else:
                    payload = codec.encode(pseudo_gradients[name], up)
                isl["transport"].contribute(ContributionHeader(r, name, 300 if name == "a" else 100, checksum(isl["params"])), payload)
                got[name] = isl["transport"].fetch_update(r, name)
                isl["params"] = codec.decode_and_apply(isl["params"], got[name], down)
                isl["stats"].append(isl["transport"].last_stats)

            threads = [threading.Thread(target=sync, args=(n,)) for n in islands]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got["a"] == got["b"]
            updates.append(got["a"])
    finally:
        for isl in islands.values():
            isl["transport"].close()
        server.stop(0)
    assert checksum(islands["a"]["params"]) == checksum(islands["b"]["params"]) == coordinator.checksum
    master = jax.tree.unflatten(jax.tree.structure(params), coordinator.fragments[0].state()["master"])
    return updates, master, islands["a"]["params"], [isl["stats"] for isl in islands.values()]


def test_pipelined_and_whole_payload_sync_give_identical_bytes():
    pipelined = _run(pipeline=True, connections=4)
    whole = _run(pipeline=False, connections=1)
    assert len(pipelined[0][0]) == codec.payload_bytes(_params(), "int8", 256) == 200_000 + 77 + 1 + 4 * (782 + 1 + 1)
    for r in range(3):
        assert pipelined[0][r] == whole[0][r], f"round {r}"
    for key in ("w", "b", "s"):
        np.testing.assert_array_equal(pipelined[1][key], whole[1][key])
        np.testing.assert_array_equal(pipelined[2][key], whole[2][key])
    assert checksum(pipelined[2]) == checksum(whole[2])


@pytest.mark.parametrize("kind,update_kind", [("topk", "int8"), ("int8", "topk")])
def test_one_plan_both_ways_over_grpc_with_two_codecs_gives_identical_bytes_pipelined_or_not(kind, update_kind):
    # The coordinator sends the update's own chunk offsets at the join; 4 pieces of "w" travel in int8 chunks of
    # up to 64 KiB and in top-k chunks cut by the same plan.
    pipelined = _run(pipeline=True, connections=4, kind=kind, update_kind=update_kind)
    whole = _run(pipeline=False, connections=1, kind=kind, update_kind=update_kind)
    down = codec.Codec(update_kind or kind)
    assert [len(u) for u in pipelined[0]] == [codec.payload_bytes(_params(), down)] * 3
    assert pipelined[0] == whole[0]
    for key in ("w", "b", "s"):
        np.testing.assert_array_equal(pipelined[1][key], whole[1][key])
    assert checksum(pipelined[2]) == checksum(whole[2])


def test_update_chunks_flow_back_while_contributions_still_go_out():
    # At 0.002 Gbit/s each island's ~200 kB takes about 0.8 s each way, so that the overlap stays far above
    # 20 ms even when a busy machine holds the coordinator's threads back for a few hundred ms. Round 0 is left
    # out: the coordinator compiles its chunk program on its first chunk.
    _, _, _, stats = _run(pipeline=True, connections=2, link_gbps=0.002)
    overlapped = [s.seconds_overlapped for per_island in stats for s in per_island[1:]]
    assert all(s > 0.02 for s in overlapped), overlapped
    _, _, _, stats = _run(pipeline=False, connections=2, link_gbps=0.002)
    overlapped = [s.seconds_overlapped for per_island in stats for s in per_island]
    assert all(s < 0.005 for s in overlapped), overlapped


def _two_island_coordinator(kind=FragmentCoordinator, min_islands=0, grace_seconds=60.0, clock=None):
    """A `kind` of coordinator of one leaf for islands a and b (both joined), and its parameters."""
    c = _config(pipeline=True, connections=1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    c.outer.update(min_islands=min_islands, grace_seconds=grace_seconds)
    params = {"w": np.zeros(40_000, np.float32)}  # "none": 3 chunks of 65,536, 65,536 and 28,928 bytes
    coordinator = kind(c, params, ["a", "b"], **({} if clock is None else dict(clock=clock)))
    for name in ("a", "b"):
        coordinator.join(name, fingerprint_fields(c), coordinator.checksum)
    return coordinator, params


def _chunks(coordinator, value):
    payload = codec.encode({"w": np.full(40_000, value, np.float32)}, "none", 256)
    return [payload[k.offset : k.offset + k.nbytes] for k in coordinator.plan]


def test_a_chunk_refused_mid_round_restarts_the_merge_without_that_island():
    coordinator, _ = _two_island_coordinator()
    a, b = _chunks(coordinator, 0.3), _chunks(coordinator, 0.1)
    assert len(coordinator.plan) == 3
    coordinator.begin_contribution(ContributionHeader(0, "a", 100))
    coordinator.begin_contribution(ContributionHeader(0, "b", 100))
    for k in range(3):
        coordinator.add_chunk(0, "a", k, a[k])
    coordinator.add_chunk(0, "b", 0, b[0])
    generation, merged, final = coordinator.update_chunks(0)
    assert (generation, sorted(merged), final) == (0, [0], False)  # chunk 0 merged from both islands
    np.testing.assert_array_equal(np.frombuffer(merged[0], "<f4"), np.full(16_384, -0.2, np.float32))
    bad = np.frombuffer(b[1], "<f4").copy()
    bad[7] = np.nan
    with pytest.raises(ContributionError, match="island 'b', round 0: the pseudo-gradient holds NaN or Inf"):
        coordinator.add_chunk(0, "b", 1, bad.tobytes())
    # The merge restarted without b: every chunk of a is merged again, and the round closes with a's stream
    generation, merged, final = coordinator.update_chunks(0)
    assert (generation, sorted(merged), final, coordinator.round) == (1, [0, 1, 2], False, 0)
    assert coordinator.end_contribution(0, "a") == "accepted"
    generation, merged, final = coordinator.update_chunks(0)
    assert (generation, final, coordinator.round) == (1, True, 1)
    assert coordinator.history[-1].contributors == ["a"]
    update = np.frombuffer(coordinator.fetch_update(0, "a"), "<f4")
    np.testing.assert_array_equal(update, np.full(40_000, -0.3, np.float32))
    np.testing.assert_array_equal(coordinator.state()["master"]["w"], np.full(40_000, -0.3, np.float32))


def test_a_quorum_that_closes_after_chunks_were_merged_restarts_without_the_late_island():
    now = [0.0]
    coordinator, _ = _two_island_coordinator(min_islands=1, grace_seconds=5.0, clock=lambda: now[0])
    a, b = _chunks(coordinator, 0.3), _chunks(coordinator, 0.1)
    coordinator.begin_contribution(ContributionHeader(0, "a", 100))
    coordinator.begin_contribution(ContributionHeader(0, "b", 100))
    coordinator.add_chunk(0, "b", 0, b[0])
    for k in range(3):
        coordinator.add_chunk(0, "a", k, a[k])
    assert coordinator.end_contribution(0, "a") == "accepted"
    assert sorted(coordinator.update_chunks(0)[1]) == [0]  # chunk 0 holds b's share
    now[0] = 5.0
    assert coordinator.poll() and coordinator.round == 1 and coordinator.generation == 1
    assert coordinator.history[-1].contributors == ["a"]
    np.testing.assert_array_equal(np.frombuffer(coordinator.fetch_update(0, "a"), "<f4"), np.full(40_000, -0.3, np.float32))
    coordinator.add_chunk(0, "b", 1, b[1])  # b's late chunks are ignored, and its contribution discarded
    assert coordinator.end_contribution(0, "b") == "discarded"


def test_an_island_fetching_through_a_restart_gets_the_final_update_only():
    import grpc

    from island_jax.comm import exchange_pb2 as pb
    from island_jax.comm import wire

    run, params = _two_island_coordinator(kind=Coordinator)
    coordinator, c = run.fragments[0], run.config
    server, _, port = serve(run, "localhost:0", c.comm.chunk_bytes)
    try:
        a = GrpcTransport(f"localhost:{port}", c.comm.chunk_bytes, 30, 60, 1, True)
        b = GrpcTransport(f"localhost:{port}", c.comm.chunk_bytes, 30, 60, 1, True)
        a.join("a", fingerprint_fields(c), coordinator.checksum)
        b.join("b", fingerprint_fields(c), coordinator.checksum)
        a.contribute(ContributionHeader(0, "a", 100), codec.encode({"w": np.full(40_000, 0.3, np.float32)}, "none", 256))
        good = _chunks(coordinator, 0.1)
        bad = np.frombuffer(good[1], "<f4").copy()
        bad[7] = np.inf
        header = pb.PayloadHeader(round=0, island="b", tokens=100, layout=b.layouts[0], total_bytes=160_000, streams=1)
        frames = [
            wire.header_frame(header),
            wire.chunk_frame(0, 0, good[0]),  # merged with a's chunk 0, and sent to a
            wire.chunk_frame(1, 65536, bad.tobytes()),
        ]
        call = b.channels[0].stream_unary(
            "/island_jax.exchange.Exchange/Contribute", request_serializer=bytes,
            response_deserializer=pb.ContributeReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            call(iter(frames), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert coordinator.generation == 1
        update = a.fetch_update(0, "a")
        np.testing.assert_array_equal(np.frombuffer(bytes(update), "<f4"), np.full(40_000, -0.3, np.float32))
        a.close()
        b.close()
    finally:
        server.stop(0)


def test_a_round_closes_only_once_its_contributions_ended_so_a_stream_refused_after_its_chunks_counts_for_nothing():
    coordinator, _ = _two_island_coordinator()
    a, b = _chunks(coordinator, 0.3), _chunks(coordinator, 0.1)
    coordinator.begin_contribution(ContributionHeader(0, "b", 100))
    for k in range(3):
        coordinator.add_chunk(0, "b", k, b[k])
    assert coordinator.end_contribution(0, "b") == "accepted"
    coordinator.begin_contribution(ContributionHeader(0, "a", 100))
    for k in range(3):
        coordinator.add_chunk(0, "a", k, a[k])
    generation, merged, final = coordinator.update_chunks(0)
    assert (sorted(merged), final, coordinator.round) == ([0, 1, 2], False, 0)  # merged, not yet served whole
    coordinator.abandon("a", "a frame after its chunks was refused")  # the stream failed before it ended
    assert coordinator.round == 0 and "a" not in coordinator.pending
    coordinator.begin_contribution(ContributionHeader(0, "a", 100))  # a sends again: this one counts
    for k in range(3):
        coordinator.add_chunk(0, "a", k, _chunks(coordinator, 0.5)[k])
    assert coordinator.end_contribution(0, "a") == "accepted" and coordinator.round == 1
    np.testing.assert_array_equal(np.frombuffer(coordinator.fetch_update(0, "a"), "<f4"),
                                  np.full(40_000, -0.3, np.float32))  # -(0.5 + 0.1) / 2
