"""Who may talk to the coordinator: TLS for the channel, a bearer token per island for each call.

The exchange carries a run's model updates over networks the run does not own, so both ends prove who they
are: `tls` (the coordinator's certificate against the run's CA; mutual TLS with client certificates), `auth`
(a token bound to each island's name on every exchange call), `exposure` (beyond loopback both are needed)
and `credentials` (the minting of one run's certificates and tokens). The names below are the package's door.
"""

from island_jax.comm.security.auth import (
    AUTHORIZATION_KEY,
    BEARER,
    ISLAND_KEY,
    RELOAD_CHECK_SECONDS,
    WARN_INTERVAL_SECONDS,
    AuthInterceptor,
    CallMetadata,
    TokenTable,
    authenticated_island,
    call_metadata,
    hash_token,
    read_token,
)
from island_jax.comm.security.credentials import CERT_DAYS, TOKENS_FILE, make_run_credentials
from island_jax.comm.security.exposure import SecurityError, check_exposure, is_loopback
from island_jax.comm.security.tls import channel_credentials, server_credentials, target_name_options

__all__ = [
    "AUTHORIZATION_KEY", "BEARER", "CERT_DAYS", "ISLAND_KEY", "RELOAD_CHECK_SECONDS", "TOKENS_FILE",
    "WARN_INTERVAL_SECONDS", "AuthInterceptor", "CallMetadata", "SecurityError", "TokenTable",
    "authenticated_island", "call_metadata", "channel_credentials", "check_exposure", "hash_token", "is_loopback",
    "make_run_credentials", "read_token", "server_credentials", "target_name_options",
]
