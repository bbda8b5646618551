"""Packaging for island_jax: one sparse MoE language model trained across compute islands."""

from setuptools import find_packages, setup

setup(
    name="island_jax",
    version="0.1.0",
    description=(
        "JAX/Flax framework for training one Mixture-of-Experts language model "
        "across compute islands joined by a slow WAN link (DiLoCo outer loop)."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["island_jax", "island_jax.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "einops>=0.8,<0.9",
        "ml_collections>=1.1,<2",
        "absl-py>=2.1,<3",
        "grain>=0.2.18,<0.3",
        "tensorboardX>=2.6,<3",
        "numpy>=2.0,<3",
    ],
    extras_require={
        "test": ["pytest>=8,<10"],
    },
)
