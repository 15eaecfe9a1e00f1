"""LoRA deltas for a step whose rows use different adapters (multi-LoRA, the punica / S-LoRA idea).

An adapter adds `B A x` (scaled) to a linear's output. A step's rows may each name a different adapter,
or none (the base model). The runner orders the rows so that each adapter's rows are contiguous runs
(`LoraBatch.segments`), and every linear that an adapter targets adds, for each run, `(x A^T) B^T`:
first the shrink to the adapter's rank, then the expand back to the output width. That costs
rank x (in + out) multiply-adds per row, a few percent of the linear's own in x out for small ranks,
and reads only the adapter's weights: never a second pass over the base weight.

A fused linear (Q, K and V in one GEMM, gate and up in another) fuses its adapters too: the A matrices
of its parts stacked (one shrink), and a B whose rows for a part write only that part's output columns.
The runner puts an adapter's weights for a linear into one of its `slots` (`Linear.lora`), by which the
segments name it; a slot of None is an adapter that leaves this linear alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatch:
    """Which rows of a step use which adapter slot: (slot, first row, end row) runs, base rows in none."""

    segments: list[tuple[int, int, int]]
    flat_segments: list[int] = field(init=False, repr=False)  # the same, flat: what device kernels take

    def __post_init__(self) -> None:
        self.flat_segments = [n for segment in self.segments for n in segment]


# From this many rows of one adapter, each fused part's expand runs on its own columns: fewer multiply-adds
# (B's zeros outside the part skipped) for one call more per part, which pays once the rows are many.
PER_PART_ROWS = 16


@dataclass
class LoraWeights:
    """One adapter's weights for one linear: `a` [parts x rank, in] (the parts' A matrices stacked), `b`
    [parts x rank, out] (each part's B transposed, scaling folded in, zero outside its columns); `parts`:
    (first, end) row of `a` and (first, end) column of the output, per part (none: one part, all of them).
    `parts_table`: the same as an int64 [parts, 4] tensor, for device kernels that take the parts."""

    a: torch.Tensor
    b: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...] = ()
    b_parts: list[torch.Tensor] = field(init=False, repr=False)
    parts_table: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.b_parts = [self.b[r0:r1, c0:c1] for r0, r1, c0, c1 in self.parts]  # views: no second copy
        self.parts_table = torch.tensor(self.parts, dtype=torch.int64).reshape(-1, 4)


def add_lora_delta(y: torch.Tensor, x: torch.Tensor, slots: list[LoraWeights | None], batch: LoraBatch) -> torch.Tensor:
    """y[rows] += (x[rows] A^T) B^T for each run of rows with an adapter (in place); returns y."""
    for slot, start, end in batch.segments:
        weights = slots[slot]
        if weights is None:
            continue
        rows = y[start:end]
        shrunk = torch.mm(x[start:end], weights.a.t())
        if end - start < PER_PART_ROWS or len(weights.parts) < 2:
            rows.addmm_(shrunk, weights.b)
        else:
            for (r0, r1, c0, c1), b in zip(weights.parts, weights.b_parts):
                rows[:, c0:c1].addmm_(shrunk[:, r0:r1], b)
    return y
