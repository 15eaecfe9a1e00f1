"""A sparse mixture of experts in place of the dense MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

The router scores every expert for each token; the token goes to its `top_k` most probable experts
(softmax over all of them, renormalized over those k where the family does: `MoeSpec`), and its
output is their outputs weighted by those probabilities. Each expert is a gated MLP (models/mlp.py).
The step's tokens are sorted by expert, so each expert that any token chose runs one GEMM over its
own rows, and every token's experts add into it in ascending expert order, as transformers adds them.
Counting the rows per expert costs one device-to-host copy per layer (of `num_experts` integers).

Tensor parallelism splits every expert's intermediate columns across the ranks, as the dense MLP
does: each rank routes alike (the router is replicated), adds its slices' outputs over the experts,
and one all-reduce per layer adds the ranks' parts.
"""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.linear import Linear
from tritonllm.layers.ops import LayerOps
from tritonllm.models.families import MoeSpec
from tritonllm.models.mlp import GatedMLP
from tritonllm.parallel.shard import TPShard


class SparseMoeMLP(nn.Module):
    """`dense_routing`: every expert over every token, weighted by its routing weight (zero where the token
    did not choose it): more arithmetic, but no count of rows per expert has to reach the host, so an
    accelerator's step runs without waiting on it (and can be captured in a graph). The model is built
    with it where its ops ask for it (`LayerOps.dense_routing`)."""

    def __init__(self, cfg, tp: TPShard, spec: MoeSpec, ops: LayerOps):
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.dense_routing = ops.dense_routing
        self.gate = Linear(cfg.hidden_size, spec.num_experts, False, ops)  # the router, on every rank
        self.experts = nn.ModuleList(GatedMLP(cfg, tp, ops, spec.expert_size, reduce=False)
                                     for _ in range(spec.num_experts))
        shared = spec.shared_expert_size
        self.shared_expert = GatedMLP(cfg, tp, ops, shared, reduce=False) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, ops) if shared else None
        # Routing picks among near-equal scores: FP8 weights would move tokens between experts.
        for router in (self.gate, self.shared_expert_gate):
            if router is not None:
                router.quantizable = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top_k experts ([tokens, top_k]) and their weights, from float32 probabilities."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_routing:
            return self._forward_dense(x)
        weights, experts = self.route(x)
        k = self.spec.top_k
        order = torch.argsort(experts.flatten(), stable=True)  # the (token, choice) pairs by expert
        counts = torch.bincount(experts.flatten(), minlength=self.spec.num_experts).tolist()
        rows, pair_weights = order // k, weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                chosen = rows[start:start + count]
                out.index_add_(0, chosen, expert(x[chosen]) * pair_weights[start:start + count])
                start += count
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def _forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # [tokens, num_experts]: each expert's weight for each token, in the order transformers adds them.
        per_expert = torch.zeros(x.shape[0], self.spec.num_experts, dtype=weights.dtype, device=x.device)
        per_expert.scatter_add_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += expert(x) * per_expert[:, e:e + 1]
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
