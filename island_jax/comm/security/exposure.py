"""When the exchange port needs protection: beyond loopback, TLS and per-island tokens (or `--insecure`).

`SecurityError` is what every problem with a credential raises (auth, TLS, the minting of a run's
credentials), its message saying what to fix.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger(__package__)  # one logger for island_jax.comm.security


class SecurityError(ValueError):
    """A credential (token, tokens file, certificate, key) is missing or malformed; the message says what to fix."""


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
