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


def generate(out_dir: str) -> int:
    """Writes the generated modules under `out_dir/island_jax/comm/`; returns protoc's exit status."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proto = os.path.join("island_jax", "comm", "exchange.proto")
    # The include path is the repository root, so the generated gRPC module
    # imports `island_jax.comm.exchange_pb2` as a package module.
    cwd = os.getcwd()
    os.chdir(root)
    try:
        args = ["grpc_tools.protoc", "-I.", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
        return protoc.main([*args, proto])
    finally:
        os.chdir(cwd)


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return generate(root)


if __name__ == "__main__":
    sys.exit(main())
