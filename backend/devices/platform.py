"""Device selection (npu / cuda / cpu), synchronisation and memory information, in one place."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def resolve_device(name: str) -> torch.device:
    """`auto` picks npu, then cuda, then cpu. An explicitly requested device that is missing fails."""
    kind, _, index = name.partition(":")
    if kind == "auto":
        if _npu_available():
            return torch.device("npu", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} was requested but CUDA is not available")
        idx = int(index or 0)
        if idx >= torch.cuda.device_count():
            raise RuntimeError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", idx)
    if kind == "npu":
        if not _npu_available():
            raise RuntimeError(f"device {name!r} was requested but torch_npu / an Ascend NPU is not available")
        return torch.device("npu", int(index or 0))
    raise RuntimeError(f"unknown device {name!r}")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (no native bf16 on many CPUs), bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto`: the model's own dtype (K/V stored exactly as computed); `fp8`: e4m3 (layers/fp8.py)."""
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    return model_dtype if name == "auto" else resolve_dtype(name, torch.device("cpu"))


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def free_memory_bytes(device: torch.device) -> int:
    """Memory still available for the KV pool on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
