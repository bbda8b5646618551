"""A coordinator whose payloads are 5,000,000 bytes, serving gRPC in its own process.

  python tests/exchange_server.py   -> prints "PORT <n>", serves until both
                                       islands have fetched round 0's update.

`config()` and `params()` give what the islands in the test process need.
"""

import sys

import numpy as np

from island_jax.config import default_config, island

NUM_ELEMENTS = 1_250_000  # float32, codec "none": 5,000,000 bytes per payload


def config():
    c = default_config()
    c.islands.a = island(1, 1, 1, 1, 1)
    c.islands.b = island(1, 1, 1, 1, 1)
    c.codec.kind = "none"
    c.outer.update(learning_rate=1.0, momentum=0.0, nesterov=False)
    return c


def params():
    return {"w": np.zeros(NUM_ELEMENTS, np.float32)}


def main():
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    from island_jax.comm.grpc_server import serve
    from island_jax.coordinator import Coordinator

    c = config()
    server, service, port = serve(Coordinator(c, params(), ["a", "b"]), "localhost:0", c.comm.chunk_bytes)
    print(f"PORT {port}", flush=True)
    ok = service.session.wait_until_fetched(0, timeout=120)
    server.stop(grace=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
