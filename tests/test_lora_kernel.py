"""The C++ multi-LoRA delta (csrc/lora_delta.cpp) against the torch reference (layers/lora.py).

One call per linear adds every run's shrink-then-expand; these cases cover what its tiling must get
right: run lengths that are not multiples of its 4-row blocks, ranks not multiples of its 4-rank tiles,
widths not multiples of the vector width, fused parts that write only their own columns, slots that
leave the linear alone, base rows between adapter runs, and rows that are a view with a stride.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tritonllm.devices.cpu import kernels
from tritonllm.layers.lora import LoraBatch, LoraWeights, add_lora_delta

# Where a compiler exists the kernels must build: a broken build must not hide behind the fallback.
pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")]


@pytest.fixture(autouse=True)
def built():
    assert kernels.load(), kernels.error()


def adapter(in_features: int, widths: list[int], rank: int, seed: int) -> LoraWeights:
    """Random A and B for a linear whose output is `widths` parts side by side (one part: a plain linear)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rank * len(widths), in_features, generator=gen) / in_features ** 0.5
    b = torch.zeros(rank * len(widths), sum(widths))
    parts, column = [], 0
    for p, width in enumerate(widths):
        b[p * rank:(p + 1) * rank, column:column + width] = torch.randn(rank, width, generator=gen)
        parts.append((p * rank, (p + 1) * rank, column, column + width))
        column += width
    return LoraWeights(a, b, tuple(parts) if len(widths) > 1 else ())


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # Sums in another order (and FMA contraction): rounding differences on the scale of the values.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def kernel_delta(y: torch.Tensor, x: torch.Tensor, slots: list, batch: LoraBatch) -> torch.Tensor:
    return kernels.lora_delta_(y, x, [w.a if w else None for w in slots], [w.b if w else None for w in slots],
                               [w.parts_table if w else None for w in slots], batch.flat_segments)


CASES = {
    # in, output parts, rank, segments (slot, first, end)
    "one row": (576, [576], 16, [(0, 0, 1)]),
    "fused qkv, runs of 1 to 9 rows": (576, [576, 192, 192], 16, [(0, 0, 1), (1, 1, 3), (2, 3, 12), (0, 12, 17)]),
    "odd sizes": (70, [37, 5, 29], 7, [(1, 0, 5), (0, 5, 6), (2, 6, 13)]),
    "rank 1 and 3": (64, [33], 3, [(0, 0, 4), (1, 4, 8)]),
    "gate/up": (576, [1536, 1536], 16, [(3, 0, 64)]),
    "base rows between runs": (96, [128, 64], 8, [(0, 2, 6), (1, 9, 12)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_adds_what_the_torch_reference_adds(name):
    in_features, widths, rank, segments = CASES[name]
    slots = [adapter(in_features, widths, rank, seed) for seed in range(4)]
    slots[2] = None if name == "base rows between runs" else slots[2]  # a slot that leaves this linear alone
    rows = max(end for _, _, end in segments) + 1
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, generator=gen)
    y = torch.randn(rows, sum(widths), generator=gen)
    batch = LoraBatch(segments)
    expected = add_lora_delta(y.clone(), x, slots, batch)
    got = kernel_delta(y.clone(), x, slots, batch)
    assert_close(got, expected)
    assert not torch.equal(expected, y), "the case adds nothing: it would pass with no kernel at all"


def test_rows_of_a_strided_view_and_a_slot_with_no_adapter():
    slots = [adapter(128, [64, 64], 8, 1), None]
    x = torch.randn(10, 256)[:, :128]  # rows 256 floats apart
    y = torch.randn(10, 128)
    batch = LoraBatch([(1, 0, 3), (0, 3, 10)])
    expected = add_lora_delta(y.clone(), x, slots, batch)
    got = kernel_delta(y.clone(), x, slots, batch)
    assert_close(got, expected)
    assert torch.equal(got[:3], y[:3])  # the rows of the slot with no adapter are untouched


def test_bad_arguments_are_refused():
    slots = [adapter(64, [32], 4, 0)]
    x, y = torch.randn(4, 64), torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="segment"):
        kernel_delta(y, x, slots, LoraBatch([(0, 0, 5)]))  # past the step's rows
    with pytest.raises(RuntimeError, match="slot"):
        kernel_delta(y, x, slots, LoraBatch([(1, 0, 2)]))  # no such slot
    with pytest.raises(RuntimeError, match="x of 48 columns.*got A \\[4, 64\\]"):
        kernel_delta(y, torch.randn(4, 48), slots, LoraBatch([(0, 0, 2)]))  # x of another width
