"""The Ascend backend: torch_npu paged attention (devices/npu/backend.py)."""
