"""Proto package `hybrid_jax` (the wire namespace; unrelated to the Python model package)."""
