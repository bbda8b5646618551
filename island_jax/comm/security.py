"""Who may talk to the coordinator: TLS for the channel, a bearer token per island for each call.

The exchange carries a run's model updates over networks the run does not own,
so both ends prove who they are:

* TLS (`server_credentials`, `channel_credentials`): the island checks the
  coordinator's certificate against the run's CA; with
  `require_client_cert` the coordinator also checks the island's
  certificate against it (mutual TLS).
* A bearer token per island (`read_token`, `call_metadata`): every call of
  the Exchange service carries the metadata

      authorization: Bearer <token>
      x-island: <island name>

  and `AuthInterceptor` answers UNAUTHENTICATED unless the token is the
  one `TokenTable` lists for that island. The coordinator keeps only the
  tokens' SHA-256 hashes (`hash_token`), in a JSON file it re-reads when it
  changes, so a token removed from it is refused from its next call on.
  Handlers compare `authenticated_island(context)` with the island a request
  names, so one island cannot speak for another.

`make_run_credentials` makes all of it for one run (a throwaway CA, the
server's and the islands' certificates, one token per island) with the
`cryptography` package. Every problem with these files raises `SecurityError`
saying what to fix.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import threading
import time

import grpc

log = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"  # metadata keys (gRPC metadata keys are lower case)
ISLAND_KEY = "x-island"
BEARER = "Bearer "
RELOAD_CHECK_SECONDS = 0.5  # TokenTable looks at its file's mtime and size at most this often
WARN_INTERVAL_SECONDS = 10.0  # one refusal warning per (claimed island, reason) per this many seconds
CERT_DAYS = 3650  # validity of the certificates make_run_credentials makes
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # island names (they name token_<island> files)
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


class SecurityError(ValueError):
    """A credential (token, tokens file, certificate, key) is missing or malformed; the message says what to fix."""


# -- tokens --------------------------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    """The form in which the coordinator keeps a token: "sha256:" + the hex SHA-256 digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def read_token(token_file: str, token_env: str) -> str | None:
    """The island's bearer token: the content of `token_file` (stripped), or else the environment variable `token_env`.

    Args:
      token_file: path of a file holding the token ("" = not from a file).
      token_env: name of an environment variable holding the token ("" = not from the environment).
        With both given, the file wins.

    Returns:
      The token, or None when both arguments are "" (the run uses no tokens).

    Raises:
      SecurityError: the file is missing, unreadable or empty, or the variable is unset or empty.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except FileNotFoundError:
            raise SecurityError(
                f"the island's token file {token_file} does not exist; write the token the coordinator lists for "
                "this island there (make_run_credentials writes token_<island> files) or name another file"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise SecurityError(f"cannot read the island's token file {token_file} ({e}); check its path and "
                                "permissions") from None
        if not token:
            raise SecurityError(f"the island's token file {token_file} is empty; write the island's token there")
        return _checked_token(token, f"the token in {token_file}")
    if token_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token_env):
            raise SecurityError("comm.auth.token_env must name an environment variable (letters, digits, _), "
                                "not hold the token itself")
        token = os.environ.get(token_env, "").strip()
        if not token:
            state = "is empty" if token_env in os.environ else "is not set"
            raise SecurityError(f"the environment variable {token_env}, which should hold the island's token, "
                                f"{state}; export {token_env}=<token> before starting the island, or use a token file")
        return _checked_token(token, f"the token in ${token_env}")
    return None


def _checked_token(token: str, where: str) -> str:
    """`token`, if it can travel as gRPC metadata (printable ASCII, no spaces); SecurityError (never naming it)."""
    if not all(33 <= ord(ch) < 127 for ch in token):
        raise SecurityError(f"{where} holds spaces or characters other than printable ASCII; a token is one word "
                            "such as secrets.token_urlsafe(32) makes")
    return token


def call_metadata(island: str, token: str) -> tuple[tuple[str, str], ...]:
    """The metadata an island sends with every Exchange call: its token and its name.

    Returns:
      (("authorization", "Bearer <token>"), ("x-island", island)); pass it as `metadata=` of each call.
    """
    return ((AUTHORIZATION_KEY, BEARER + token), (ISLAND_KEY, island))


def _check_name(island: str) -> None:
    if not isinstance(island, str) or not _NAME.match(island):
        raise SecurityError(f"island name {island!r} cannot be used for credentials: use letters, digits, '_', "
                            "'.' and '-' (at most 128, not starting with '.', '_' or '-')")


def _parse_table(text: str, path: str) -> dict[str, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SecurityError(f"tokens file {path} is not valid JSON ({e})") from None
    islands = data.get("islands") if isinstance(data, dict) else None
    if not isinstance(islands, dict):
        raise SecurityError(f'tokens file {path} must hold {{"islands": {{"<island>": "sha256:<hex>", ...}}}}')
    for name, digest in islands.items():
        if not isinstance(name, str) or not name:
            raise SecurityError(f"tokens file {path}: island names must be non-empty strings")
        if not isinstance(digest, str) or not _HASH.match(digest):
            raise SecurityError(f"tokens file {path}: the entry of island {name!r} must be \"sha256:\" and 64 "
                                "lower-case hex digits (hash_token of the island's token), not a token itself")
    return dict(islands)


class TokenTable:
    """The coordinator's table of island tokens, kept as hashes in a JSON file and re-read when it changes.

    The file is `{"islands": {"a": "sha256:<hex>", "b": "sha256:<hex>"}}`
    (`hash_token` of each island's token). At most every
    `RELOAD_CHECK_SECONDS` (0.5 s) a lookup checks the file's mtime and size
    and re-reads it when they changed, so an island removed from it is refused
    from its next call on. A rewrite that does not parse (or a file that went
    missing) keeps the last good table and logs an error. Safe to use from any
    thread.

    Args:
      path: the tokens file.

    Raises:
      SecurityError: the file is missing, unreadable or malformed at construction.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        try:
            stamp = self._stamp()
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise SecurityError(f"tokens file {path} does not exist; make it with make_run_credentials or name "
                                "another file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SecurityError(f"cannot read tokens file {path} ({e})") from None
        self._table = _parse_table(text, path)
        self._failed: str | None = None  # the last reload error logged
        self._stamp_seen = stamp
        self._checked = time.monotonic()

    def _stamp(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._checked < RELOAD_CHECK_SECONDS:
                return
            self._checked = now
            try:
                stamp = self._stamp()
                if stamp == self._stamp_seen:
                    return
                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
                table = _parse_table(text, self.path)
            except (OSError, UnicodeDecodeError, SecurityError) as e:
                if self._failed != str(e):  # one line per distinct failure
                    log.error("tokens file %s could not be reloaded (%s); keeping the last good table of %d "
                              "islands", self.path, e, len(self._table))
                    self._failed = str(e)
                return
            self._failed = None
            self._stamp_seen = stamp
            if table != self._table:
                log.info("tokens file %s reloaded: islands %s", self.path, sorted(table))
            self._table = table

    def island_for(self, token: str) -> str | None:
        """The island whose token this is, or None. Every entry is compared in constant time (hmac.compare_digest)."""
        self._maybe_reload()
        digest = hash_token(token).encode("ascii")
        found = None
        for name, expected in self._table.items():  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(digest, expected.encode("ascii")) and found is None:
                found = name
        return found

    def names(self) -> list[str]:
        """The islands the table lists now (sorted)."""
        self._maybe_reload()
        return sorted(self._table)


# -- the server's check --------------------------------------------------------------------------------------


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def authenticated_island(context) -> str | None:
    """The island a call was made for (its `x-island` metadata), for the Exchange service's handlers.

    `AuthInterceptor` has checked that the call's token belongs to this island,
    so a handler compares it with the island named in the request body. None
    when the call has no `x-island` (only possible on a server without the
    interceptor).
    """
    return _metadata_value(context.invocation_metadata(), ISLAND_KEY)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of one gRPC service that carry no valid token for the island they claim to be.

    For each method of `service` (full name "/<service>/<Method>") the call
    must carry metadata `authorization: Bearer <token>` and `x-island: <name>`,
    and `table.island_for(token)` must be that name. Otherwise the call is
    answered UNAUTHENTICATED: the interceptor returns a method handler of the
    method's own cardinality whose body aborts (an aio interceptor cannot abort
    itself; it can only choose the handler), and the real handler never runs.
    Each refusal logs a warning with the method, the peer address and the
    reason, at most one per (claimed island, reason) per
    `WARN_INTERVAL_SECONDS`. Neither the log nor the status message contains
    the token. Other services (grpc.health.v1, reflection) pass unchecked.
    The check runs on the server's event loop; its only I/O is the table's
    stat of the tokens file, at most every `RELOAD_CHECK_SECONDS`.

    Args:
      table: the coordinator's `TokenTable`.
      service: the full service name to guard, e.g. grpc_server.SERVICE_NAME.
    """

    def __init__(self, table: TokenTable, service: str):
        self.table = table
        self.prefix = f"/{service}/"
        self._warned: dict[tuple[str, str], float] = {}
        self._warn_lock = threading.Lock()

    def _refusal(self, metadata) -> tuple[str, str, str] | None:
        """(claimed island, reason for the log, message for the caller), or None when the call may go on."""
        claimed = _metadata_value(metadata, ISLAND_KEY) or ""
        authorization = _metadata_value(metadata, AUTHORIZATION_KEY)
        if not claimed:
            return ("", "no island name", f"the call carries no '{ISLAND_KEY}' metadata naming the island")
        if not _NAME.match(claimed):  # the caller's words: an island name or nothing
            return (claimed[:64], "not an island name", f"the '{ISLAND_KEY}' metadata is not an island name")
        if authorization is None:
            return (claimed, "no token", f"the call carries no '{AUTHORIZATION_KEY}: Bearer <token>' metadata; "
                                         "give the island its token")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return (claimed, "malformed authorization",
                    f"the '{AUTHORIZATION_KEY}' metadata must be 'Bearer <token>'")
        owner = self.table.island_for(token)
        if owner is None:
            return (claimed, "unknown token", f"the token is not valid for island {claimed!r}")
        if owner != claimed:
            return (claimed, "token of another island", f"the token is not valid for island {claimed!r}")
        return None

    def _warn(self, method: str, peer: str, claimed: str, reason: str) -> None:
        now = time.monotonic()
        key = (claimed, reason)
        with self._warn_lock:
            last = self._warned.get(key)
            if last is not None and now - last < WARN_INTERVAL_SECONDS:
                return
            if len(self._warned) > 1024:  # names are the caller's: keep the map small
                self._warned = {k: t for k, t in self._warned.items() if now - t < WARN_INTERVAL_SECONDS}
            self._warned[key] = now
        log.warning("refused %s from %s claiming island %r: %s (UNAUTHENTICATED)", method, peer or "unknown peer",
                    claimed, reason)

    def _aborting(self, handler, method: str, claimed: str, reason: str, message: str):
        async def refuse(context) -> None:
            try:
                peer = context.peer()
            except Exception:  # noqa: BLE001 - the peer is only for the log
                peer = ""
            self._warn(method, peer, claimed, reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        request_streaming = handler is not None and handler.request_streaming
        response_streaming = handler is not None and handler.response_streaming
        if response_streaming:
            async def body(request, context):
                await refuse(context)
                yield b""  # never reached: abort raises

            make = grpc.stream_stream_rpc_method_handler if request_streaming else grpc.unary_stream_rpc_method_handler
        else:
            async def body(request, context):
                await refuse(context)

            make = grpc.stream_unary_rpc_method_handler if request_streaming else grpc.unary_unary_rpc_method_handler
        return make(body)  # no deserializer: the refused request is never parsed

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self.prefix):
            return await continuation(handler_call_details)
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)  # only for its cardinality
        return self._aborting(handler, method, *refusal)


# -- TLS -----------------------------------------------------------------------------------------------------


def _read_pem(path: str, key: str, what: str, marker: str) -> bytes:
    if not path:
        raise SecurityError(f"{key} is not set; name the {what} (PEM)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SecurityError(f"{key} = {path}: the file does not exist; name the {what} (PEM)") from None
    except OSError as e:
        raise SecurityError(f"{key} = {path}: cannot read the {what} ({e}); check its permissions") from None
    if b"-----BEGIN " not in data or marker.encode() not in data:
        raise SecurityError(f"{key} = {path} does not hold a PEM {what} (no '-----BEGIN ...{marker}' line)")
    return data


def server_credentials(cert_file: str, key_file: str, ca_file: str = "",
                       require_client_cert: bool = False) -> grpc.ServerCredentials:
    """The coordinator's TLS credentials, for `server.add_secure_port(address, credentials)`.

    Args:
      cert_file: the server's certificate chain (PEM), `comm.tls.cert_file`.
      key_file: its private key (PEM), `comm.tls.key_file`.
      ca_file: the CA that signs island certificates (PEM), `comm.tls.ca_file`; needed with `require_client_cert`.
      require_client_cert: mutual TLS: refuse islands without a certificate the CA signed.

    Raises:
      SecurityError: a file is missing, unreadable or not PEM (naming the config key), or
        `require_client_cert` without `ca_file`.
    """
    cert = _read_pem(cert_file, "comm.tls.cert_file", "server certificate", "CERTIFICATE")
    key = _read_pem(key_file, "comm.tls.key_file", "server private key", "PRIVATE KEY")
    if require_client_cert and not ca_file:
        raise SecurityError("comm.tls.ca_file is not set, but client certificates are required; name the CA that "
                            "signs the islands' certificates")
    ca = _read_pem(ca_file, "comm.tls.ca_file", "CA certificate", "CERTIFICATE") if ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_cert)


def channel_credentials(ca_file: str, client_cert_file: str = "", client_key_file: str = "") -> grpc.ChannelCredentials:
    """An island's TLS credentials, for `grpc.secure_channel(target, credentials, options)`.

    Args:
      ca_file: the CA that signed the coordinator's certificate (PEM), `comm.tls.ca_file`
        ("" = the system's trusted roots).
      client_cert_file, client_key_file: the island's certificate and key (PEM) for mutual TLS,
        `comm.tls.client_cert_file` and `comm.tls.client_key_file`; both or neither.

    Raises:
      SecurityError: a file is missing, unreadable or not PEM (naming the config key), or only one of the
        client certificate and key is given.
    """
    ca = _read_pem(ca_file, "comm.tls.ca_file", "CA certificate", "CERTIFICATE") if ca_file else None
    if bool(client_cert_file) != bool(client_key_file):
        missing = "comm.tls.client_key_file" if client_cert_file else "comm.tls.client_cert_file"
        raise SecurityError(f"{missing} is not set; a client certificate needs both comm.tls.client_cert_file and "
                            "comm.tls.client_key_file")
    cert = key = None
    if client_cert_file:
        cert = _read_pem(client_cert_file, "comm.tls.client_cert_file", "client certificate", "CERTIFICATE")
        key = _read_pem(client_key_file, "comm.tls.client_key_file", "client private key", "PRIVATE KEY")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def target_name_options(server_name: str) -> list[tuple[str, str]]:
    """Channel options checking the coordinator's certificate for `server_name` instead of the dialled host.

    Returns:
      [("grpc.ssl_target_name_override", server_name)], or [] when `server_name` is "".
    """
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


# -- one run's credentials -----------------------------------------------------------------------------------

_CERT_FILES = {"ca_file": "ca.pem", "cert_file": "server.pem", "key_file": "server.key",
               "client_cert_file": "client.pem", "client_key_file": "client.key"}
TOKENS_FILE = "tokens.json"


def _write_private(path: str, data: bytes) -> None:
    """Writes `data` to `path` with mode 0600, atomically (a temporary file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _san(hosts: list[str]):
    from cryptography import x509

    names, seen = [], set()
    for host in ["localhost", "127.0.0.1", *hosts]:
        host = host.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _covers(pems: dict[str, bytes], hosts: list[str]) -> bool:
    """True when the CA signed both certificates, they are valid for more than a day yet, and the server's
    names every one of `hosts`."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        ca = x509.load_pem_x509_certificate(pems["ca_file"])
        now = datetime.datetime.now(datetime.timezone.utc)
        for k in ("cert_file", "client_cert_file"):
            cert = x509.load_pem_x509_certificate(pems[k])
            cert.verify_directly_issued_by(ca)
            if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc - datetime.timedelta(days=1):
                return False
        server = x509.load_pem_x509_certificate(pems["cert_file"])
        have = set(server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature) as e:
        log.warning("certificates in the run's credentials folder are unusable (%s); making new ones", e)
        return False
    return all(name in have for name in _san(hosts))


def _make_certs(hosts: list[str]) -> dict[str, bytes]:
    """A new CA, a server certificate for `hosts` and one client certificate, as PEM by _CERT_FILES key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "island_jax run"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("island_jax run CA " + secrets.token_hex(4))
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage, san):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    server_cert, server_key = leaf("island_jax coordinator", ExtendedKeyUsageOID.SERVER_AUTH, _san(hosts))
    client_cert, client_key = leaf("island_jax island", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return {"ca_file": ca.public_bytes(serialization.Encoding.PEM), "cert_file": server_cert,
            "key_file": server_key, "client_cert_file": client_cert, "client_key_file": client_key}


def make_run_credentials(folder: str, islands: list[str], hosts: list[str]) -> dict:
    """Makes (or reuses) one run's TLS certificates and island tokens in `folder`.

    Writes, each with mode 0600 in a folder of mode 0700: ca.pem (a throwaway
    ECDSA P-256 CA, whose key is not kept), server.pem and server.key (the
    coordinator's certificate, for `hosts` plus "localhost" and 127.0.0.1 as
    subjectAltNames), client.pem and client.key (one certificate for every
    island, for mutual TLS), token_<island> (secrets.token_urlsafe(32) each)
    and tokens.json (their hashes, as `TokenTable` reads it).

    A folder that holds them already (a resumed run) keeps them: the
    certificates while the server's still names every host and is valid for
    more than a day (else all five are made anew), and each island's token
    while its file matches tokens.json; islands not yet listed get new tokens.
    Islands in tokens.json but not in `islands` stay listed.

    Args:
      folder: where the files go (created if needed).
      islands: the run's island names (letters, digits, '_', '.', '-').
      hosts: the coordinator's host names and IP addresses, as islands dial it.

    Returns:
      {"ca_file", "cert_file", "key_file", "client_cert_file", "client_key_file", "tokens_file": path,
       "token_files": {island: path}}.

    Raises:
      SecurityError: an island name unfit for a file name, or a tokens.json there that does not parse.
    """
    for island in islands:
        _check_name(island)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    paths = {k: os.path.join(folder, v) for k, v in _CERT_FILES.items()}

    existing = {}
    if all(os.path.isfile(p) for p in paths.values()):
        for k, p in paths.items():
            with open(p, "rb") as f:
                existing[k] = f.read()
        if not _covers(existing, hosts):
            log.info("certificates in %s do not cover hosts %s (or expire soon); making new ones", folder, hosts)
            existing = {}
    if not existing:
        for k, data in _make_certs(hosts).items():
            _write_private(paths[k], data)
    else:
        for p in paths.values():
            os.chmod(p, 0o600)

    tokens_file = os.path.join(folder, TOKENS_FILE)
    table: dict[str, str] = {}
    if os.path.isfile(tokens_file):
        with open(tokens_file, encoding="utf-8") as f:
            table = _parse_table(f.read(), tokens_file)
    token_files = {}
    for island in islands:
        path = token_files[island] = os.path.join(folder, f"token_{island}")
        token = None
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                token = f.read().strip() or None
        if token is None or island not in table or not hmac.compare_digest(table[island], hash_token(token)):
            token = secrets.token_urlsafe(32)
            _write_private(path, (token + "\n").encode("ascii"))
            table[island] = hash_token(token)
        else:
            os.chmod(path, 0o600)
    text = json.dumps({"islands": dict(sorted(table.items()))}, indent=2) + "\n"
    if _read_text(tokens_file) != text:
        _write_private(tokens_file, text.encode("utf-8"))  # unchanged: not rewritten (a running TokenTable reloads)
    os.chmod(tokens_file, 0o600)
    return {**paths, "tokens_file": tokens_file, "token_files": token_files}


def is_loopback(address: str) -> bool:
    """Whether "HOST:PORT" is on this machine only ("localhost", 127.0.0.0/8, ::1)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name
        return False


def check_exposure(address: str, tls, tokens_file: str, insecure: bool) -> None:
    """Refuses to listen off loopback without TLS and tokens, unless `insecure` (the `--insecure` flag).

    Raises:
      SecurityError: `address` is not loopback, TLS (`comm.tls.cert_file`) or tokens (`comm.auth.tokens_file`)
        are missing, and `insecure` is False.
    """
    secured = tls is not None and bool(tls.cert_file) and bool(tokens_file)
    if is_loopback(address) or secured:
        return
    if insecure:
        log.warning("listening on %s without TLS and tokens (--insecure): anyone who reaches the port can "
                        "join, read the model and contribute", address)
        return
    raise SecurityError(
        f"the coordinator would listen on {address}, beyond this machine, without TLS and per-island tokens: set "
        "comm.tls (cert_file, key_file, ca_file) and comm.auth.tokens_file (see docs/security.md; launch/local.py "
        "--tls makes them for a run), or pass --insecure to listen in the clear anyway"
    )
