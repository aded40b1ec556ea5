"""dpmm_jax."""
