"""A Linear layer that keeps its weight transposed ([in, out], contiguous) for the CPU GEMM.

MKL multiplies `x @ W` with W stored [in, out] markedly faster than `F.linear(x, W)` with W stored
[out, in] at the decode shapes of small models (2 threads, [16,576]x[576,960]: 210 vs 103 GFLOPS;
[64,576]x[576,960]: 258 vs 237). Weights are loaded in the usual layout, then converted once.
"""

from __future__ import annotations

import torch
from torch import nn


class PretransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in]
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def pretranspose_linears(model: nn.Module, names: tuple[str, ...]) -> None:
    """Replace every nn.Linear child called one of `names` (anywhere in `model`) in place."""
    for module in list(model.modules()):
        for name in names:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, PretransposedLinear(child))
