"""Load a model folder: Hugging Face config + safetensors (never pickle) + tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tritonllm.layers.ops import LayerOps
from tritonllm.models.llama import LlamaForCausalLM
from tritonllm.parallel.shard import SINGLE, TPShard


class SafetensorsIndex:
    """name -> tensor across all *.safetensors files of a folder, read lazily."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder} (pickled weights are not loaded)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self.read: set[str] = set()  # names read so far, whole or in part

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        self.read.add(name)
        return self._where[name].get_tensor(name)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) only: a tensor-parallel rank reads just its shard from disk."""
        return self._slice(name)[start:end]

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._slice(name)[:, start:end]

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        self.read.add(name)
        return self._where[name].get_slice(name)


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, max_position: int,
               tp: TPShard = SINGLE, ops: LayerOps | None = None) -> LlamaForCausalLM:
    """The model of `folder` (this rank's shard of it), in `dtype` on `device`, its layers calling `ops`
    (layers/ops.py; the torch reference by default). A device backend's ops prepare their weights
    afterwards (`DeviceBackend.prepare`)."""
    cfg = load_hf_config(folder)
    model = LlamaForCausalLM(cfg, max_position, tp, ops)
    tensors = SafetensorsIndex(folder)
    model.load_hf_state_dict(tensors)
    _refuse_unused_weights(tensors, tied_head=model.tie_word_embeddings)
    # The rotary cos/sin tables stay float32 (cast per use) for accuracy in half precision.
    rotaries = [(r, r.cos, r.sin) for r in (model.rotary, model.local_rotary) if r is not None]
    model = model.to(device=device, dtype=dtype)
    for rotary, cos, sin in rotaries:
        rotary.cos, rotary.sin = cos.to(device), sin.to(device)
    return model.eval()


def _refuse_unused_weights(tensors: SafetensorsIndex, tied_head: bool) -> None:
    """A checkpoint weight the model did not read is a part it would not compute (an MLP bias, a norm of
    an architecture variant): refused by name rather than served wrong. Ignored: rotary frequency
    buffers some checkpoints save, and an LM head saved beside the embeddings it is tied to."""
    unused = sorted(name for name in tensors.names - tensors.read
                    if not name.endswith("rotary_emb.inv_freq") and not (tied_head and name == "lm_head.weight"))
    if unused:
        raise ValueError(f"{len(unused)} checkpoint weights are not used by this model's architecture, so it "
                         f"cannot be computed as trained: {unused[:5]}")


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
