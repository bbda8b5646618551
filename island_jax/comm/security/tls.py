"""TLS for the exchange channel: the coordinator's certificate checked against the run's CA by every island,
and with `require_client_cert` the island's checked by the coordinator (mutual TLS). Files are PEM, named by
`comm.tls`; a missing or malformed one raises `SecurityError` naming its config key.
"""

from __future__ import annotations

import grpc

from island_jax.comm.security.exposure import SecurityError


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
