"""Chunk-wise pipelined sync against the whole-payload merge, over gRPC with parallel connections."""

import threading

import jax
import numpy as np

from island_jax.comm.client import GrpcTransport
from island_jax.comm.link import LinkEmulator
from island_jax.comm.server import serve
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import Coordinator
from island_jax.outer import codec
from island_jax.params import checksum


def _config(pipeline: bool, connections: int):
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = "int8"
    c.comm.update(chunk_bytes=64 * 1024, pipeline=pipeline, connections=connections)
    c.outer.update(learning_rate=0.7, momentum=0.9, nesterov=True)
    return c


def _params():
    # A leaf of 200,000 elements (4 pieces), a small one and a scalar: 4 chunks of at most 64 KiB and more.
    return {"w": np.zeros((400, 500), np.float32), "b": np.zeros(77, np.float32), "s": np.zeros((), np.float32)}


def _run(pipeline: bool, connections: int, link_gbps: float = 0.0):
    """Three rounds of two islands; returns (update bytes per round, master, island parameters, stats)."""
    c = _config(pipeline, connections)
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
                payload = codec.encode(pseudo_gradients[name], "int8", 256)
                isl["transport"].contribute(r, name, 300 if name == "a" else 100, payload, checksum(isl["params"]))
                got[name] = isl["transport"].fetch_update(r, name)
                isl["params"] = codec.decode_and_apply(isl["params"], got[name], "int8", 256)
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
    return updates, coordinator.master, islands["a"]["params"], [isl["stats"] for isl in islands.values()]


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


def test_update_chunks_flow_back_while_contributions_still_go_out():
    # At 0.02 Gbit/s each island's ~200 kB takes about 80 ms each way: long enough to see the overlap.
    # Round 0 is left out: the coordinator compiles its chunk program on its first chunk.
    _, _, _, stats = _run(pipeline=True, connections=2, link_gbps=0.02)
    assert all(s.seconds_overlapped > 0.02 for per_island in stats for s in per_island[1:])
    _, _, _, stats = _run(pipeline=False, connections=2, link_gbps=0.02)
    assert all(s.seconds_overlapped < 0.005 for per_island in stats for s in per_island)
