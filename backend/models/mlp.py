"""The gated MLP of Llama-family layers: act(gate) * up, then down, with gate and up in one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.parallel.shard import TPShard
from tritonllm.models.families import ACTIVATIONS, activation_name


class GatedMLP(nn.Module):
    """This rank's columns of gate/up (one fused GEMM) and rows of down, then one all-reduce.

    `intermediate_size`: the width before the split across ranks (default: the config's; a mixture of
    experts gives its experts' own). `reduce=False` leaves the all-reduce to the caller (models/moe.py
    adds every expert's part on this rank first, then reduces once).
    """

    def __init__(self, cfg, tp: TPShard, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        start, end = tp.split(intermediate_size or cfg.intermediate_size)
        self.intermediate_size = end - start
        self.tp = tp
        self.reduce = reduce
        self.activation = activation_name(cfg)
        self.act = ACTIVATIONS[self.activation]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return self.tp.all_reduce(out) if self.reduce else out

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * intermediate] -> act(gate) * up, [tokens, intermediate]."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.act(gate) * up
