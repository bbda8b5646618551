"""Regenerates `exchange_pb2.py` and `exchange_pb2_grpc.py` from `exchange.proto`.

  python island_jax/comm/generate_stubs.py

Run from anywhere after editing the .proto; needs grpcio-tools (`pip install
-e '.[dev]'`). The generated modules are committed, so installing island_jax
needs no code generation. The versions of grpcio-tools and of the protobuf it
bundles set the lower bounds of grpcio and protobuf in setup.py: the generated
code refuses older runtimes.
"""

import os
import sys

from grpc_tools import protoc


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proto = os.path.join("island_jax", "comm", "exchange.proto")
    # The include path is the repository root, so the generated gRPC module
    # imports `island_jax.comm.exchange_pb2` as a package module.
    os.chdir(root)
    return protoc.main(["grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", proto])


if __name__ == "__main__":
    sys.exit(main())
