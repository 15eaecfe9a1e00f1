"""A linear layer whose product runs through the model's ops (layers/ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.lora import LoraBatch
from tritonllm.layers.ops import LayerOps


class Linear(nn.Module):
    """y = x W^T + b, computed by `ops.linear`. The weight is [out, in] as in `nn.Linear` and loads the
    same way. A device's ops may keep it in a layout of their own (`ops.prepare_linear`, once after load):
    `packed` then holds that form and `weight` is None.

    `tied`: the module whose weight this layer shares (an LM head tied to the embedding table); the
    state dict names that weight once, under its owner, and `weight` always reads the owner's.

    `lora`: where adapters are served, one entry per adapter slot (layers/lora.py `LoraWeights`, or None
    for an adapter that does not target this layer), filled by the runner as adapters take slots; a
    step with adapter rows (`LoraBatch`) adds their deltas through `ops.lora_delta`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: LayerOps,
                 tied: nn.Module | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ops = ops
        self.tied = tied is not None
        if tied is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:  # not a submodule of ours: the owner is registered where it lives
            self.__dict__["_tied_to"] = tied
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed = None  # the weight in the device ops' own layout, where they keep one
        self.lora = None  # per adapter slot: its LoraWeights or None (None here: no adapters served)
        self.quantizable = True  # whether `quantization` may round this weight (layers/fp8.py); routers keep theirs

    def __getattr__(self, name: str):
        if name == "weight" and "_tied_to" in self.__dict__:
            return self.__dict__["_tied_to"].weight
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        y = self.ops.linear(self, x)
        if lora is not None and self.lora is not None:
            self.ops.lora_delta(self, x, y, lora)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
