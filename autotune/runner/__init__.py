"""Runner `jax`: a real transformer sharded by a plan, run for a few steps (issue 14)."""
