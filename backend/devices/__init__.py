"""Device backends: what a device adds to the plain PyTorch model, chosen and applied in one place.

models/ and layers/ are plain PyTorch that runs on any device; that is the code a reader reads. A
backend (devices/backend.py: the interface, which is also the torch reference) is chosen once per
engine by `select_backend` from the device and that device's options, and applied once to each
loaded model by `backend.optimize(model)` (on every tensor-parallel rank). The runner then asks it
only for the step-level choices it makes: how decodes are grouped, and the greedy head's fast paths.
"""

from __future__ import annotations

import torch

from tritonllm.devices.backend import DeviceBackend
from tritonllm.engine.config import EngineConfig


def select_backend(device: torch.device, dtype: torch.dtype, config: EngineConfig) -> DeviceBackend:
    """The backend for a model in `dtype` on `device`, with that device's options from `config`: our CPU
    kernels, FlashInfer and decode graphs on CUDA, torch_npu's attention on Ascend; the torch reference
    on any other device. Each imports its libraries only when chosen."""
    if device.type == "cpu":
        from tritonllm.devices.cpu.backend import CpuBackend

        return CpuBackend(config.cpu, dtype, batch_hint=config.scheduler.max_num_seqs,
                          step_rows=config.scheduler.max_num_batched_tokens)
    if device.type == "cuda":
        from tritonllm.devices.cuda.backend import CudaBackend

        return CudaBackend(config, device, dtype)
    if device.type == "npu":
        from tritonllm.devices.npu.backend import NpuBackend

        return NpuBackend(config, device, dtype)
    return DeviceBackend()
