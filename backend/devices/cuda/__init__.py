"""The CUDA backend: FlashInfer paged attention and decode graphs (devices/cuda/backend.py)."""
