"""Asks a coordinator's gRPC health service (grpc.health.v1) whether it is serving, over the run's TLS.

  python -m island_jax.health --address=HOST:PORT [--ca_file=CA.pem [--client_cert_file=C.pem
      --client_key_file=C.key] [--server_name=NAME]] [--service=NAME] [--timeout_seconds=5]

prints `HOST:PORT: SERVING` and exits 0 when the service answers SERVING; prints why not and exits 1 otherwise:
another status (NOT_SERVING, SERVICE_UNKNOWN, ...), no connection (nothing listening, a TLS handshake that fails:
an untrusted certificate, a wrong server name, a missing client certificate), a service the server does not know,
no answer within the timeout, or credential files that cannot be read. Bad arguments exit 2 (argparse).

With `--ca_file` the channel uses TLS, verifying the server against that CA (`--server_name`: the name its
certificate is checked for, when it differs from the host dialled, e.g. 127.0.0.1); without it, plaintext. It is
the coordinator's Kubernetes `exec` probe (launch/k8s.py; the kubelet's own gRPC probe speaks plaintext only:
docs/launch.md). The health service needs no island token, and only paths of credentials are passed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1


class HealthError(Exception):
    """The health service could not be asked: the message says where, what failed and what to check."""


def check(address: str, *, ca_file: str = "", client_cert_file: str = "", client_key_file: str = "",
          server_name: str = "", service: str = "", timeout_seconds: float = 5.0) -> str:
    """The status the health service at `address` gives for `service`.

    Args:
      address: "HOST:PORT" of the coordinator.
      ca_file: the CA that signed the coordinator's certificate (PEM); "" for a plaintext channel.
      client_cert_file, client_key_file: a client certificate and key (PEM) for mutual TLS; both or neither.
      server_name: the name to check the server's certificate for ("": the host dialled); only with TLS.
      service: the service whose health to ask ("": the server as a whole).
      timeout_seconds: the deadline of the call (connection included), seconds.

    Returns:
      The status's name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN".

    Raises:
      HealthError: no connection, a failed TLS handshake, a `service` the server does not know, no answer
        within `timeout_seconds`, or another RPC error; or credential files that are missing, unreadable or not PEM (naming the file).
      ValueError: `timeout_seconds` is not positive.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from island_jax.comm import security

    if not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds is {timeout_seconds!r}; give a positive number of seconds")
    if ca_file:
        try:
            credentials = security.channel_credentials(ca_file, client_cert_file, client_key_file)
        except security.SecurityError as e:
            raise HealthError(f"cannot use the TLS files: {e}") from None
        channel = grpc.secure_channel(address, credentials, options=security.target_name_options(server_name))
    else:
        if client_cert_file or client_key_file or server_name:
            raise HealthError("--client_cert_file, --client_key_file and --server_name need --ca_file (TLS); give "
                              "the CA that signed the coordinator's certificate")
        channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = f"no answer within {timeout_seconds:g} s"
        elif code == grpc.StatusCode.UNAVAILABLE:
            why = (f"cannot connect ({e.details()}); is the coordinator running and listening there"
                   + (", and do the CA, client certificate and server name match its certificate?" if ca_file
                      else ", and does it serve plaintext (without --ca_file)?"))
        elif code == grpc.StatusCode.NOT_FOUND:
            why = f"the health service knows no service {service!r} (NOT_FOUND); ask for '' (the whole server)"
        else:
            why = f"{code.name}: {e.details()}"
        raise HealthError(f"{address}: {why}") from None
    finally:
        channel.close()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m island_jax.health", description=(
        "Exit 0 when the coordinator's gRPC health service answers SERVING, 1 otherwise."))
    p.add_argument("--address", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--ca_file", default="", help="the run's CA (PEM): use TLS and verify the server with it")
    p.add_argument("--client_cert_file", default="", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--client_key_file", default="", help="client private key (PEM), for mutual TLS")
    p.add_argument("--server_name", default="", help="the name to check the server's certificate for")
    p.add_argument("--service", default="", help="the service to ask about ('': the whole server)")
    p.add_argument("--timeout_seconds", type=float, default=5.0, help="deadline of the check, seconds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check with command-line arguments `argv` (default: sys.argv[1:]); returns the exit status:
    0 on SERVING, 1 otherwise (the reason on stderr). Bad arguments exit 2 (SystemExit, from argparse)."""
    args = _parser().parse_args(argv)
    if not args.timeout_seconds > 0:
        _parser().error(f"--timeout_seconds is {args.timeout_seconds:g}; give a positive number of seconds")
    try:
        status = check(args.address, ca_file=args.ca_file, client_cert_file=args.client_cert_file,
                       client_key_file=args.client_key_file, server_name=args.server_name, service=args.service,
                       timeout_seconds=args.timeout_seconds)
    except HealthError as e:
        print(f"health check failed: {e}", file=sys.stderr, flush=True)
        return EXIT_NOT_SERVING
    if status != "SERVING":
        print(f"{args.address}: {status} (not serving)", file=sys.stderr, flush=True)
        return EXIT_NOT_SERVING
    print(f"{args.address}: {status}", flush=True)
    return EXIT_SERVING


if __name__ == "__main__":
    sys.exit(main())
