"""The exchange between islands and the coordinator: the one session both transports call (session), the
in-process and gRPC transports, frames (wire), the link emulator, auth and TLS (security)."""
