"""Device backends: which implementation of each op a model runs on its device, chosen in one place.

models/ and layers/ are plain PyTorch whose layers call declared ops (layers/ops.py); that is the code
a reader reads, and it is the code that runs. A backend (devices/backend.py: the interface, which is
also the torch reference) is chosen once per engine by `select_backend`, from the device and that
device's options in config.pbtxt. It hands the model its ops when the model is built, prepares their
weights once after load, and gives the runner its greedy head; the load log names the plan.
"""

from __future__ import annotations

import torch

from tritonllm.core.config import EngineConfig
from tritonllm.devices.backend import DeviceBackend, Runtime
from tritonllm.devices.platform import resolve_kv_cache_dtype


def select_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                   rank: int = 0) -> DeviceBackend:
    """The backend for a model in `dtype` on `device` (tensor-parallel `rank`), with that device's options
    from `config`: our CPU kernels, FlashInfer and decode graphs on CUDA, torch_npu's attention on Ascend;
    the torch reference on any other device. Each imports its libraries only when chosen."""
    runtime = Runtime(device, dtype, resolve_kv_cache_dtype(config.cache.dtype, dtype), config.cache.block_size,
                      config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens, max_model_len,
                      config.parallel.tensor_parallel_size, rank, config.model.quantization)
    if device.type == "cpu":
        from tritonllm.devices.cpu.backend import CpuBackend

        return CpuBackend(config.cpu, runtime)
    if device.type == "cuda":
        from tritonllm.devices.cuda.backend import CudaBackend

        return CudaBackend(config.cuda, runtime)
    if device.type == "npu":
        from tritonllm.devices.npu.backend import NpuBackend

        return NpuBackend(config.npu, runtime)
    return DeviceBackend(None, runtime)
