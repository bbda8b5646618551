"""Goodput of the island -> coordinator transfer against a plain TCP socket, and through the link emulator.

  python benchmarks/transport.py [--megabytes=256] [--repeats=5] [--tls_repeats=5] [--place] [--smoke]

`--smoke` moves 4 MiB, once per kind after the warm-up (`--megabytes=4
--repeats=1 --tls_repeats=1`), in a few seconds: the same code path and
printout, figures that are not measurements.

Part 1, loopback. A receiver process runs a plain TCP listener and the
exchange's gRPC service (grpc.aio, raw frames, CRC-32C per chunk) in front of a
sink that counts every chunk handed on and lets it go, as bare gRPC's method
below does with its messages (`--place`: it also copies each chunk into one
buffer, as the coordinator's decode into rows does at the start of its
merge); the merge itself is left out, since it is not the transport. The
sender process moves the same payload in turns: `sendall` of a memoryview
over one TCP connection, then over the same `comm.connections` channels, one
after another (an alternated turn):

- the exchange: `GrpcTransport.contribute`;
- framed gRPC: the exchange's own chunk frames (`wire.chunk_frames`: each
  chunk cut from the payload, its CRC-32C computed and its frame built as it
  is sent) into a method that parses each frame and checks its CRC, with none
  of the exchange's protocol around them: the least a transfer with a
  checked frame per chunk does;
- bare gRPC: 1 MiB messages sliced beforehand, into a method that only counts
  them (no framing, no CRC, no copy), gRPC Python's own ceiling on the
  machine.

Each is timed from the first byte to the receiver's answer. Each turn gives
the exchange's share of bare gRPC's goodput (bare seconds / exchange
seconds), and framed gRPC's; the medians over the turns are printed per
connection count, with the CPU seconds each process spent per transfer (the
sender's own, the receiver's from /proc; both share the machine's cores, so a
pass over the bytes on either side lengthens the transfer when they are
busy). Both processes set the allocator as the island and coordinator roles
do (`allocator.configure`). Last line: `overhead_vs_grpc=Q`, the lowest of the
exchange's medians (1, 4 and `comm.connections` connections); the line before
it, `transport: ratio=R` (exchange goodput / TCP goodput,
`comm.connections`).

TLS, loopback. The receiver also serves the same sink a second time, the
secure way: mutual TLS and per-island bearer tokens, with one throwaway CA,
certificates and token from `security.make_run_credentials`. The sender moves
the same payload through the exchange in the clear (no tokens) and through
TLS (with its token), taking turns, with 1 and `comm.connections` channels;
the medians are compared. Third line from the end: `transport_tls: ratio=R`
(TLS seconds / plaintext seconds, `comm.connections` channels).

If the receiver fails (a server thread that cannot start, a crash), it exits
and the sender stops with an error naming it; every wait on it has a deadline
(`WAIT_SECONDS`).

Part 2, the emulated WAN (island_jax/comm/link.py) at 1 and 5 Gbit/s, 50 ms
one way (100 ms RTT), a 4 MiB window per connection (Linux's default largest
TCP send buffer): the achieved rate of a real transfer through the emulator
over loopback, divided by the configured rate, for 1 connection and for
`comm.connections`. The achieved rate is bytes x 8 / (seconds - one-way
latency): the first byte's unavoidable latency is not a rate.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _children
import _smoke
from absl import app, flags
from absl import logging as absl_logging

_MEGABYTES = flags.DEFINE_integer("megabytes", 256, "Payload size, MiB.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed transfers of each kind (alternated turns: exchange, framed gRPC, bare gRPC).")
_TLS_REPEATS = flags.DEFINE_integer("tls_repeats", 5, "Timed transfers of each kind in the TLS comparison.")
_SECRETS = flags.DEFINE_string("secrets", "", "The run's credentials folder (passed to the receiver by the sender).")
_PLACE = flags.DEFINE_bool(
    "place", False, "The receiver's sink also copies every chunk into one buffer (the coordinator's decode does so "
    "as part of its merge); off, it only counts them.")
_ROLE = flags.DEFINE_string("role", "sender", "sender | receiver (the receiver is started by the sender).")
flags.adopt_module_key_flags(_smoke)  # --smoke, in --help

WINDOW_BYTES = 4 << 20
WAIT_SECONDS = 300.0  # the longest wait on the receiver: its start, one transfer; seconds


class Sink:
    """Duck-types a one-fragment `Coordinator` (it is its own fragment) for the calls the exchange
    makes. It counts each chunk handed on and lets it go, as bare gRPC's method does with its messages; with
    `place`, it first copies the chunk into one preallocated buffer, as the coordinator's decode into rows copies
    it as the first step of its merge (`benchmarks/merge.py`)."""

    def __init__(self, num_bytes: int, chunk_bytes: int, place: bool = False):
        import jax
        import numpy as np

        from island_jax.config import default_config, fingerprint_fields
        from island_jax.outer import codec

        self.fingerprint_fields = fingerprint_fields(default_config())
        self.codec = self.update_codec = codec.Codec("none")
        self.shapes = {"w": jax.ShapeDtypeStruct((num_bytes // 4,), np.float32)}
        self.plan = self.update_plan = codec.chunk_plan(self.shapes, self.codec, None, chunk_bytes)
        self.payload_bytes = self.update_bytes = num_bytes
        self.islands, self.round, self.checksum, self.incarnation = ["a"], 0, "-", ""
        self.fragments = [self]
        self.buffer = bytearray(num_bytes) if place else None
        self.chunks = 0

    def check_island(self, island, config_fingerprint):
        from island_jax.coordinator import handshake

        handshake.check_island(island, self.islands, self.fingerprint_fields, config_fingerprint)

    def join(self, island, fields, params_checksum, round=0):
        return dict(round=0, checksum=self.checksum, rejoin=False)

    def begin_contribution(self, header):
        return "accepted"

    def add_chunk(self, round, island, index, data):
        self.chunks += 1
        if self.buffer is not None:
            chunk = self.plan[index]
            self.buffer[chunk.offset : chunk.offset + chunk.nbytes] = data

    def end_contribution(self, round, island):
        return "accepted"

    def abandon(self, island, reason, keep_complete=False):
        pass


BARE_METHOD = "/island_jax.bench.Bare/Count"
FRAMED_METHOD = "/island_jax.bench.Bare/Framed"


def _bare_handler():
    """Two stream-unary methods that answer with the bytes they counted: `Count` takes raw messages; `Framed`
    takes the exchange's chunk frames (`wire.parse`) and checks each chunk's CRC-32C, as the exchange does."""
    import grpc

    from island_jax.comm import wire

    async def count(request_iterator, context):
        n = 0
        async for message in request_iterator:
            n += len(message)
        return n.to_bytes(8, "little")

    async def framed(request_iterator, context):
        n = 0
        async for frame in request_iterator:
            _, (_, _, crc, data) = wire.parse(frame)
            if wire.crc32(data) != crc:
                await context.abort(grpc.StatusCode.DATA_LOSS, "CRC-32C mismatch")
            n += len(data)
        return n.to_bytes(8, "little")

    methods = {name: grpc.stream_unary_rpc_method_handler(fn, request_deserializer=bytes, response_serializer=bytes)
               for name, fn in (("Count", count), ("Framed", framed))}
    return grpc.method_handlers_generic_handler("island_jax.bench.Bare", methods)


def _credentials(folder: str):
    """One run's mutual TLS settings (a whole `comm.tls`, client certificates required) and tokens file for
    island "a", made in `folder` or reused."""
    from island_jax.comm import security
    from island_jax.config import default_config

    made = security.make_run_credentials(folder, ["a"], ["127.0.0.1"])
    tls = default_config().comm.tls  # every key the service and the transport read, at its default
    tls.update({k: made[k] for k in ("cert_file", "key_file", "ca_file", "client_cert_file", "client_key_file")})
    tls.require_client_cert = True
    return tls, made


def receiver(num_bytes: int, secrets_folder: str) -> None:
    import asyncio

    from island_jax.comm.grpc_server import serve
    from island_jax.config import default_config

    _children.exit_on_thread_error()  # a server thread that fails ends this process; the sender then stops
    # Every transfer contributes round 0 again (the sink never ends a round), which the service logs as a retry.
    absl_logging.set_verbosity(absl_logging.ERROR)
    chunk_bytes = default_config().comm.chunk_bytes
    sink = Sink(num_bytes, chunk_bytes, place=_PLACE.value)
    server, _, grpc_port = serve(sink, "127.0.0.1:0", chunk_bytes)
    asyncio.run_coroutine_threadsafe(_add_bare(server), server.loop).result()
    tls, made = _credentials(secrets_folder)
    _, _, tls_port = serve(sink, "127.0.0.1:0", chunk_bytes, tls=tls, tokens_file=made["tokens_file"])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"PORTS {listener.getsockname()[1]},{grpc_port},{tls_port}", flush=True)
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    while True:
        conn, _ = listener.accept()
        with conn:
            got = 0
            while got < num_bytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    break
                got += n
            conn.sendall(b"k")


async def _add_bare(server) -> None:
    server.server.add_generic_rpc_handlers((_bare_handler(),))


def _bare_seconds(transport, messages: list[bytes]) -> float:
    """Bare gRPC over the transport's channels: message i on channel i % n, no framing or checks."""
    return _count_seconds(transport, BARE_METHOD, [iter(messages[i :: transport.connections])
                                                   for i in range(transport.connections)], sum(map(len, messages)))


def _framed_seconds(transport, payload: bytes, plan) -> float:
    """Framed gRPC over the transport's channels: the exchange's chunk frames of `payload` (`wire.chunk_frames`:
    each chunk cut from the payload, its CRC-32C computed and its frame built as it is sent), chunk k on
    channel k % n, into a method that checks every CRC; none of the exchange's protocol around them."""
    from island_jax.comm import wire

    n = transport.connections
    streams = [(frame for _, frame in wire.chunk_frames(payload, plan, i, n)) for i in range(n)]
    return _count_seconds(transport, FRAMED_METHOD, streams, len(payload))


def _count_seconds(transport, method: str, streams: list, num_bytes: int) -> float:
    calls = [ch.stream_unary(method, bytes, bytes) for ch in transport.channels]
    start = time.perf_counter()
    futures = [transport.pool.submit(call, stream, timeout=WAIT_SECONDS) for call, stream in zip(calls, streams)]
    if sum(int.from_bytes(f.result(WAIT_SECONDS), "little") for f in futures) != num_bytes:
        raise RuntimeError(f"the receiver's {method} counted other than the {num_bytes} bytes sent")
    return time.perf_counter() - start


def _with_cpu(pid: int, transfer) -> tuple[float, float, float]:
    """(wall seconds of `transfer()`, this process's CPU seconds, process `pid`'s CPU seconds) during it."""
    mine, theirs = _children.cpu_seconds(), _children.cpu_seconds(pid)
    seconds = transfer()
    return seconds, _children.cpu_seconds() - mine, _children.cpu_seconds(pid) - theirs


def _tcp_seconds(port: int, payload: bytes) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_SECONDS) as s:
        s.settimeout(None)  # a blocking sendall, as measured: a dead receiver fails it (reset, broken pipe)
        s.sendall(memoryview(payload))
        s.settimeout(WAIT_SECONDS)
        if s.recv(1) != b"k":
            raise RuntimeError("the TCP receiver did not acknowledge")
    return time.perf_counter() - start


def _transport(port: int, connections: int, link=None, tls=None, token=None):
    from island_jax.comm.grpc_client import GrpcTransport
    from island_jax.config import default_config, fingerprint_fields

    config = default_config()
    t = GrpcTransport(
        f"127.0.0.1:{port}", config.comm.chunk_bytes, 60, 600, connections, pipeline=False, link=link, tls=tls,
        token=token,
    )
    t.join("a", fingerprint_fields(config), "-")
    return t


def _grpc_seconds(transport, payload: bytes) -> float:
    from island_jax.coordinator import ContributionHeader

    start = time.perf_counter()
    transport.contribute(ContributionHeader(0, "a", 1), payload)
    return time.perf_counter() - start


def sender(num_bytes: int, repeats: int, tls_repeats: int) -> None:
    with tempfile.TemporaryDirectory(prefix="transport_bench_") as folder:
        _sender(num_bytes, repeats, tls_repeats, os.path.join(folder, "secrets"))


def _sender(num_bytes: int, repeats: int, tls_repeats: int, secrets_folder: str) -> None:
    from island_jax.comm.link import LinkEmulator
    from island_jax.config import default_config

    connections = default_config().comm.connections
    tls, made = _credentials(secrets_folder)
    from island_jax.comm import security

    token = security.read_token(made["token_files"]["a"], "")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role=receiver", f"--megabytes={num_bytes >> 20}", f"--secrets={secrets_folder}",
         f"--place={_PLACE.value}"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = _children.read_line(proc, "PORTS ", WAIT_SECONDS)
        tcp_port, grpc_port, tls_port = (int(p) for p in line.split()[1].split(","))
        payload = os.urandom(num_bytes)
        counts = sorted({1, 4, connections})
        transports = {n: _transport(grpc_port, n) for n in counts}
        messages = [payload[i : i + (1 << 20)] for i in range(0, num_bytes, 1 << 20)]
        _tcp_seconds(tcp_port, payload)  # warm up every path once
        kinds = ("exchange", "framed", "bare")
        transfers = {n: {"exchange": lambda t=t: _grpc_seconds(t, payload),
                         "framed": lambda t=t: _framed_seconds(t, payload, t.plans[0]),
                         "bare": lambda t=t: _bare_seconds(t, messages)} for n, t in transports.items()}
        for n in counts:
            for kind in kinds:
                transfers[n][kind]()
        tcp, timed = [], {(kind, n): [] for kind in kinds for n in counts}
        cpu = {(kind, n): [] for kind in kinds for n in counts}  # [sender, receiver] CPU seconds
        for _ in range(repeats):
            tcp.append(_tcp_seconds(tcp_port, payload))
            for n in counts:
                for kind in kinds:  # taken in turn: a transfer of each kind over the same connections
                    took, *spent = _with_cpu(proc.pid, transfers[n][kind])
                    timed[(kind, n)].append(took)
                    cpu[(kind, n)].append(spent)
        grpc = {n: timed[("exchange", n)] for n in counts}
        tls_counts = sorted({1, connections})
        secure = {n: _transport(tls_port, n, tls=tls, token=token) for n in tls_counts}
        for t in secure.values():  # warm up the TLS channels once
            _grpc_seconds(t, payload)
        plain_s, tls_s = {n: [] for n in tls_counts}, {n: [] for n in tls_counts}
        for _ in range(tls_repeats):  # plaintext, TLS, plaintext, TLS, ...
            for n in tls_counts:
                plain_s[n].append(_grpc_seconds(transports[n], payload))
                tls_s[n].append(_grpc_seconds(secure[n], payload))
        for t in [*transports.values(), *secure.values()]:
            t.close()
        tcp_gbps = num_bytes * 8 / statistics.median(tcp) / 1e9

        def share(kind, n, of="bare"):  # the median over the repeats of kind's share of `of`'s goodput, taken in turn
            return statistics.median(b / k for k, b in zip(timed[(kind, n)], timed[(of, n)]))

        print(f"loopback, {num_bytes >> 20} MiB, median of {repeats}:")
        print(f"  plain TCP (sendall / recv_into)       {tcp_gbps:6.2f} Gbit/s")
        for kind, label in (("exchange", "gRPC exchange"), ("framed", "framed gRPC  "), ("bare", "bare gRPC    ")):
            for n in counts:
                gbps = num_bytes * 8 / statistics.median(timed[(kind, n)]) / 1e9
                print(f"  {label}, {n:2d} connection{'s' if n > 1 else ' '}       {gbps:6.2f} Gbit/s = {gbps / tcp_gbps:.3f}")
        for n in counts:
            spent = {kind: [statistics.median(x[i] for x in cpu[(kind, n)]) for i in (0, 1)] for kind in kinds}
            print(f"  exchange / bare gRPC, {n:2d} connection{'s' if n > 1 else ' '}: {share('exchange', n):.3f} "
                  f"(median of {repeats} alternated turns); framed / bare {share('framed', n):.3f}, exchange / framed "
                  f"{share('exchange', n, 'framed'):.3f}; CPU s per transfer, sender + receiver: "
                  + ", ".join(f"{kind} {spent[kind][0]:.2f} + {spent[kind][1]:.2f}" for kind in kinds))
        print(f"TLS, loopback, {num_bytes >> 20} MiB, exchange, alternating, median of {tls_repeats}:")
        for n in tls_counts:
            p, s = statistics.median(plain_s[n]), statistics.median(tls_s[n])
            print(
                f"  {n:2d} connection{'s' if n > 1 else ' '}: plaintext, no tokens {p:6.3f} s ({num_bytes * 8 / p / 1e9:5.2f} Gbit/s)"
                f" | mutual TLS + tokens {s:6.3f} s ({num_bytes * 8 / s / 1e9:5.2f} Gbit/s) | TLS / plaintext {s / p:.3f}"
            )
        grpc_gbps = num_bytes * 8 / statistics.median(grpc[connections]) / 1e9
        print(f"emulated link, 50 ms one way, window {WINDOW_BYTES >> 20} MiB per connection (achieved / configured):")
        for gbps in (1.0, 5.0):
            size = num_bytes
            for n in (1, connections):
                link = LinkEmulator(gbps, latency_ms=50.0, window_bytes=WINDOW_BYTES)
                t = _transport(grpc_port, n, link)
                seconds = _grpc_seconds(t, payload)
                t.close()
                achieved = size * 8 / (seconds - link.latency_s) / 1e9
                print(
                    f"  {gbps:3.0f} Gbit/s, {n:2d} connection{'s' if n > 1 else ' '} ({size >> 20} MiB): "
                    f"{achieved:6.3f} Gbit/s = {achieved / gbps:5.3f} (emulator's cap {link.rate_gbps(n) / gbps:5.3f})"
                )
        tls_ratio = statistics.median(tls_s[connections]) / statistics.median(plain_s[connections])
        print(f"transport_tls: ratio={tls_ratio:.3f} (TLS / plaintext seconds, {connections} connections)")
        print(f"transport: ratio={grpc_gbps / tcp_gbps:.3f}")
        print(f"overhead_vs_grpc={min(share('exchange', n) for n in counts):.3f}")
    finally:
        proc.kill()
        proc.wait()


def main(argv):
    del argv
    from island_jax import allocator

    allocator.configure()  # both ends allocate as the island and coordinator roles do (experiments/train.py)
    _smoke.sizes(megabytes=4, repeats=1, tls_repeats=1)
    num_bytes = _MEGABYTES.value << 20
    if _ROLE.value == "receiver":
        receiver(num_bytes, _SECRETS.value)
    else:
        sender(num_bytes, _REPEATS.value, _TLS_REPEATS.value)


if __name__ == "__main__":
    app.run(main)
