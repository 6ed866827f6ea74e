"""Flax NNX layers of hybrid-jax models; each documents its shapes (docs/shapes.md)."""
