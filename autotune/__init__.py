"""autotune: parallelism auto-tuner for large-model training (Python API)."""
__version__ = "0.1.0"
