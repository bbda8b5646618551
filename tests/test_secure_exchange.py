"""The coordinator's exchange behind TLS and per-island tokens: who is refused, and that nothing of theirs counts."""

import json
import logging
import secrets
import time

import grpc
import ml_collections
import numpy as np
import pytest

from island_jax.comm import exchange_pb2 as pb
from island_jax.comm import security, wire
from island_jax.comm.grpc_client import GrpcTransport
from island_jax.comm.grpc_server import serve
from island_jax.comm.options import SERVICE_NAME, client_options
from island_jax.config import default_config, fingerprint_fields, island
from island_jax.coordinator import ContributionHeader, Coordinator
from island_jax.outer import codec


def _config():
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.comm.chunk_bytes = 64 * 1024
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    return c


@pytest.fixture
def secure(tmp_path):
    """A coordinator served with TLS and tokens for islands a and b; (config, coordinator, address, made)."""
    c = _config()
    made = security.make_run_credentials(str(tmp_path / "secrets"), ["a", "b"], ["localhost"])
    c.comm.tls.update(cert_file=made["cert_file"], key_file=made["key_file"], ca_file=made["ca_file"])
    coordinator = Coordinator(c, {"w": np.zeros(100_000, np.float32)}, ["a", "b"])
    server, _, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes, tls=c.comm.tls,
                            tokens_file=made["tokens_file"])
    yield c, coordinator, f"localhost:{port}", made
    server.stop(grace=0)


def _token(made, name):
    return open(made["token_files"][name]).read().strip()


def _calls(address, made, metadata, island="a"):
    """The four exchange calls, naming `island`, on a TLS channel that trusts the run's CA, each with `metadata`;
    their status codes."""
    creds = security.channel_credentials(made["ca_file"])
    with grpc.secure_channel(address, creds, options=client_options(64 * 1024)) as ch:
        join = ch.unary_unary(f"/{SERVICE_NAME}/Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        contribute = ch.stream_unary(f"/{SERVICE_NAME}/Contribute", lambda x: x, pb.ContributeReply.FromString)
        fetch = ch.unary_stream(f"/{SERVICE_NAME}/FetchUpdate", pb.FetchRequest.SerializeToString, lambda x: x)
        view = ch.unary_stream(f"/{SERVICE_NAME}/FetchView", pb.FetchRequest.SerializeToString, lambda x: x)
        header = wire.header_frame(pb.PayloadHeader(round=0, island=island, tokens=1000, total_bytes=400_000))
        attempts = {
            "Join": lambda: join(pb.JoinRequest(island=island, fingerprint_json="{}"), metadata=metadata, timeout=10),
            "Contribute": lambda: contribute(iter([header]), metadata=metadata, timeout=10),
            "FetchUpdate": lambda: list(fetch(pb.FetchRequest(round=0, island=island), metadata=metadata, timeout=10)),
            "FetchView": lambda: list(view(pb.FetchRequest(island=island), metadata=metadata, timeout=10)),
        }
        codes = {}
        for name, call in attempts.items():
            try:
                call()
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                codes[name] = e.code()
        return codes


def test_every_exchange_call_needs_the_token_of_the_island_it_names(secure, caplog):
    c, coordinator, address, made = secure
    before = coordinator.checksum
    b = _token(made, "b")
    refused = {name: grpc.StatusCode.UNAUTHENTICATED for name in ("Join", "Contribute", "FetchUpdate", "FetchView")}
    stranger = secrets.token_urlsafe(32)
    with caplog.at_level(logging.WARNING):
        assert _calls(address, made, ()) == refused  # no token
        assert _calls(address, made, security.call_metadata("a", b)) == refused  # b's token, claiming to be a
        assert _calls(address, made, security.call_metadata("z", stranger)) == refused  # an island not in the run
        # b's own token and name, but a request that names a: refused by the handler
        assert _calls(address, made, security.call_metadata("b", b)) == refused
    assert coordinator.round == 0 and coordinator.checksum == before and not coordinator.fragments[0].history
    assert b not in caplog.text and stranger not in caplog.text
    # the two islands with their own tokens: a round merges
    islands = {
        n: GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30, tls=c.comm.tls,
                         token=_token(made, n))
        for n in ("a", "b")
    }
    payload = codec.encode({"w": np.full(100_000, 0.5, np.float32)}, "none", 256)
    for n, t in islands.items():
        assert t.join(n, fingerprint_fields(c), before)["rejoin"] is False
        assert t.contribute(ContributionHeader(0, n, 1000, before), payload) == "accepted"
    assert islands["a"].fetch_update(0, "a") == islands["b"].fetch_update(0, "b")
    assert coordinator.round == 1
    for t in islands.values():
        t.close()


def test_a_plaintext_client_or_one_that_does_not_trust_the_ca_gets_nothing(secure, tmp_path):
    c, coordinator, address, made = secure
    with grpc.insecure_channel(address) as ch:
        join = ch.unary_unary(f"/{SERVICE_NAME}/Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        with pytest.raises(grpc.RpcError) as plain:
            join(pb.JoinRequest(island="a"), metadata=security.call_metadata("a", _token(made, "a")), timeout=5)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    other = security.make_run_credentials(str(tmp_path / "other"), ["a"], ["localhost"])
    stranger = ml_collections.ConfigDict(dict(ca_file=other["ca_file"], client_cert_file="", client_key_file="",
                                              server_name=""))
    t = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=3, round_timeout=5, tls=stranger,
                      token=_token(made, "a"))
    with pytest.raises(Exception, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
        t.join("a", fingerprint_fields(c), coordinator.checksum)
    t.close()
    assert coordinator.fragments[0].joined == set()


def test_off_loopback_the_coordinator_needs_tls_and_tokens_or_insecure(caplog):
    c = _config()
    coordinator = Coordinator(c, {"w": np.zeros(10, np.float32)}, ["a", "b"])
    with pytest.raises(security.SecurityError, match=r"comm.tls .*comm.auth.tokens_file.*--insecure"):
        serve(coordinator, "0.0.0.0:0", c.comm.chunk_bytes)
    with caplog.at_level(logging.WARNING):
        server, _, port = serve(coordinator, "0.0.0.0:0", c.comm.chunk_bytes, insecure=True)
    assert "without TLS and tokens (--insecure)" in caplog.text and port > 0
    server.stop(grace=0)


def test_a_message_larger_than_the_chunk_plan_allows_is_refused_before_it_is_buffered():
    c = _config()
    coordinator = Coordinator(c, {"w": np.zeros(100_000, np.float32)}, ["a", "b"])
    server, service, port = serve(coordinator, "localhost:0", c.comm.chunk_bytes)
    largest = max(k.nbytes for k in coordinator.fragments[0].plan)  # 65,536 bytes of float32 values
    assert service.receive_limit() == largest + wire.FRAMING_BYTES + 4096
    with grpc.insecure_channel(f"localhost:{port}", options=[("grpc.max_send_message_length", 1 << 24)]) as ch:
        contribute = ch.stream_unary(f"/{SERVICE_NAME}/Contribute", lambda x: x, pb.ContributeReply.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            contribute(iter([b"C" + bytes(service.receive_limit())]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert coordinator.round == 0 and not coordinator.fragments[0].pending
    server.stop(grace=0)


def test_an_island_will_not_send_its_token_in_the_clear_beyond_loopback():
    c = _config()
    with pytest.raises(security.SecurityError, match="in the clear: set comm.tls.ca_file"):
        GrpcTransport("coordinator.example.org:50051", c.comm.chunk_bytes, token="x" * 43)


def test_a_token_listed_for_an_island_outside_the_run_opens_nothing(secure, tmp_path):
    c, coordinator, address, made = secure
    token = secrets.token_urlsafe(32)
    tokens = json.load(open(made["tokens_file"]))
    tokens["islands"]["z"] = security.hash_token(token)  # a stale entry: z is not in this run's config
    with open(made["tokens_file"], "w") as f:
        json.dump(tokens, f)
    time.sleep(security.RELOAD_CHECK_SECONDS + 0.1)
    refused = {name: grpc.StatusCode.UNAUTHENTICATED for name in ("Join", "Contribute", "FetchUpdate", "FetchView")}
    assert _calls(address, made, security.call_metadata("z", token), island="z") == refused
    assert coordinator.fragments[0].joined == set() and coordinator.viewed == set()


def test_a_stream_refused_after_its_last_chunk_is_not_merged(secure):
    c, coordinator, address, made = secure
    start = coordinator.checksum
    t = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30, tls=c.comm.tls,
                      token=_token(made, "a"))
    t.join("a", fingerprint_fields(c), start)
    payload = codec.encode({"w": np.full(100_000, 0.5, np.float32)}, "none", 256)
    b = GrpcTransport(address, c.comm.chunk_bytes, join_timeout=30, round_timeout=30, tls=c.comm.tls,
                      token=_token(made, "b"), pipeline=False)
    b.join("b", fingerprint_fields(c), start)
    assert b.contribute(ContributionHeader(0, "b", 1000, start), payload) == "accepted"  # a's chunks would close it
    header = wire.payload_header(ContributionHeader(0, "a", 1000, start), t.layouts[0], 1, len(payload),
                                 wire.new_attempt(), t.incarnation)
    frames = [wire.header_frame(header), *(f for _, f in wire.chunk_frames(payload, t.plans[0]))]

    def stream():  # every chunk, then (once they have reached the merge) a frame of no known kind
        yield from frames
        time.sleep(1.0)
        yield b"X"

    creds = security.channel_credentials(made["ca_file"])
    with grpc.secure_channel(address, creds, options=client_options(c.comm.chunk_bytes)) as ch:
        contribute = ch.stream_unary(f"/{SERVICE_NAME}/Contribute", lambda x: x, pb.ContributeReply.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            contribute(stream(), metadata=security.call_metadata("a", _token(made, "a")), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert coordinator.round == 0 and "a" not in coordinator.fragments[0].pending and coordinator.checksum == start
    t.close()
    b.close()


def test_a_service_whose_start_fails_raises_that_error_at_once(secure, tmp_path):
    """`serve` raises what its server thread met while starting, instead of waiting for a start that never comes."""
    c, coordinator, address, made = secure
    # a `comm.tls` without require_client_cert (an old config file's section): the thread's AttributeError
    tls = ml_collections.ConfigDict({k: v for k, v in c.comm.tls.items() if k != "require_client_cert"})
    start = time.monotonic()
    with pytest.raises(AttributeError, match="require_client_cert"):
        serve(Coordinator(c, {"w": np.zeros(10, np.float32)}, ["a", "b"]), "localhost:0",
              c.comm.chunk_bytes, tls=tls)
    assert time.monotonic() - start < 1.0
    # the port the fixture's coordinator listens on: refused, not shared with it
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"cannot listen on {address} .*pick a free port"):
        serve(Coordinator(c, {"w": np.zeros(10, np.float32)}, ["a", "b"]), address, c.comm.chunk_bytes)
    assert time.monotonic() - start < 1.0
