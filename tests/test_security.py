"""island_jax/comm/security/: tokens, the tokens table, the server's check, TLS and one run's credentials.

A tiny grpc.aio server on a thread serves the Exchange service's four method
shapes (trivial bodies) and the health service over mutual TLS, behind
`AuthInterceptor`; clients are plain synchronous channels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import threading
import time

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from island_jax.comm import security
from island_jax.comm.security import (
    AuthInterceptor,
    SecurityError,
    TokenTable,
    authenticated_island,
    call_metadata,
    channel_credentials,
    hash_token,
    make_run_credentials,
    read_token,
    server_credentials,
    target_name_options,
)

SERVICE = "island_jax.exchange.Exchange"
METHODS = ("Join", "Contribute", "FetchUpdate", "FetchView")
TIMEOUT = 5.0


def _island(context) -> bytes:
    return (authenticated_island(context) or "").encode()


async def _join(request, context):
    return b"joined:" + _island(context)


async def _contribute(request_iterator, context):
    n = 0
    async for _ in request_iterator:
        n += 1
    return b"contributed:%d:" % n + _island(context)


async def _fetch(request, context):
    yield b"chunk"
    yield b"trailer:" + _island(context)


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Join": grpc.unary_unary_rpc_method_handler(_join),
        "Contribute": grpc.stream_unary_rpc_method_handler(_contribute),
        "FetchUpdate": grpc.unary_stream_rpc_method_handler(_fetch),
        "FetchView": grpc.unary_stream_rpc_method_handler(_fetch),
    })


class _Server:
    """A grpc.aio server on its own event loop thread (as grpc_server.ExchangeServer runs one)."""

    def __init__(self, creds: dict, interceptor: AuthInterceptor):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            self.server = grpc.aio.server(interceptors=[interceptor])
            self.server.add_generic_rpc_handlers((_handler(),))
            servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
            credentials = server_credentials(creds["cert_file"], creds["key_file"], creds["ca_file"],
                                             require_client_cert=True)
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
            await self.server.start()
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("creds") / "run")
    creds = make_run_credentials(folder, ["a", "b", "c"], ["coordinator.example", "10.1.2.3"])
    interceptor = AuthInterceptor(TokenTable(creds["tokens_file"]), SERVICE)
    server = _Server(creds, interceptor)
    tokens = {i: read_token(p, "") for i, p in creds["token_files"].items()}
    yield {"creds": creds, "server": server, "interceptor": interceptor, "tokens": tokens,
           "target": f"localhost:{server.port}"}
    server.stop()


def _channel(creds: dict, target: str, client_cert: bool = True) -> grpc.Channel:
    if client_cert:
        credentials = channel_credentials(creds["ca_file"], creds["client_cert_file"], creds["client_key_file"])
    else:
        credentials = channel_credentials(creds["ca_file"])
    return grpc.secure_channel(target, credentials)


def _call(channel: grpc.Channel, method: str, metadata=None):
    path = f"/{SERVICE}/{method}"
    if method == "Join":
        return channel.unary_unary(path)(b"join", metadata=metadata, timeout=TIMEOUT)
    if method == "Contribute":
        return channel.stream_unary(path)(iter([b"x", b"y", b"z"]), metadata=metadata, timeout=TIMEOUT)
    return list(channel.unary_stream(path)(b"fetch", metadata=metadata, timeout=TIMEOUT))


def _code(channel: grpc.Channel, method: str, metadata=None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        _call(channel, method, metadata)
    return e.value.code(), e.value.details()


EXPECTED = {
    "Join": b"joined:a",
    "Contribute": b"contributed:3:a",
    "FetchUpdate": [b"chunk", b"trailer:a"],
    "FetchView": [b"chunk", b"trailer:a"],
}


# -- the server's check over TLS -----------------------------------------------------------------------------


def test_correct_calls_succeed(run):
    with _channel(run["creds"], run["target"]) as channel:
        for method in METHODS:
            assert _call(channel, method, call_metadata("a", run["tokens"]["a"])) == EXPECTED[method]


@pytest.mark.parametrize("case", ["no token", "b's token claiming a", "unknown token", "no island"])
def test_refused_calls_are_unauthenticated(run, case):
    tokens = run["tokens"]
    metadata = {
        "no token": (("x-island", "a"),),
        "b's token claiming a": call_metadata("a", tokens["b"]),
        "unknown token": call_metadata("a", "not-a-token-of-this-run"),
        "no island": (("authorization", f"Bearer {tokens['a']}"),),
    }[case]
    with _channel(run["creds"], run["target"]) as channel:
        for method in METHODS:
            code, details = _code(channel, method, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
            assert tokens["a"] not in details and tokens["b"] not in details


def test_health_answers_without_a_token(run):
    with _channel(run["creds"], run["target"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_client_cannot_connect(run):
    with grpc.insecure_channel(run["target"]) as channel:
        code, _ = _code(channel, "Join", call_metadata("a", run["tokens"]["a"]))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_fails_the_handshake(run, tmp_path):
    other = make_run_credentials(str(tmp_path / "other"), ["a"], [])
    with _channel(other, run["target"]) as channel:
        code, _ = _code(channel, "Join", call_metadata("a", run["tokens"]["a"]))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_fails_mutual_tls(run):
    with _channel(run["creds"], run["target"], client_cert=False) as channel:
        code, _ = _code(channel, "Join", call_metadata("a", run["tokens"]["a"]))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_server_name_override(run):
    """The certificate names coordinator.example, dialled as 127.0.0.1 with the override; a name it lacks fails."""
    creds, port = run["creds"], run["server"].port
    credentials = channel_credentials(creds["ca_file"], creds["client_cert_file"], creds["client_key_file"])
    metadata = call_metadata("a", run["tokens"]["a"])
    options = target_name_options("coordinator.example")
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        assert _call(channel, "Join", metadata) == b"joined:a"
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=target_name_options("other.example")) as ch:
        assert _code(ch, "Join", metadata)[0] == grpc.StatusCode.UNAVAILABLE


def test_refusal_warning_names_the_island_never_the_token(run, caplog):
    run["interceptor"]._warned.clear()
    token = run["tokens"]["b"]
    with caplog.at_level(logging.WARNING, logger="island_jax.comm.security"), \
            _channel(run["creds"], run["target"]) as channel:
        for _ in range(3):  # rate-limited: one line for the same (island, reason)
            _code(channel, "Join", call_metadata("a", token))
        _code(channel, "FetchView", call_metadata("a", "unknown-token-value"))
    lines = [r.getMessage() for r in caplog.records if r.name == "island_jax.comm.security"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"refused /{SERVICE}/Join from ipv")
    assert "claiming island 'a': token of another island (UNAUTHENTICATED)" in lines[0]
    assert "claiming island 'a': unknown token (UNAUTHENTICATED)" in lines[1]
    assert all(token not in line and "unknown-token-value" not in line for line in lines)


def test_revoked_island_is_refused_from_its_next_call(run):
    creds, tokens = run["creds"], run["tokens"]
    with _channel(creds, run["target"]) as channel:
        assert _call(channel, "Join", call_metadata("c", tokens["c"])) == b"joined:c"
        with open(creds["tokens_file"]) as f:
            table = json.load(f)
        del table["islands"]["c"]
        with open(creds["tokens_file"], "w") as f:
            json.dump(table, f)
        time.sleep(security.RELOAD_CHECK_SECONDS + 0.1)
        for method in METHODS:
            assert _code(channel, method, call_metadata("c", tokens["c"]))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _call(channel, "Join", call_metadata("a", tokens["a"])) == b"joined:a"


# -- the pieces ----------------------------------------------------------------------------------------------


def test_hash_and_metadata():
    assert hash_token("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert call_metadata("a", "t0k") == (("authorization", "Bearer t0k"), ("x-island", "a"))
    assert target_name_options("coord.example") == [("grpc.ssl_target_name_override", "coord.example")]
    assert target_name_options("") == []


def test_read_token(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("  secret-token\n")
    monkeypatch.setenv("ISLAND_TOKEN_TEST", " from-env ")
    assert read_token(str(path), "ISLAND_TOKEN_TEST") == "secret-token"
    assert read_token("", "ISLAND_TOKEN_TEST") == "from-env"
    assert read_token("", "") is None
    with pytest.raises(SecurityError, match="does not exist"):
        read_token(str(tmp_path / "missing"), "")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityError, match="is empty; write the island's token there"):
        read_token(str(tmp_path / "empty"), "")
    monkeypatch.delenv("ISLAND_TOKEN_TEST")
    with pytest.raises(SecurityError, match="ISLAND_TOKEN_TEST, which should hold the island's token, is not set"):
        read_token("", "ISLAND_TOKEN_TEST")
    monkeypatch.setenv("ISLAND_TOKEN_TEST", "")
    with pytest.raises(SecurityError, match="is empty; export ISLAND_TOKEN_TEST=<token>"):
        read_token("", "ISLAND_TOKEN_TEST")


def test_token_table(tmp_path, caplog):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"islands": {"a": hash_token("ta"), "b": hash_token("tb")}}))
    table = TokenTable(str(path))
    assert table.names() == ["a", "b"]
    assert (table.island_for("ta"), table.island_for("tb"), table.island_for("tc")) == ("a", "b", None)
    time.sleep(security.RELOAD_CHECK_SECONDS + 0.1)
    path.write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="island_jax.comm.security"):
        assert table.island_for("ta") == "a"  # the last good table
        time.sleep(security.RELOAD_CHECK_SECONDS + 0.1)
        assert table.island_for("tb") == "b"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "keeping the last good table of 2 islands" in errors[0]
    path.write_text(json.dumps({"islands": {"b": hash_token("tb"), "d": hash_token("td")}}))
    time.sleep(security.RELOAD_CHECK_SECONDS + 0.1)
    assert (table.island_for("ta"), table.island_for("td")) == (None, "d")
    assert table.names() == ["b", "d"]

    for bad, match in [("[1]", "must hold"), ('{"islands": {"a": "ta"}}', "not a token itself"), ("", "not valid JSON")]:
        path.write_text(bad)
        with pytest.raises(SecurityError, match=match):
            TokenTable(str(path))
    with pytest.raises(SecurityError, match="does not exist"):
        TokenTable(str(tmp_path / "missing.json"))


def test_tls_files_errors_name_the_config_key(tmp_path):
    creds = make_run_credentials(str(tmp_path / "run"), ["a"], [])
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(SecurityError, match=r"comm\.tls\.cert_file = .*missing\.pem: the file does not exist"):
        server_credentials(missing, creds["key_file"])
    with pytest.raises(SecurityError, match=r"comm\.tls\.key_file = .* does not hold a PEM server private key"):
        server_credentials(creds["cert_file"], creds["cert_file"])
    with pytest.raises(SecurityError, match=r"comm\.tls\.ca_file is not set, but client certificates are required"):
        server_credentials(creds["cert_file"], creds["key_file"], require_client_cert=True)
    with pytest.raises(SecurityError, match=r"comm\.tls\.ca_file = .*missing\.pem"):
        channel_credentials(missing)
    with pytest.raises(SecurityError, match=r"comm\.tls\.client_key_file is not set"):
        channel_credentials(creds["ca_file"], creds["client_cert_file"])
    with pytest.raises(SecurityError, match=r"comm\.tls\.client_cert_file = .*missing\.pem"):
        channel_credentials(creds["ca_file"], missing, creds["client_key_file"])
    assert isinstance(server_credentials(creds["cert_file"], creds["key_file"]), grpc.ServerCredentials)
    assert isinstance(channel_credentials(creds["ca_file"]), grpc.ChannelCredentials)


def test_run_credentials_files_and_reuse(tmp_path):
    folder = str(tmp_path / "run")
    creds = make_run_credentials(folder, ["a", "b"], ["coordinator.example", "10.1.2.3"])
    names = {"ca.pem", "server.pem", "server.key", "client.pem", "client.key", "tokens.json", "token_a", "token_b"}
    assert set(os.listdir(folder)) == names
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode) for n in names} == {0o600}
    assert creds["token_files"] == {"a": os.path.join(folder, "token_a"), "b": os.path.join(folder, "token_b")}
    assert creds["tokens_file"] == os.path.join(folder, "tokens.json")
    tokens = {i: read_token(p, "") for i, p in creds["token_files"].items()}
    assert len(tokens["a"]) == 43 and tokens["a"] != tokens["b"]
    with open(creds["tokens_file"]) as f:
        assert json.load(f) == {"islands": {i: hash_token(t) for i, t in tokens.items()}}  # hashes only
    with open(creds["cert_file"], "rb") as f:
        san = x509.load_pem_x509_certificate(f.read()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "coordinator.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]

    with open(creds["ca_file"], "rb") as f:
        ca = f.read()
    again = make_run_credentials(folder, ["a", "b", "c"], ["coordinator.example"])  # a resumed run, one more island
    assert again["token_files"]["a"] == creds["token_files"]["a"]
    assert {i: read_token(p, "") for i, p in again["token_files"].items() if i != "c"} == tokens
    with open(again["ca_file"], "rb") as f:
        assert f.read() == ca  # certificates kept: they name the host already
    assert TokenTable(again["tokens_file"]).names() == ["a", "b", "c"]
    make_run_credentials(folder, ["a"], ["elsewhere.example"])  # a host the certificate lacks: new certificates
    with open(again["ca_file"], "rb") as f:
        assert f.read() != ca
    with pytest.raises(SecurityError, match="cannot be used for credentials"):
        make_run_credentials(folder, ["../x"], [])
