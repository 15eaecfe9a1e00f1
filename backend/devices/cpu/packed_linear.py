"""Weights packed once at load for the CPU GEMMs of `Linear` layers (devices/cpu/ops.py), by our kernel or oneDNN.

`F.linear` reads the plain [out, in] weight at every step. For the decode shapes of a small model
the GEMMs are most of a step, and a weight packed once into a kernel's own layout streams straight
into its FMAs (docs/PERFORMANCE.md has what each kernel gives):
- `avx512`: our kernel (csrc/packed_gemm.cpp) on 32-column panels streamed once per call, float32,
  on the kernels' AVX-512 and AVX2 (+ FMA) builds alike (elsewhere oneDNN; the name is historical and
  kept, config.pbtxt files use it: it means "our panel kernel", whichever of the two widths this CPU's
  build has, with the same results bit for bit on both). With `exact_blocks`, a weight that is exactly quantized
  blocks (exact_blocks.py: what a GGUF Q4_1 or Q8_0 file dequantises to) or bfloat16 values also
  keeps that form, and GEMMs of up to `blocks_max_rows` rows read it instead
  (csrc/exact_block_gemm.cpp): the same float32 values decoded in registers, so the same results
  bit for bit from fewer bytes. Where the crossover lies depends on the CPU: it is timed at load
  (`tune_blocks_max_rows`).
- `avx512_bf16`: the same kernel on a bfloat16 copy of the weight, x rounded to bfloat16 per call,
  sums in float32. Lossy, hence opt-in; the rest of the model stays float32. CPUs with AVX512-BF16
  (elsewhere `avx512`).
- `onednn`: oneDNN's blocked layout, the one torch's own compiler uses when it freezes a CPU model's
  linears; float32 and bfloat16.
- `aten`: torch on the plain weight (nothing packed): `F.linear`, or torch's oneDNN linear where that
  is timed faster (CpuOps.choose_aten_library).
"""

from __future__ import annotations

import sys
import torch

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.devices.cpu.exact_blocks import find_blocks
from tritonllm.devices.cpu.load_timing import faster

BLOCKS_MAX_ROWS = 8  # the most rows a GEMM on exactly-quantized weights takes their blocks for, unless tuned


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist for float32 and bfloat16 on a CPU build with mkldnn."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_linear_supported() -> bool:
    """torch's oneDNN linear, which takes a plain [out, in] weight as it is (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN, on the plain weight or one packed by `_reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def resolve_cpu_gemm(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM kernel the linears get for `cpu_gemm=requested`: the request, or the next one down
    (avx512_bf16 -> avx512 -> onednn -> aten) where it cannot run on this device, dtype, CPU or torch build.
    `avx512` is our panel kernel on the AVX-512 or the AVX2 build of the kernels (packed_gemm_supported)."""
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

    def drop_panels(self) -> int:
        """Free the float32 panels; the blocks take every row count from then on (the same results bit for
        bit, csrc/exact_block_gemm.cpp). Returns the bytes freed."""
        if self.blocks is None or self.kernel != "avx512":
            raise ValueError("drop_panels: only a weight kept as exact blocks, with cpu_gemm=avx512")
        freed = self.data.numel() * self.data.element_size()
        self.data = None
        self.blocks_max_rows = sys.maxsize
        return freed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "avx512":
            if self.reads_blocks(x.numel() // self.in_features):
                return cpu_kernels.block_gemm(x, *self.blocks, bias, self.out_features)
            return cpu_kernels.packed_gemm(x, self.data, bias, self.out_features)
        if self.kernel == "avx512_bf16":
            return cpu_kernels.packed_gemm_bf16(x, self.data, bias, self.out_features, self.in_features)
        return onednn_linear(x, self.data, bias)


def tune_blocks_max_rows(weights: list[PackedWeight], max_rows: int, step_rows: int | None = None) -> int:
    """Up to how many rows this CPU runs a step's GEMMs faster from the exact blocks than from the float32
    panels, timed once at load on `weights` themselves; sets every weight's `blocks_max_rows` to it.

    The blocks cost decoding in registers and save memory traffic, so where the crossover lies depends
    on the CPU's FMA width against its memory bandwidth. Rows double from BLOCKS_MAX_ROWS while the
    blocks stay 3 % faster (`_pays`), up to `max_rows` (a step's decodes). Where they still pay there,
    they also take the larger steps, up to `step_rows` rows (decodes with prompt chunks), untimed: past
    a few rows both kernels run the same microkernel on the same float32 values, and what differs is
    one pass over the weight per call, decoding the blocks or streaming the panels' four bytes a value,
    which weighs less the more rows share it (docs/PERFORMANCE.md has the crossover measured).
    Results are the same bit for bit either way (csrc/exact_block_gemm.cpp): only the speed depends on it.
    """
    with_blocks = [w for w in weights if w.blocks is not None]
    best = BLOCKS_MAX_ROWS
    rows = 2 * BLOCKS_MAX_ROWS
    while with_blocks and rows <= max_rows and _pays(with_blocks, rows, _block_gemm, _panel_gemm):
        best = rows
        rows *= 2
    if step_rows is not None and best * 2 > max_rows:
        best = max(best, step_rows)
    set_blocks_max_rows(weights, best)
    return best


def set_blocks_max_rows(weights: list[PackedWeight], rows: int) -> None:
    """GEMMs of up to `rows` rows read these weights' exact blocks (tune_blocks_max_rows's result)."""
    for w in weights:
        w.blocks_max_rows = rows


def drop_unread_panels(weights: list[PackedWeight], step_rows: int) -> int:
    """Where every one of `weights` has its blocks and they take every step size (up to `step_rows` rows),
    its float32 panels are never read: they are freed (4 bytes a weight, against the blocks' 0.6 to 2).
    Returns the bytes freed."""
    if not weights or any(w.blocks is None or w.kernel != "avx512" or w.blocks_max_rows < step_rows for w in weights):
        return 0
    return sum(w.drop_panels() for w in weights)


def _panel_gemm(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.packed_gemm(x, w.data, None, w.out_features)


def _block_gemm(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.block_gemm(x, *w.blocks, None, w.out_features)


def _pays(weights: list[PackedWeight], rows: int, candidate, current) -> bool:
    """Whether `candidate(w, x)` is 3 % faster than `current(w, x)` over `rows` rows: each pass runs every
    weight once, as a step does, so they come from memory, not from the caches. Each output is dropped
    before the next GEMM, as in a step, so the allocator hands back the same memory, not fresh pages."""
    xs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}

    def each(gemm) -> None:
        for w in weights:
            gemm(w, xs[w.in_features])

    return faster(lambda: each(candidate), lambda: each(current), 0.97)
