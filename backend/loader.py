"""Load a model folder: Hugging Face config + safetensors (never pickle) + tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .layers.linear import onednn_packing_supported
from .models.llama import LlamaForCausalLM
from .tensor_parallel import SINGLE, TPShard

logger = logging.getLogger(__name__)


class _SafetensorsIndex:
    """name -> tensor across all *.safetensors files of a folder, read lazily."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder} (pickled weights are not loaded)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        return self._where[name].get_tensor(name)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) only: a tensor-parallel rank reads just its shard from disk."""
        return self._slice(name)[start:end]

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._slice(name)[:, start:end]

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        return self._where[name].get_slice(name)


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, max_position: int,
               tp: TPShard = SINGLE, cpu_gemm: str = "aten", batch_hint: int = 64) -> LlamaForCausalLM:
    """`cpu_gemm="onednn"` packs the GEMM weights for oneDNN on a CPU (layers/linear.py), tuned for
    `batch_hint` rows; elsewhere, or where this torch lacks it, the weights stay as they are."""
    cfg = load_hf_config(folder)
    model = LlamaForCausalLM(cfg, max_position, tp)
    model.load_hf_state_dict(_SafetensorsIndex(folder))
    # The rotary cos/sin tables stay float32 (cast per use) for accuracy in half precision.
    cos, sin = model.rotary.cos, model.rotary.sin
    model = model.to(device=device, dtype=dtype)
    model.rotary.cos, model.rotary.sin = cos.to(device), sin.to(device)
    model.eval()
    if cpu_gemm == "onednn" and onednn_packing_supported(device, dtype):
        model.pack_for_cpu(batch_hint)
    elif cpu_gemm == "onednn" and device.type == "cpu":
        logger.warning("oneDNN packed linears are not available for %s in this torch build: using aten", dtype)
    return model


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
