"""island_jax: train one sparse Mixture-of-Experts language model across compute islands.

Each island is a JAX mesh running expert-parallel MoE training; an outer loop of
the DiLoCo family (arXiv 2311.08105) merges int8-quantized pseudo-gradients in a
coordinator that holds the master parameters and the outer optimizer.
"""

__version__ = "0.1.0"
