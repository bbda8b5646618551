"""Eight virtual CPU devices for every test, set before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"] if f
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
