"""RMSNorm, computed by the model's ops (layers/ops.py: in float32 whatever the activation dtype, as
the reference models do), with the residual add folded into it."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of it."""
        return self.ops.add_rms_norm(residual, x, self.weight, self.eps)
