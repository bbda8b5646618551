"""Bearer tokens bound to island names: every call of the Exchange service carries

    authorization: Bearer <token>
    x-island: <island name>

and `AuthInterceptor` answers UNAUTHENTICATED unless the token is the one `TokenTable` lists for that island.
The coordinator keeps only the tokens' SHA-256 hashes (`hash_token`), in a JSON file it re-reads when it
changes, so a token removed from it is refused from its next call on. Handlers compare
`authenticated_island(context)` with the island a request names, so one island cannot speak for another.
`CallMetadata` is the island's side: it stamps the token and name on every call of a channel.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time

import grpc

from island_jax.comm.security.exposure import SecurityError

log = logging.getLogger(__package__)  # one logger for island_jax.comm.security

AUTHORIZATION_KEY = "authorization"  # metadata keys (gRPC metadata keys are lower case)
ISLAND_KEY = "x-island"
BEARER = "Bearer "
RELOAD_CHECK_SECONDS = 0.5  # TokenTable looks at its file's mtime and size at most this often
WARN_INTERVAL_SECONDS = 10.0  # one refusal warning per (claimed island, reason) per this many seconds
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # island names (they name token_<island> files)
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


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


def check_name(island: str) -> None:
    """Raises SecurityError unless `island` can name credentials (letters, digits, '_', '.', '-'; at most 128)."""
    if not isinstance(island, str) or not _NAME.match(island):
        raise SecurityError(f"island name {island!r} cannot be used for credentials: use letters, digits, '_', "
                            "'.' and '-' (at most 128, not starting with '.', '_' or '-')")


def parse_table(text: str, path: str) -> dict[str, str]:
    """{island: "sha256:<hex>"} from a tokens file's `text`; SecurityError (naming `path`) if malformed."""
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
        self._table = parse_table(text, path)
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
                table = parse_table(text, self.path)
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
      service: the full service name to guard, e.g. options.SERVICE_NAME.
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


class CallMetadata(
    grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor
):
    """Adds `metadata()` to every call of a channel (the island's token and name, `call_metadata`)."""

    def __init__(self, metadata):
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata()))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)
