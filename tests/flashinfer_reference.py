"""A reference of FlashInfer's documented semantics, for contract tests: not FlashInfer, and not fast.

Our CUDA backend plans FlashInfer's paged-attention wrappers on the host from each step's lengths and
block tables (backend/devices/cuda/flashinfer_attention.py, graphs.py). This module is a stand-in for
the `flashinfer` module with the two wrappers we use, `BatchPrefillWithPagedKVCacheWrapper` and
`BatchDecodeWithPagedKVCacheWrapper`: `plan` checks the planning arrays against what FlashInfer
documents and refuses what it forbids or what our code must never pass (`ContractError`), and `run`
computes exactly the attention those arrays describe, in plain torch on the CPU. The contract tests
(tests/test_flashinfer_contract.py) give it to our real `FlashInferPlans` and decode buckets and
compare with the torch reference attention.

What each check and each line of semantics rests on (flashinfer-ai/flashinfer):
- [KV] docs/tutorials/kv_layout.rst, "Page Table Layout": request i's pages are
  `kv_page_indices[kv_indptr[i]:kv_indptr[i+1]]`, its KV length is
  `page_size * (num_pages - 1) + last_page_len[i]`, "last_page_len must be greater than zero, and less
  than or equal to page_size"; indptr, page indices and last-page lengths "should be of type int32";
  the ragged query's rows of request i are `qo_indptr[i]:qo_indptr[i+1]`, qo_indptr[0] = 0; the NHD
  pool as a (k, v) tuple, each [max_num_pages, page_size, num_kv_heads, head_dim].
- [PLAN] flashinfer/prefill.py and decode.py, the wrappers' `plan` docstrings: qo_indptr and
  paged_kv_indptr [batch_size + 1], paged_kv_indices [paged_kv_indptr[-1]], last_page_len
  [batch_size]; num_qo_heads a multiple of num_kv_heads (grouped-query attention); `window_left` "the
  left (inclusive) window size ... -1: the full length"; `logits_soft_cap` "cap * tanh(x / cap)";
  `sm_scale` default 1 / sqrt(head_dim); `kv_data_type` defaults to `q_data_type`; the decode
  wrapper's `__init__`: with `use_cuda_graph` the indptr buffer is [batch_size + 1], the last-page
  buffer [batch_size], the indices buffer "large enough to store the maximum number of page indices",
  and "the batch_size cannot change during the lifecycle of this wrapper"; arguments after `page_size`
  by keyword (positional use is deprecated in decode's `plan`).
- [CUDA] what the docstrings leave to the kernels (include/flashinfer/attention/prefill.cuh and
  variants.cuh): with `causal`, query row q_idx of a request sits at kv_len - qo_len + q_idx (the
  causal mask aligned to the bottom right); the window keeps kv_idx + qo_len + window_left >=
  kv_len + q_idx; the soft cap is applied as cap * tanh(sm_scale * q.k / cap).
- The kernels take half-precision queries (the reason our backend runs float32 on the torch
  reference): float16 and bfloat16 only, unless a test widens `dtypes` to compare at float32 tolerance.

Beyond the documentation, and marked so where checked: a request with no query rows or more query
rows than context (rows that would see nothing), a page index outside the pool, an indptr array
that is not a 1-D CPU int32 tensor starting at 0 and non-decreasing, a query whose rows are not
contiguous in the last dimension.
"""

from __future__ import annotations

import torch

DOCUMENTED_DTYPES = (torch.float16, torch.bfloat16)


class ContractError(ValueError):
    """An argument the documentation forbids, or one our code must never pass."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractError(message)


def _dtype(value) -> torch.dtype:
    return getattr(torch, value) if isinstance(value, str) else value


def _int32_vector(t, name: str, length: int | None = None) -> list[int]:
    _require(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
             f"{name} must be a 1-D int32 tensor")  # [KV]: int64 "can cause indexing errors"
    _require(length is None or t.numel() == length, f"{name} has {t.numel()} entries, {length} expected")
    return t.tolist()


def _indptr(t, name: str) -> list[int]:
    _require(isinstance(t, torch.Tensor) and t.device.type == "cpu", f"{name} is planned from the host")
    values = _int32_vector(t, name)
    _require(len(values) >= 2 and values[0] == 0, f"{name} must start at 0 and hold batch_size + 1 entries")
    _require(all(b >= a for a, b in zip(values, values[1:])), f"{name} must be non-decreasing, got {values}")
    return values


class _Plan:
    """What `plan` fixed: per request its query rows, pages and KV length; and the scalars."""

    def __init__(self, qo_indptr: list[int], kv_indptr: list[int], indices: list[int], last_page_len: list[int],
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool,
                 window_left: int, logits_soft_cap: float | None, sm_scale: float | None, q_data_type,
                 kv_data_type, dtypes: tuple[torch.dtype, ...]):
        batch = len(kv_indptr) - 1
        _require(len(qo_indptr) - 1 == batch, "qo_indptr and paged_kv_indptr disagree on the batch size")
        _require(len(indices) == kv_indptr[-1], f"paged_kv_indices has {len(indices)} pages, indptr says "
                                                f"{kv_indptr[-1]}")
        _require(len(last_page_len) == batch, "paged_kv_last_page_len needs one entry per request")
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("page_size", page_size)):
            _require(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive int")
        _require(num_qo_heads % num_kv_heads == 0, f"num_qo_heads={num_qo_heads} is not a multiple of "
                                                   f"num_kv_heads={num_kv_heads}")
        _require(all(0 < n <= page_size for n in last_page_len),
                 f"last_page_len must be in 1..page_size ({page_size}), got {last_page_len}")
        pages = [indices[a:b] for a, b in zip(kv_indptr, kv_indptr[1:])]
        _require(all(pages), "a request with no pages (its last page would be empty)")
        self.kv_lens = [page_size * (len(p) - 1) + n for p, n in zip(pages, last_page_len)]
        self.qo_indptr, self.pages = qo_indptr, pages
        q_lens = [b - a for a, b in zip(qo_indptr, qo_indptr[1:])]
        # Beyond the documentation: every request has query rows, none more than its context.
        _require(all(q > 0 for q in q_lens), f"a request with no query rows: {q_lens}")
        _require(all(q <= kv for q, kv in zip(q_lens, self.kv_lens)),
                 f"a request with more query rows than KV: {q_lens} vs {self.kv_lens}")
        _require(isinstance(window_left, int) and window_left >= -1, f"window_left={window_left!r}")
        _require(logits_soft_cap is None or logits_soft_cap >= 0, f"logits_soft_cap={logits_soft_cap!r}")
        self.q_dtype = _dtype(q_data_type)
        self.kv_dtype = self.q_dtype if kv_data_type is None else _dtype(kv_data_type)
        _require(self.q_dtype in dtypes, f"q_data_type {self.q_dtype}: the kernels take float16 or bfloat16")
        _require(self.kv_dtype in dtypes, f"kv_data_type {self.kv_dtype}: float16 or bfloat16")
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = (
            num_qo_heads, num_kv_heads, head_dim, page_size)
        self.causal, self.window_left, self.soft_cap = causal, window_left, logits_soft_cap or None
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)

    def attend(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        _require(isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2,
                 "the NHD pool as a (k, v) tuple")  # our pools are separate K and V tensors
        k_cache, v_cache = paged_kv_cache
        num_pages = k_cache.shape[0]
        shape = (num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k_cache), ("v", v_cache)):
            _require(tuple(t.shape) == shape, f"{name} cache {tuple(t.shape)} is not NHD {shape}")
            _require(t.dtype == self.kv_dtype, f"{name} cache dtype {t.dtype}, planned {self.kv_dtype}")
        _require(q.dim() == 3 and tuple(q.shape) == (self.qo_indptr[-1], self.num_qo_heads, self.head_dim),
                 f"q {tuple(q.shape)} is not [qo_indptr[-1], num_qo_heads, head_dim]")
        _require(q.dtype == self.q_dtype, f"q dtype {q.dtype}, planned {self.q_dtype}")
        _require(q.stride(-1) == 1, "q's last dimension must be contiguous")
        # Beyond the documentation: every page a request reads lies in the pool.
        _require(all(0 <= p < num_pages for pages in self.pages for p in pages), "a page index outside the pool")
        group = self.num_qo_heads // self.num_kv_heads
        out = torch.empty_like(q)
        for i, pages in enumerate(self.pages):
            start, end, kv_len = self.qo_indptr[i], self.qo_indptr[i + 1], self.kv_lens[i]
            table = torch.tensor(pages, dtype=torch.long)
            k = k_cache[table].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            v = v_cache[table].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            logits = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * self.sm_scale
            if self.soft_cap is not None:
                logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
            rows = torch.arange(end - start) + (kv_len - (end - start))  # [CUDA]: bottom-right aligned
            keys = torch.arange(kv_len)
            visible = torch.ones(end - start, kv_len, dtype=torch.bool)
            if self.causal:
                visible &= keys[None, :] <= rows[:, None]
            if self.window_left >= 0:
                visible &= keys[None, :] >= rows[:, None] - self.window_left
            logits.masked_fill_(~visible[None], float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v).to(q.dtype)
        return out


class _Wrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", dtypes=DOCUMENTED_DTYPES):
        _require(isinstance(float_workspace_buffer, torch.Tensor) and float_workspace_buffer.dtype == torch.uint8,
                 "the float workspace is a uint8 tensor")
        _require(kv_layout == "NHD", f"kv_layout {kv_layout!r}: our pools are token-major (NHD)")
        self.dtypes = dtypes
        self.planned: _Plan | None = None
        self.plans = 0  # how many times `plan` ran, for the tests

    def run(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs) -> torch.Tensor:
        _require(not args and not kwargs, "our runs pass only q and the pool")
        _require(self.planned is not None, "run before plan")
        return self.planned.attend(q, paged_kv_cache)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """Prefill/append attention over a paged KV cache: ragged queries, causal within each request."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal: bool = False, window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None, q_data_type="float16",
             kv_data_type=None, **others) -> None:
        _require(not others, f"keywords this reference does not cover: {sorted(others)}")
        qo = _indptr(qo_indptr, "qo_indptr")
        kv = _indptr(paged_kv_indptr, "paged_kv_indptr")
        self.planned = _Plan(qo, kv, _int32_vector(paged_kv_indices, "paged_kv_indices"),
                             _int32_vector(paged_kv_last_page_len, "paged_kv_last_page_len"),
                             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal,
                             window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             q_data_type=q_data_type, kv_data_type=kv_data_type, dtypes=self.dtypes)
        self.plans += 1


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """One query per request, the last of its context; with `use_cuda_graph` the plan lives in the
    caller's buffers (what a captured graph reads), so a batch the buffers cannot hold is refused."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, dtypes=DOCUMENTED_DTYPES):
        super().__init__(float_workspace_buffer, kv_layout, dtypes)
        self.buffers = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            _require(all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 and b.dim() == 1 for b in buffers),
                     "use_cuda_graph needs the indptr, indices and last-page-length buffers (int32)")
            _require(paged_kv_indptr_buffer.numel() == paged_kv_last_page_len_buffer.numel() + 1,
                     "the indptr buffer is [batch_size + 1], the last-page buffer [batch_size]")
            self.buffers = buffers

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *args,
             window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
             q_data_type="float16", kv_data_type=None, **others) -> None:
        _require(not args, "arguments after page_size by keyword (positional use is deprecated)")
        _require(not others, f"keywords this reference does not cover: {sorted(others)}")
        kv = _indptr(indptr, "indptr")
        pages = _int32_vector(indices, "indices")
        lasts = _int32_vector(last_page_len, "last_page_len")
        if self.buffers is not None:
            indptr_buf, indices_buf, last_buf = self.buffers
            _require(len(kv) == indptr_buf.numel(), f"a batch of {len(kv) - 1} in a wrapper captured for "
                                                    f"{indptr_buf.numel() - 1}")
            _require(len(pages) <= indices_buf.numel(), f"{len(pages)} pages beyond the indices buffer's "
                                                        f"{indices_buf.numel()}")
            indptr_buf.copy_(torch.tensor(kv, dtype=torch.int32))
            indices_buf[:len(pages)].copy_(torch.tensor(pages, dtype=torch.int32))
            last_buf.copy_(torch.tensor(lasts, dtype=torch.int32))
            # What a replayed graph reads: the buffers, not the arguments.
            kv, pages = indptr_buf.tolist(), indices_buf[:indptr_buf[-1]].tolist()
            lasts = last_buf.tolist()
        batch = len(kv) - 1
        self.planned = _Plan(list(range(batch + 1)), kv, pages, lasts, num_qo_heads, num_kv_heads, head_dim,
                             page_size, causal=False, window_left=window_left, logits_soft_cap=logits_soft_cap,
                             sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                             dtypes=self.dtypes)
        self.plans += 1


class FlashInferReference:
    """The `flashinfer` module as our backend uses it: pass it as `FlashInferPlans(..., flashinfer=...)`.
    `extra_dtypes`: accepted beyond float16 and bfloat16 (float32, only to compare at its tolerance)."""

    def __init__(self, extra_dtypes: tuple[torch.dtype, ...] = ()):
        dtypes = DOCUMENTED_DTYPES + tuple(extra_dtypes)
        self.BatchPrefillWithPagedKVCacheWrapper = (
            lambda *a, **k: BatchPrefillWithPagedKVCacheWrapper(*a, **k, dtypes=dtypes))
        self.BatchDecodeWithPagedKVCacheWrapper = (
            lambda *a, **k: BatchDecodeWithPagedKVCacheWrapper(*a, **k, dtypes=dtypes))
