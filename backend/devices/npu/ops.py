"""The Ascend implementation of the model's ops (layers/ops.py).

- `rotary_write_kv`: the rotary in torch, K and V written by torch_npu's reshape-and-cache operator
  into token-major pools; `attention`: one fused infer attention score call over the whole step
  (decodes and prompt chunks, causal within each sequence) on its lengths and block tables, in its
  packed-token layout (TND). A model with sliding-window or soft-capped attention keeps the torch
  reference for both (the fused call here is plain causal attention): `use_torch_attention`; so does
  a model whose dtypes or block size those operators do not take (`fused_attention_unsupported`).
- Mixtures of experts route without a host sync (`dense_routing`).
- Every other op is the torch reference (torch_npu's kernels for torch's ops).

What the arguments mean is torch_npu's documentation (op-plugin's
docs/context/torch_npu-npu_fused_infer_attention_score.md; CANN's ReshapeAndCacheOperation for
`_npu_reshape_and_cache`); tests/npu_reference.py is a CPU reference of exactly that, which the
contract tests run these calls through (tests/test_npu_contract.py).
"""

from __future__ import annotations

import torch

from tritonllm.layers.attention import PagedAttention
from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import HEAD_MAJOR, TOKEN_MAJOR
from tritonllm.layers.ops import LayerOps
from tritonllm.layers.rotary import apply_rotary

# The fused call takes causal attention as a fixed-size upper-triangular mask (its sparse mode 3).
CAUSAL_MASK_SIZE = 2048
# What torch_npu documents for the calls below: queries, keys and values in float16 or bfloat16, all
# four tensors of the KV write in one dtype, and with a block table and prompt rows (a query longer
# than one token) a block size of 128 to 512 in steps of 128.
FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_BLOCK_SIZES = (128, 256, 384, 512)


def fused_attention_unsupported(dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> str:
    """Why torch_npu's paged KV write and fused attention cannot take a model in `dtype` with a KV pool
    of `kv_dtype` in blocks of `block_size` ("" where they can)."""
    if dtype not in FUSED_DTYPES:
        return f"torch_npu's fused attention takes float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if kv_dtype != dtype:
        return "torch_npu's KV write takes K/V in the pool's own dtype (kv_cache_dtype differs from dtype)"
    if block_size not in FUSED_BLOCK_SIZES:
        return f"torch_npu's paged attention takes block_size 128, 256, 384 or 512, not {block_size}"
    return ""


def causal_mask(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)


class NpuOps(LayerOps):
    name = "npu"
    dense_routing = True

    def __init__(self, fused: bool, device: torch.device, why: str = "", kernels=None):
        self.fused = fused
        self.device = device
        self.why = why
        self.kv_layout = TOKEN_MAJOR if fused else HEAD_MAJOR
        self.mask: torch.Tensor | None = None  # the fixed causal mask the fused call takes (made at first use)
        self._kernels = kernels

    @property
    def kernels(self):
        """The module whose `_npu_reshape_and_cache` and `npu_fused_infer_attention_score` the fused path
        calls: torch_npu, unless another with the same documented interface was given (the contract
        tests give a CPU reference of it)."""
        if self._kernels is None:
            import torch_npu

            self._kernels = torch_npu
        return self._kernels

    def use_torch_attention(self, why: str) -> None:
        """Before the pools exist: the torch reference attention on a head-major pool, for this reason."""
        self.fused, self.why, self.kv_layout = False, why, HEAD_MAJOR

    def rotary_write_kv(self, layer: PagedAttention, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().rotary_write_kv(layer, qkv, rope, kv_cache, slot_mapping)
        q_end, k_end = layer.num_heads, layer.num_heads + layer.num_kv_heads
        qk = apply_rotary(qkv[:, :k_end], *rope)
        self.kernels._npu_reshape_and_cache(key=qk[:, q_end:].contiguous(), value=qkv[:, k_end:].contiguous(),
                                            key_cache=kv_cache[0], value_cache=kv_cache[1],
                                            slot_indices=slot_mapping.to(torch.int32))
        return qk[:, :q_end]

    def attention(self, layer: PagedAttention, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> torch.Tensor:
        if not self.fused:
            return super().attention(layer, q, kv_cache, meta)
        if self.mask is None:
            self.mask = causal_mask(self.device)
        k_cache, v_cache = kv_cache
        seqs = meta.seqs
        if "npu_block_table" not in seqs.plans:  # blocks given back (-1) lie behind the window it does not read
            seqs.plans["npu_block_table"] = seqs.block_table.clamp(min=0)
        num_blocks, block_size = k_cache.shape[:2]
        out, _ = self.kernels.npu_fused_infer_attention_score(
            q.contiguous(), k_cache.view(num_blocks, block_size, -1),
            v_cache.view(num_blocks, block_size, -1), atten_mask=self.mask, block_table=seqs.plans["npu_block_table"],
            input_layout="TND", block_size=block_size, actual_seq_lengths=seqs.query_start_loc_host[1:],
            actual_seq_lengths_kv=seqs.seq_lens_host, num_key_value_heads=layer.num_kv_heads,
            num_heads=layer.num_heads, scale=layer.scale, sparse_mode=3)
        return out

    def plan(self) -> dict[str, str]:
        plan = super().plan()
        if self.fused:
            plan["rotary_write_kv"] = "torch rotary + torch_npu reshape_and_cache"
            plan["attention"] = "torch_npu fused infer attention score (TND)"
        elif self.why:
            plan["rotary_write_kv"] = plan["attention"] = f"torch ({self.why})"
        return plan
