"""Linear layers whose CPU GEMMs run on a weight packed once at load, by our kernel or oneDNN.

On x86 CPUs `F.linear` calls MKL on the plain [out, in] weight at every step. For the decode shapes
of a small model the GEMMs are most of a step, and a weight packed once into a kernel's own layout
streams straight into its FMAs:
- `avx512`: our kernel (csrc/packed_gemm.cpp), 32-column panels streamed once per call. At the
  1-64 rows a decode step runs it overlaps that stream with the arithmetic: 1.6x oneDNN at 1-8 rows,
  1.2x at 32, equal from 128 on (AMD EPYC, 2 threads, fp32, cold weights; docs/PERFORMANCE.md).
  float32 on CPUs with AVX-512; elsewhere it falls back to oneDNN.
- `avx512_bf16`: the same kernel on a bfloat16 copy of the weight, x rounded to bfloat16 per call,
  sums in float32 (`vdpbf16ps`): 1.7-2.1x `avx512` at 1-64 rows, half the weight memory. Lossy
  (relative error ~2.5e-3 per GEMM, so greedy outputs drift from float32 ones), hence opt-in; the
  rest of the model stays float32. CPUs with AVX512-BF16; elsewhere it falls back to `avx512`.
  With `exact_blocks`, a weight that is exactly quantized blocks (layers/exact_blocks.py: what a GGUF
  Q4_1 or Q8_0 file dequantises to, as the default model's linears and LM head are) or bfloat16 values
  also keeps that form, and GEMMs of up to `BLOCKS_MAX_ROWS` rows read it instead
  (csrc/exact_block_gemm.cpp): the same float32 values, decoded in registers, so the same results bit
  for bit, from 2-5.3x fewer bytes (a step's layer GEMMs at 1 / 4 / 8 rows: Q4_1 2.1-2.8x / 1.5-1.8x /
  1.1-1.3x faster, bfloat16 1.65x / 1.18x / 0.99x on an AMD EPYC VM, where from ~10 rows the
  arithmetic, not the stream, sets the pace; where that crossover lies is timed at load:
  `tune_blocks_max_rows`). On CPUs with AMX-BF16, GEMMs of at least `amx_min_rows` rows (a constant:
  `choose_amx_min_rows`) run those blocks on AMX tiles instead (csrc/amx_block_gemm.cpp): x split
  exactly into three bfloat16 parts, the codes exact in bfloat16, sums and scales in float32, so a
  float32 GEMM's accuracy (not its bits); a step's layer GEMMs at 64 rows 52 -> 35 ms on an Intel
  Xeon VM.
- `onednn`: oneDNN's blocked layout, the primitive torch's own compiler uses when it freezes a CPU
  model's linears; 1.2-2x `F.linear` ([64,576]x[576,960] 157 -> 203 GFLOPS, the LM head
  [64,576]x[576,49152] 96 -> 201). float32 and bfloat16.
- `aten`: torch's `F.linear` on the plain weight. Accelerators always use it.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.exact_blocks import find_blocks

logger = logging.getLogger(__name__)

BLOCKS_MAX_ROWS = 8  # the most rows a GEMM on exactly-quantized weights takes their blocks for, unless tuned
# From how many rows a GEMM on exact blocks runs on AMX tiles (`choose_amx_min_rows`). A constant, not
# timed: the tiles' sums are not the FMA kernels' bit for bit, so a timed threshold would let a
# request's numbers change from one server start to the next.
AMX_MIN_ROWS = 8


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist for float32 and bfloat16 on a CPU build with mkldnn."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def resolve_cpu_gemm(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM kernel the linears get for `cpu_gemm=requested`: the request, or the next one down
    (avx512_bf16 -> avx512 -> onednn -> aten) where it cannot run on this device, dtype, CPU or torch build."""
    if device.type != "cpu":
        return "aten"
    if requested == "avx512_bf16" and dtype == torch.float32 and cpu_kernels.packed_gemm_bf16_supported():
        return "avx512_bf16"
    if requested in ("avx512_bf16", "avx512") and dtype == torch.float32 and cpu_kernels.packed_gemm_supported():
        return "avx512"
    if requested in ("avx512_bf16", "avx512", "onednn") and onednn_packing_supported(device, dtype):
        return "onednn"
    return "aten"


class PackedWeight:
    """An [out, in] weight packed once for a CPU GEMM kernel; `self(x, bias)` is `F.linear(x, W, bias)`.

    `batch_hint` is the row count oneDNN tunes its layout for (any row count works with it).
    `packed`: this weight already packed for `kernel` elsewhere, to share instead of packing again.
    `exact_blocks` (with `avx512`): also keep the weight's quantized blocks if it is exactly such
    blocks, for GEMMs of up to BLOCKS_MAX_ROWS rows.
    """

    def __init__(self, weight: torch.Tensor, kernel: str, batch_hint: int, packed: torch.Tensor | None = None,
                 exact_blocks: bool = False):
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().contiguous()
        self.blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes, scales) for block_gemm
        self.blocks_max_rows = BLOCKS_MAX_ROWS  # GEMMs of up to this many rows read the blocks (tune_blocks_max_rows)
        self.amx_min_rows: int | None = None  # GEMMs of at least this many rows run the blocks on AMX (choose_amx_min_rows)
        if exact_blocks and kernel == "avx512":
            found = find_blocks(weight)
            if found is not None:
                self.blocks = cpu_kernels.pack_block_weight(*found)
        if packed is not None:
            self.data = packed
        elif kernel == "avx512":
            self.data = cpu_kernels.pack_gemm_weight(weight)
        elif kernel == "avx512_bf16":
            self.data = cpu_kernels.pack_gemm_weight_bf16(weight)
        elif kernel == "onednn":
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        else:
            raise ValueError(f"no packed layout for cpu_gemm={kernel!r}")

    def reads_blocks(self, rows: int) -> bool:
        """Whether a GEMM of `rows` rows reads the exact quantized blocks rather than the float32 panels."""
        return self.blocks is not None and rows <= self.blocks_max_rows

    def runs_amx(self, rows: int) -> bool:
        """Whether a GEMM of `rows` rows runs the exact blocks on AMX tiles (float32 accuracy, other bits)."""
        return self.blocks is not None and self.amx_min_rows is not None and rows >= self.amx_min_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "avx512":
            rows = x.numel() // self.in_features
            if self.runs_amx(rows):
                return cpu_kernels.amx_block_gemm(x, *self.blocks, bias, self.out_features)
            if self.reads_blocks(rows):
                return cpu_kernels.block_gemm(x, *self.blocks, bias, self.out_features)
            return cpu_kernels.packed_gemm(x, self.data, bias, self.out_features)
        if self.kernel == "avx512_bf16":
            return cpu_kernels.packed_gemm_bf16(x, self.data, bias, self.out_features, self.in_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.data, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that can hand its weight to a packed CPU kernel (`pack`) and then frees the plain copy."""

    packed: PackedWeight | None = None

    def pack(self, kernel: str, batch_hint: int, exact_blocks: bool = False) -> None:
        self.packed = PackedWeight(self.weight, kernel, batch_hint, exact_blocks=exact_blocks)
        # Rebind rather than resize: the plain weight may be shared (tied embeddings).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        return F.linear(x, self.weight, self.bias)


def tune_blocks_max_rows(weights: list[PackedWeight], max_rows: int) -> int:
    """Up to how many rows this CPU runs a step's GEMMs faster from the exact blocks than from the float32
    panels, timed once at load on `weights` themselves; sets every weight's `blocks_max_rows` to it.

    The blocks cost decoding in registers and save memory traffic, so where the crossover lies is the
    machine's: 8 rows on an AMD EPYC VM (2 cores, AVX-512 at half width per cycle), while on an Intel
    Xeon VM with AMX (full-width FMAs) the blocks still won at 64 rows (a batch-64 decode step of the
    default model 106 -> 92 ms, batch 32 62 -> 48 ms). Rows double from BLOCKS_MAX_ROWS while the
    blocks stay 3 % faster (`_pays`). Results are the same bit for
    bit either way (csrc/exact_block_gemm.cpp): only the speed depends on it.
    """
    with_blocks = [w for w in weights if w.blocks is not None]
    best = BLOCKS_MAX_ROWS
    rows = 2 * BLOCKS_MAX_ROWS
    while with_blocks and rows <= max_rows and _pays(with_blocks, rows, _block_gemm, _panel_gemm):
        best = rows
        rows *= 2
    for w in weights:
        w.blocks_max_rows = best
    return best


def choose_amx_min_rows(weights: list[PackedWeight]) -> int | None:
    """AMX_MIN_ROWS where this CPU has AMX tiles and `weights` have exact blocks, else None; sets every
    weight's `amx_min_rows` to it.

    Each call widens the 4-bit or 8-bit codes to bfloat16 tiles once per 32 columns, which one row does
    not repay: on an Intel Xeon VM (2 cores) a step's layer GEMMs at 1 / 4 / 16 / 64 rows took 8.7 /
    9.5 / 12.9 / 34.7 ms on AMX against 7.0 / 11.0 / 16.0 / 52.8 from the blocks. Neither the row count
    nor the choice is timed (timing picked 4, 16 and 32 rows in three starts there), so that the
    same batch gives the same numbers at every start and in every process.
    """
    found = AMX_MIN_ROWS if any(w.blocks is not None for w in weights) and cpu_kernels.amx_block_gemm_supported() else None
    for w in weights:
        w.amx_min_rows = found
    return found


def _panel_gemm(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.packed_gemm(x, w.data, None, w.out_features)


def _block_gemm(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.block_gemm(x, *w.blocks, None, w.out_features)


def _pays(weights: list[PackedWeight], rows: int, candidate, current) -> bool:
    """Whether `candidate(w, x)` is 3 % faster than `current(w, x)` over `rows` rows: each pass runs every
    weight once, as a step does, so they come from memory, not from the caches; the better of two
    alternated passes each, after one pass that first touches this row count's buffers."""
    xs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}

    def one_pass(gemm) -> float:
        started = time.perf_counter()
        for w in weights:
            gemm(w, xs[w.in_features])
        return time.perf_counter() - started

    one_pass(candidate)
    times = ([], [])
    for i in (0, 1, 1, 0):
        times[i].append(one_pass((candidate, current)[i]))
    return min(times[0]) <= 0.97 * min(times[1])


def pack_linears(model: nn.Module, kernel: str, batch_hint: int, exact_blocks: bool = False) -> int:
    """Pack every `Linear` of `model` for `kernel` ("avx512", "avx512_bf16" or "onednn"); returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            module.pack(kernel, batch_hint, exact_blocks)
            count += 1
    return count
