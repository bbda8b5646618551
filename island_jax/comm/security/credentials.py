"""The minting of one run's credentials: a throwaway CA, the coordinator's and the islands' certificates and one
token per island, made with the `cryptography` package (`make_run_credentials`).
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import json
import logging
import os
import secrets

from island_jax.comm.security.auth import check_name, hash_token, parse_table

log = logging.getLogger(__package__)  # one logger for island_jax.comm.security

CERT_DAYS = 3650  # validity of the certificates make_run_credentials makes
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
        check_name(island)
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
            table = parse_table(f.read(), tokens_file)
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
