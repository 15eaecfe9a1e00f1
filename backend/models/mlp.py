"""The gated MLP of Llama-family layers: act(gate) * up, then down, with gate and up in one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.linear import Linear
from tritonllm.layers.lora import LoraBatch
from tritonllm.layers.ops import LayerOps
from tritonllm.models.families import activation_name
from tritonllm.parallel.shard import TPShard


class GatedMLP(nn.Module):
    """This rank's columns of gate/up (one fused GEMM) and rows of down, then one all-reduce.

    `intermediate_size`: the width before the split across ranks (default: the config's; a mixture of
    experts gives its experts' own). `reduce=False` leaves the all-reduce to the caller (models/moe.py
    adds every expert's part on this rank first, then reduces once).
    """

    def __init__(self, cfg, tp: TPShard, ops: LayerOps, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        start, end = tp.split(intermediate_size or cfg.intermediate_size)
        self.intermediate_size = end - start
        self.tp = tp
        self.reduce = reduce
        self.activation = activation_name(cfg)
        self.ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, False, ops)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, False, ops)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: the step's adapter rows (layers/lora.py), added to gate/up and down; None: base only."""
        out = self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x, lora), self.activation), lora)
        return self.tp.all_reduce(out) if self.reduce else out
