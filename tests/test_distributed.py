"""The start-up self-check of an island's collectives, and the pieces of a multi-process exchange that one
process can check: dealing chunks out by bytes, and sending and receiving an island's payload in shares."""

import threading

import jax
import numpy as np
import pytest

from island_jax import distributed
from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.comm.proxy import FaultProxy
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator
from island_jax.outer import codec

# A task of a SLURM job step of two nodes, one task each, as srun sets it up on the second node.
SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
              "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize("explicit", [True, False])
def test_under_slurm_explicit_flags_turn_cluster_detection_off(monkeypatch, explicit):
    """With --process_id and --island_coordinator, JAX must not detect SLURM: its detection would also set
    local_device_ids to [SLURM_LOCALID], so one process per node would use only that node's GPU 0."""
    from jax._src import clusters

    for key, value in SLURM_TASK.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # the backend's collectives are left alone
    timeouts = default_config().distributed
    distributed.initialize(2, 1 if explicit else None, "gpu001:8476" if explicit else None, timeouts)
    (kwargs,) = calls
    assert (kwargs["coordinator_address"], kwargs["process_id"], kwargs["num_processes"]) == (
        ("gpu001:8476", 1, 2) if explicit else (None, None, 2))
    assert kwargs["cluster_detection_method"] == ("deactivate" if explicit else None)
    assert "local_device_ids" not in kwargs  # every device of the host: JAX's default without detection
    # what JAX's own detection makes of this environment (what the explicit flags avoid): GPU 0 only
    detected = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert detected == ("gpu001:" + str(4242 % 2**12 + 65535 - 2**12 + 1), 2, 1, [0])


def test_the_self_check_passes_on_exact_collectives():
    sizes = distributed.check_sizes([5, 1000, 70_000, 1000], 4)
    assert sizes == [8, 1000, 70_000]
    distributed.check_collectives(jax.devices()[:4], sizes)


@pytest.mark.parametrize("collective", ["psum_scatter", "all_gather"])
def test_the_self_check_fails_loudly_on_a_value_one_ulp_off_at_a_chunk_end(monkeypatch, collective):
    """A collective that returns its last element one ulp too high (as jax-ml/jax#40830 did at chunk ends)."""
    real = getattr(distributed, collective)

    def off_by_one_ulp(x, *args, **kwargs):
        y = real(x, *args, **kwargs)
        return y.at[-1].set(jax.numpy.nextafter(y[-1], np.float32(np.inf)))

    monkeypatch.setattr(distributed, collective, off_by_one_ulp)
    what = {"psum_scatter": "reduce-scatter", "all_gather": "all-gather"}[collective]
    got = 256 if collective == "psum_scatter" else 1024  # elements per device: a quarter of 1024, or all of them
    with pytest.raises(distributed.CollectiveCheckError, match=(
        rf"the island's {what} of 1024 float32 elements per device returned wrong values on device 0: 1 of {got} "
        rf"elements differ, the first at element {got - 1} of {got} .*: 1 ulp off\)"
    )):
        distributed.check_collectives(jax.devices()[:4], [1024])


def _chunk(index: int, offset: int, nbytes: int) -> codec.Chunk:
    return codec.Chunk(index, offset, nbytes, ())


def test_chunks_are_dealt_out_by_bytes_in_index_order():
    sizes = [5, 5, 5, 3, 3, 1]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    plan = [_chunk(i, int(o), n) for i, (o, n) in enumerate(zip(offsets, sizes))]
    shares = codec.deal(plan, 2)
    assert [[c.index for c in s] for s in shares] == [[0, 2, 5], [1, 3, 4]]
    assert [sum(c.nbytes for c in s) for s in shares] == [11, 11]
    assert codec.deal(plan, 1) == [plan]
    assert [[c.index for c in s] for s in codec.deal(plan[:1], 3)] == [[0], [], []]


def _two_process_island():
    """Island a of 2 processes and island b of 1 on a served 100,000-float coordinator (plain SGD, lr 1, codec
    none, 64 KiB chunks): (config, params, coordinator, server, service, address, pseudo-gradients, chunk plan,
    the plan dealt to a's 2 processes)."""
    c = default_config()
    c.islands.a = island(2, 1, 2, 2, 1, num_processes=2)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.comm.chunk_bytes = 64 * 1024
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    params = {"w": np.zeros(100_000, np.float32)}
    coordinator = Coordinator(c, params, ["a", "b"])
    server, service, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    rng = np.random.default_rng(0)
    pg = {"a": [rng.standard_normal(100_000, dtype=np.float32)], "b": [rng.standard_normal(100_000, dtype=np.float32)]}
    plan = codec.chunk_plan(params, "none", 256, c.comm.chunk_bytes)
    return c, params, coordinator, server, service, f"localhost:{port}", pg, plan, codec.deal(plan, 2)


def test_an_island_of_two_processes_sends_and_receives_its_shares():
    """Island a's two processes contribute a share each (process 1's connection reset halfway, so it sends its
    share again) and receive a share of the update each; put together, the update is the one a coordinator
    that received whole contributions serves."""
    c, params, coordinator, server, service, address, pg, plan, shares = _two_process_island()
    start = coordinator.checksum
    assert len(plan) == 7 and [len(s) for s in shares] == [4, 3]
    try:
        with FaultProxy(address) as proxy:
            # 4 connections: process 0's share travels on 4 streams, process 1's (3 chunks) on 3; without pipelining
            # the update streams open at fetch_update, so process 1's end last
            kw = dict(join_timeout=30, round_timeout=30, reconnect_seconds=30, connections=4, pipeline=False)
            a = [GrpcTransport(address, c.comm.chunk_bytes, part=0, parts=2, **kw),
                 GrpcTransport(proxy.address, c.comm.chunk_bytes, part=1, parts=2, **kw)]
            b = GrpcTransport(address, c.comm.chunk_bytes, **kw)
            for t in a:
                t.join("a", fingerprint_fields(c), start)
            b.join("b", fingerprint_fields(c), start)
            assert [[k.offset for k in t.shares[0]] for t in a] == [[k.offset for k in s] for s in shares]
            proxy.reset_after(100_000)  # about half of process 1's share (chunks 1, 3 and 5: 196,608 bytes)

            def share(p):
                encoder = codec.ChunkEncoder(pg["a"], "none", 256, shares[p])
                assert a[p].contribute(ContributionHeader(0, "a", 3000, start), encoder) == "accepted"

            threads = [threading.Thread(target=share, args=(p,)) for p in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert proxy.wait_fired(timeout=0) and proxy.resets == 1
            assert b.contribute(ContributionHeader(0, "b", 1000, start), codec.encode(pg["b"], "none", 256)) == "accepted"
            parts = [t.fetch_update(0, "a") for t in a]
            whole = b.fetch_update(0, "b")
            assert service.session.wait_until_fetched(0, timeout=10)  # the island has its update once both shares came
        for t in (*a, b):
            t.close()
    finally:
        server.stop(grace=0)
    for p, part in enumerate(parts):  # each process holds its own share's bytes, zeros elsewhere
        theirs = [k for q, s in enumerate(shares) if q != p for k in s]
        assert all(part[k.offset : k.offset + k.nbytes] == bytes(k.nbytes) for k in theirs)
    assert _combine_shares([np.frombuffer(x, np.uint8) for x in parts], shares) == whole
    record = coordinator.fragments[0].history[0]
    assert record.contributors == ["a", "b"] and record.weights == {"a": 0.75, "b": 0.25}
    reference = Coordinator(c, params, ["a", "b"])
    for name, tokens in (("a", 3000), ("b", 1000)):
        reference.join(name, fingerprint_fields(c), start)
        reference.contribute(ContributionHeader(0, name, tokens, start), codec.encode(pg[name], "none", 256))
    assert whole == reference.fetch_update(0, "a")


def test_a_share_whose_stream_ends_without_its_chunks_is_refused_and_the_other_share_is_kept():
    """A share's stream may end cleanly after its header when its connection closes (gRPC can hand the server
    the close as the end of the requests). That share is refused, naming its missing chunks, and only it is
    forgotten: the other process's share stays, and the share sent again completes the contribution."""
    import grpc

    from island_jax.comm import exchange_pb2 as pb
    from island_jax.comm import wire

    c, params, coordinator, server, service, address, pg, plan, shares = _two_process_island()
    start = coordinator.checksum
    assert [[k.index for k in s] for s in shares] == [[0, 2, 4, 6], [1, 3, 5]]
    header = ContributionHeader(0, "a", 3000, start)
    try:
        kw = dict(join_timeout=30, round_timeout=30, reconnect_seconds=30, connections=4, pipeline=False)
        a = [GrpcTransport(address, c.comm.chunk_bytes, part=p, parts=2, **kw) for p in (0, 1)]
        b = GrpcTransport(address, c.comm.chunk_bytes, **kw)
        for t in a:
            t.join("a", fingerprint_fields(c), start)
        b.join("b", fingerprint_fields(c), start)
        assert a[0].contribute(header, codec.ChunkEncoder(pg["a"], "none", 256, shares[0])) == "accepted"
        # process 1's share: one stream that carries its header and then ends
        fields = wire.payload_header(header, a[1].layouts[0], 1, sum(k.nbytes for k in plan), wire.new_attempt(),
                                     a[1].incarnation, part=1, parts=2)
        contribute = a[1].channels[0].stream_unary(
            "/island_jax.exchange.Exchange/Contribute", request_serializer=bytes,
            response_deserializer=pb.ContributeReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            contribute(iter([wire.header_frame(fields)]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "share 1 of 2 ended without chunks [1, 3, 5]" in refused.value.details()
        assert coordinator.fragments[0].is_open(0, "a")  # process 0's share is still in
        assert a[1].contribute(header, codec.ChunkEncoder(pg["a"], "none", 256, shares[1])) == "accepted"
        assert b.contribute(ContributionHeader(0, "b", 1000, start), codec.encode(pg["b"], "none", 256)) == "accepted"
        parts = [t.fetch_update(0, "a") for t in a]
        whole = b.fetch_update(0, "b")
        for t in (*a, b):
            t.close()
    finally:
        server.stop(grace=0)
    assert _combine_shares([np.frombuffer(x, np.uint8) for x in parts], shares) == whole
    record = coordinator.fragments[0].history[0]
    assert record.contributors == ["a", "b"] and record.weights == {"a": 0.75, "b": 0.25}


def _combine_shares(rows, shares) -> bytes:
    """The whole payload from every process's copy of it (uint8 rows): the bytes of each chunk of `shares[p]`
    taken from row p."""
    whole = np.zeros(len(rows[0]), np.uint8)
    for p, share in enumerate(shares):
        for chunk in share:
            whole[chunk.offset : chunk.offset + chunk.nbytes] = rows[p][chunk.offset : chunk.offset + chunk.nbytes]
    return whole.tobytes()
