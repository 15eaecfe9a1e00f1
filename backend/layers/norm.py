"""RMSNorm, computed in float32 whatever the activation dtype (as the reference models do), and
the residual add folded into it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of it."""
        return self(residual.add_(x))
