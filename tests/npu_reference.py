"""A reference of torch_npu's documented semantics, for contract tests: not torch_npu, and not fast.

Our Ascend backend (backend/devices/npu/ops.py) calls two torch_npu operators. This module implements
exactly what their documentation says they compute, in plain torch on the CPU, and refuses every
argument the documentation forbids or our code must never pass (`ContractError`), so that
tests/test_npu_contract.py can run the backend's real calls through it and compare the outcome with
the torch reference attention. It proves our side of the contract (what we pass, and that it means
what we intend); it says nothing of the real kernels' numerics or speed.

What each check and each line of semantics rests on:
- [FIA] torch_npu's API reference for `torch_npu.npu_fused_infer_attention_score`, as published in
  Ascend/op-plugin, docs/context/torch_npu-npu_fused_infer_attention_score.md (the same text as
  hiascend.com's "torch_npu.npu_fused_infer_attention_score" page): the formula
  softmax(scale * Q K^T + atten_mask) V; input_layout TND; `actual_seq_lengths` in TND "each element is
  the sum of the sequence lengths of this batch and all before it, so each must be >= the one before";
  TND takes "sparse_mode 0 without a mask, or sparse_mode 3 with one"; sparse_mode 3 is
  "rightDownCausal" (causal with the diagonal through the bottom-right corner) and takes the optimised
  2048 x 2048 mask, shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), bool/int8/uint8, where 1
  means "not computed"; page attention: `block_table` int32, two-dimensional, its first dimension B,
  its second at least the blocks of the longest `actual_seq_lengths_kv`; key/value (blocknum,
  blocksize, H) or (blocknum, KV_N, blocksize, D), float16/bfloat16, KV_N * D at most 65535 in the
  first form, each tensor's elements countable in int32; `actual_seq_lengths_kv` required, one length per batch (the d = 512 TND paragraph: "the
  actual length of each batch"); with a query longer than one token, block_size 128 to 512 in steps
  of 128 (one token: a multiple of 16); query float16/bfloat16, contiguous, N <= 256, D <= 512 and a
  multiple of 16; num_heads divisible by num_key_value_heads, ratio at most 64; output shaped like the
  query, and `softmax_lse` a zero tensor of shape [1] unless `softmax_lse_flag`. The keyword is `scale`
  in that reference (older releases, e.g. 6.0.RC3, named it `scale_value`).
- [VA] vllm-ascend's use of the same call for the same job (vllm_ascend/attention/attention_v1.py,
  chunked prefill): input_layout "TND", `block_table`, `actual_seq_lengths` the cumulative query ends,
  `actual_seq_lengths_kv` the per-sequence context lengths (`seq_lens_list`), sparse_mode 3 with the
  2048 x 2048 compressed mask `triu(ones, diagonal=1)`, and only at block_size 128 (other block sizes
  take another operator there). sglang's Ascend backend builds the same mask (`~tril`).
- [RAC] CANN ATB's ReshapeAndCacheOperation (hiascend.com, ascendtb "ReshapeAndCacheOperation"), which
  `torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)` runs (op-plugin,
  op_plugin/ops/atb/ReshapeAndCachAtb.cpp): key/value [num_tokens, num_head, head_size]; key_cache /
  value_cache [num_blocks, block_size, num_head, head_size], written in place; slot_indices
  [num_tokens] int32, each block_id * block_size + offset_in_block; the four tensors "must have exactly
  the same data type": float16, bfloat16 or int8.

Beyond the documentation, and marked so where checked, the reference refuses what our code must not
pass although the operators may accept it: a last `actual_seq_lengths` short of the query's rows (rows
left undefined), a sequence with no query rows or with more query rows than context, duplicate or
out-of-range slots (a write whose order the kernel does not define), block-table entries outside the
pool, and an `atten_mask` other than the upper-triangular one [VA] builds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

COMPRESSED_MASK_SIZE = 2048  # [FIA] sparse_mode 2, 3, 4: the optimised mask is 2048 x 2048
DOCUMENTED_DTYPES = (torch.float16, torch.bfloat16)  # [FIA] query, paged key/value; [RAC] with int8
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
MAX_TOKENS = 1 << 20  # [FIA] TND: T at most 1M
MAX_BATCH = 65536
MAX_HEADS = 256
MAX_HEAD_DIM = 512
MAX_GQA_RATIO = 64
MAX_KV_HIDDEN = 65535  # [FIA] page attention, (blocknum, blocksize, H): KV_N * D beyond this is refused
PROMPT_BLOCK_SIZES = (128, 256, 384, 512)  # [FIA] page attention with Q_S > 1

# Every keyword of npu_fused_infer_attention_score that our calls leave at its documented default [FIA].
FIA_DEFAULTS = {
    "pse_shift": None, "dequant_scale1": None, "quant_scale1": None, "dequant_scale2": None, "quant_scale2": None,
    "quant_offset2": None, "antiquant_scale": None, "antiquant_offset": None, "query_padding_size": None,
    "kv_padding_size": None, "key_antiquant_scale": None, "key_antiquant_offset": None,
    "value_antiquant_scale": None, "value_antiquant_offset": None, "key_shared_prefix": None,
    "value_shared_prefix": None, "actual_shared_prefix_len": None, "query_rope": None, "key_rope": None,
    "key_rope_antiquant_scale": None, "pre_tokens": 2147483647, "next_tokens": 2147483647, "inner_precise": 0,
    "antiquant_mode": 0, "softmax_lse_flag": False, "key_antiquant_mode": 0, "value_antiquant_mode": 0,
}


class ContractError(ValueError):
    """An argument the documentation forbids, or one our code must never pass."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractError(message)


@functools.cache
def compressed_causal_mask() -> torch.Tensor:
    """The mask sparse_mode 3 takes: 1 (True) above the diagonal, "not computed" [FIA] [VA]. One shared
    tensor: callers must not change it."""
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(diagonal=1)


def _int_list(values, name: str) -> list[int]:
    # [FIA]: SymInt[], host integers; our code passes Python lists. A device tensor here would be a host sync.
    _require(isinstance(values, Sequence) and not isinstance(values, (str, bytes)),
             f"{name} must be a list of host integers, got {type(values).__name__}")
    _require(all(isinstance(v, int) and not isinstance(v, bool) for v in values), f"{name} must hold ints")
    return list(values)


class NpuReference:
    """The two torch_npu operators our backend calls, as documented; an `NpuOps(kernels=...)` module.

    `extra_dtypes`: dtypes accepted beyond the documented ones. The contract tests widen to float32 only
    to compare with the torch reference at float32 tolerance; every other check stays. `calls` records
    each call's name and keywords, so a test can see that the fused path ran and replay its arguments.
    """

    def __init__(self, extra_dtypes: tuple[torch.dtype, ...] = ()):
        self.dtypes = DOCUMENTED_DTYPES + tuple(extra_dtypes)
        self.calls: list[tuple[str, dict]] = []

    # ---- torch_npu._npu_reshape_and_cache [RAC] ---------------------------------------------------------

    def _npu_reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
        self.calls.append(("_npu_reshape_and_cache", dict(key=key, value=value, key_cache=key_cache,
                                                          value_cache=value_cache, slot_indices=slot_indices)))
        tensors = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache}
        for name, t in tensors.items():
            _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
            _require(t.is_contiguous(), f"{name} must be contiguous (ND format)")
        _require(key.dim() == 3 and value.dim() == 3, "key and value must be [num_tokens, num_head, head_size]")
        _require(key_cache.dim() == 4 and value_cache.dim() == 4,
                 "key_cache and value_cache must be [num_blocks, block_size, num_head, head_size] (ND)")
        dtypes = {t.dtype for t in tensors.values()}
        _require(len(dtypes) == 1, f"key, value, key_cache and value_cache must share one dtype, got {dtypes}")
        _require(key.dtype in self.dtypes + (torch.int8,), f"dtype {key.dtype} is not float16, bfloat16 or int8")
        _require(isinstance(slot_indices, torch.Tensor) and slot_indices.dtype == torch.int32
                 and slot_indices.dim() == 1, "slot_indices must be a 1-D int32 tensor")
        num_tokens = key.shape[0]
        _require(value.shape[0] == num_tokens and slot_indices.shape[0] == num_tokens,
                 "key, value and slot_indices must have one row per token")
        _require(key_cache.shape[:2] == value_cache.shape[:2], "key_cache and value_cache differ in blocks")
        _require(key.shape[1:] == key_cache.shape[2:], f"key {tuple(key.shape)} does not fit key_cache "
                 f"{tuple(key_cache.shape)}")
        _require(value.shape[1:] == value_cache.shape[2:], f"value {tuple(value.shape)} does not fit value_cache "
                 f"{tuple(value_cache.shape)}")
        _require(len({t.device for t in (*tensors.values(), slot_indices)}) == 1, "tensors on different devices")
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        slots = slot_indices.long()
        # Beyond the documentation: our code must write each token to a real slot, once.
        _require(bool((slots >= 0).all()) and bool((slots < num_slots).all()),
                 f"slot_indices outside the pool's {num_slots} slots")
        _require(slots.unique().numel() == num_tokens, "slot_indices holds a slot twice")
        # slot = block_id * block_size + offset_in_block [RAC]: a row of the [blocks * block_size] view.
        key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key
        value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value

    # ---- torch_npu.npu_fused_infer_attention_score [FIA] -------------------------------------------------

    def npu_fused_infer_attention_score(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                        atten_mask: torch.Tensor | None = None, actual_seq_lengths=None,
                                        actual_seq_lengths_kv=None, block_table: torch.Tensor | None = None,
                                        num_heads: int = 1, scale: float = 1.0, input_layout: str = "BSH",
                                        num_key_value_heads: int = 0, sparse_mode: int = 0, block_size: int = 0,
                                        **others) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(("npu_fused_infer_attention_score", dict(
            query=query, key=key, value=value, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
            actual_seq_lengths_kv=actual_seq_lengths_kv, block_table=block_table, num_heads=num_heads, scale=scale,
            input_layout=input_layout, num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
            block_size=block_size, **others)))
        for name, given in others.items():
            if name not in FIA_DEFAULTS:
                raise TypeError(f"npu_fused_infer_attention_score() got an unexpected keyword argument {name!r}")
            default = FIA_DEFAULTS[name]
            at_default = given is None if default is None else (type(given) is type(default) and given == default)
            _require(at_default, f"{name}={given!r}: this reference covers only its default, {default!r}")
        _require(input_layout == "TND", f"input_layout {input_layout!r}: our calls pass TND, the only layout "
                                        "this reference implements")
        return self._tnd_paged(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                               block_table, num_heads, scale, num_key_value_heads, sparse_mode, block_size)

    def _tnd_paged(self, query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv, block_table,
                   num_heads, scale, num_key_value_heads, sparse_mode, block_size):
        # -- query: [T, N, D] --
        _require(isinstance(query, torch.Tensor) and query.dim() == 3, "TND: query must be [T, N, D]")
        _require(query.is_contiguous(), "query must be contiguous")
        _require(query.dtype in self.dtypes, f"query dtype {query.dtype}: float16 or bfloat16")
        num_tokens, n, head_dim = query.shape
        _require(0 < num_tokens <= MAX_TOKENS, f"T={num_tokens} outside 1..{MAX_TOKENS}")
        _require(isinstance(num_heads, int) and num_heads == n, f"num_heads={num_heads} but query has {n} heads")
        _require(n <= MAX_HEADS and head_dim <= MAX_HEAD_DIM, f"N={n} or D={head_dim} too large")
        _require(head_dim % 16 == 0, f"D={head_dim}: float16/bfloat16 inputs need D aligned to 16")
        kv_heads = num_key_value_heads or num_heads
        _require(isinstance(kv_heads, int) and kv_heads > 0 and num_heads % kv_heads == 0,
                 f"num_heads={num_heads} is not a multiple of num_key_value_heads={num_key_value_heads}")
        _require(num_heads // kv_heads <= MAX_GQA_RATIO, "num_heads / num_key_value_heads above 64")
        _require(isinstance(scale, (float, int)) and not isinstance(scale, bool), "scale must be a float")

        # -- lengths: cumulative query ends, per-batch context lengths --
        _require(actual_seq_lengths is not None, "TND needs actual_seq_lengths")
        ends = _int_list(actual_seq_lengths, "actual_seq_lengths")
        batch = len(ends)
        _require(0 < batch <= MAX_BATCH, f"batch {batch} outside 1..{MAX_BATCH}")
        _require(all(e >= 0 for e in ends), "actual_seq_lengths must not be negative")
        _require(all(b >= a for a, b in zip(ends, ends[1:])),
                 f"actual_seq_lengths must be cumulative (non-decreasing) in TND, got {ends}")
        # Beyond the documentation: every query row must belong to a sequence, and each sequence has rows.
        _require(ends[-1] == num_tokens, f"actual_seq_lengths ends at {ends[-1]}, the query has {num_tokens} rows")
        q_lens = [b - a for a, b in zip([0] + ends, ends)]
        _require(all(q > 0 for q in q_lens), f"a sequence with no query rows: {q_lens}")
        _require(block_table is not None, "this reference implements TND with page attention (block_table) only")
        _require(actual_seq_lengths_kv is not None, "page attention needs actual_seq_lengths_kv")
        kv_lens = _int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv")
        _require(len(kv_lens) == batch, f"actual_seq_lengths_kv has {len(kv_lens)} entries for a batch of {batch}")
        # rightDownCausal: query row i of q_len sees keys up to kv_len - q_len + i; with more rows than
        # context, rows would see nothing (our code never has such a sequence).
        _require(all(kv >= q for q, kv in zip(q_lens, kv_lens)),
                 f"a sequence with more query rows than context: {q_lens} vs {kv_lens}")

        # -- paged key/value --
        for name, t in (("key", key), ("value", value)):
            _require(isinstance(t, torch.Tensor) and t.is_contiguous(), f"{name} must be a contiguous tensor")
            _require(t.dtype == query.dtype, f"{name} dtype {t.dtype} differs from the query's {query.dtype}")
        _require(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        if key.dim() == 3:  # (blocknum, blocksize, H)
            num_blocks, pool_block, hidden = key.shape
            _require(hidden == kv_heads * head_dim, f"key's H={hidden} is not num_key_value_heads * D "
                                                    f"({kv_heads} * {head_dim})")
            _require(hidden <= MAX_KV_HIDDEN, f"KV_N * D = {hidden} above {MAX_KV_HIDDEN} in (blocknum, blocksize, H)")
            k_pool = key.view(num_blocks, pool_block, kv_heads, head_dim)
            v_pool = value.view(num_blocks, pool_block, kv_heads, head_dim)
        elif key.dim() == 4:  # (blocknum, KV_N, blocksize, D)
            num_blocks, pool_heads, pool_block, pool_dim = key.shape
            _require(pool_heads == kv_heads and pool_dim == head_dim, "key is not (blocknum, KV_N, blocksize, D)")
            k_pool, v_pool = key.transpose(1, 2), value.transpose(1, 2)
        else:
            raise ContractError("paged key/value must be (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)")
        _require(block_size == pool_block, f"block_size={block_size} but the pool's blocks hold {pool_block}")
        _require(key.numel() < 2 ** 31, "the product of key's dimensions must fit in int32")
        if max(q_lens) > 1:
            _require(block_size in PROMPT_BLOCK_SIZES,
                     f"block_size={block_size}: with query rows > 1, page attention takes 128 to 512 in steps of 128")
        else:
            _require(block_size > 0 and block_size % 16 == 0, f"block_size={block_size}: a multiple of 16")

        # -- block table --
        _require(isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32
                 and block_table.dim() == 2, "block_table must be a 2-D int32 tensor")
        blocks_needed = [-(-kv // block_size) for kv in kv_lens]
        _require(block_table.shape[0] == batch, f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
        _require(block_table.shape[1] >= max(blocks_needed),
                 f"block_table is {block_table.shape[1]} wide, the longest context needs {max(blocks_needed)} blocks")
        _require(num_blocks >= sum(blocks_needed), "the pool has fewer blocks than the batch's contexts need")
        table = block_table.long()
        for b, need in enumerate(blocks_needed):
            used = table[b, :need]
            # Beyond the documentation ("block ids are not validated"): our tables point into the pool.
            _require(bool((used >= 0).all()) and bool((used < num_blocks).all()),
                     f"block_table row {b} points outside the pool: {used.tolist()}")

        tensors = (query, key, value, block_table) + ((atten_mask,) if atten_mask is not None else ())
        _require(len({t.device for t in tensors}) == 1, "query, key, value, block_table and atten_mask on "
                                                         "different devices")

        # -- the mask and sparse mode --
        if sparse_mode == 3:
            _require(atten_mask is not None, "sparse_mode=3 needs the compressed atten_mask")
            _require(isinstance(atten_mask, torch.Tensor) and atten_mask.dtype in MASK_DTYPES,
                     "atten_mask must be bool, int8 or uint8")
            _require(atten_mask.shape in ((COMPRESSED_MASK_SIZE,) * 2, (1,) + (COMPRESSED_MASK_SIZE,) * 2,
                                          (1, 1) + (COMPRESSED_MASK_SIZE,) * 2),
                     f"sparse_mode=3 takes the 2048 x 2048 mask, got {tuple(atten_mask.shape)}")
            _require(atten_mask.is_contiguous(), "atten_mask must be contiguous")
            _require(torch.equal(atten_mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE).cpu().bool(),
                                 compressed_causal_mask()),
                     "sparse_mode=3's mask must be 1 above the diagonal (1 = not computed), 0 elsewhere")
            causal = True
        elif sparse_mode == 0:
            _require(atten_mask is None, "TND takes sparse_mode 0 only without a mask")
            causal = False
        else:
            raise ContractError(f"TND takes sparse_mode 0 (no mask) or 3 (causal, compressed mask), not {sparse_mode}")

        # -- softmax(scale * Q K^T + mask) V, per sequence, in float32 --
        group = num_heads // kv_heads
        out = torch.empty_like(query)
        for b in range(batch):
            start, q_len, kv_len = ends[b] - q_lens[b], q_lens[b], kv_lens[b]
            positions = torch.arange(kv_len, device=query.device)
            blocks, offsets = table[b, positions // block_size], positions % block_size
            k = k_pool[blocks, offsets].float().repeat_interleave(group, dim=1)  # [kv_len, N, D]
            v = v_pool[blocks, offsets].float().repeat_interleave(group, dim=1)
            q = query[start:start + q_len].float()
            scores = torch.einsum("qnd,knd->nqk", q, k) * float(scale)
            if causal:  # rightDownCausal: row i is position kv_len - q_len + i
                rows = torch.arange(q_len, device=query.device) + (kv_len - q_len)
                scores.masked_fill_(positions[None, None, :] > rows[None, :, None], float("-inf"))
            out[start:start + q_len] = torch.einsum("nqk,knd->qnd", torch.softmax(scores, dim=-1), v).to(query.dtype)
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)
