"""What each query row of a step sees, in the form our attention kernel reads (csrc/paged_decode_attention.cpp).

The kernel takes the step's block table as it is (`SequenceBatch.block_table`, -1 for blocks given
back, which it skips) and, per query row of the step's flat token axis: `row_seq`, the sequence whose
table the row reads; `row_end`, the row's position + 1 (it sees keys at positions < row_end); and
`row_start`, 0, or for a sliding layer its position + 1 - window clamped at 0 (it sees keys at
positions >= row_start). They come from the sequences' lengths with a few torch ops on the device,
once per step and window for every layer (`seqs.plans`), so nothing the size of a context is built
on the host.
"""

from __future__ import annotations

import torch

from tritonllm.layers.attention_metadata import SequenceBatch

_PLAN = "cpu_attention_rows"  # key of seqs.plans, apart from the torch reference's (its windows)


def attention_rows(seqs: SequenceBatch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_seq, row_end, row_start), each [rows] int32, for layers of this `window` (None: the whole
    context); made by the first such layer of the step, kept for the rest."""
    key = (_PLAN, window)
    rows = seqs.plans.get(key)
    if rows is None:
        if window is None:
            rows = _rows(seqs)
        else:
            row_seq, row_end, _ = attention_rows(seqs, None)
            rows = (row_seq, row_end, (row_end - window).clamp_(min=0))
        seqs.plans[key] = rows
    return rows


def _rows(seqs: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = seqs.query_start_loc
    num_seqs, num_rows = len(seqs.seq_lens_host), seqs.query_start_loc_host[-1]
    device = starts.device
    if num_rows == num_seqs:  # decodes only: one row per sequence, at its last position
        row_seq = torch.arange(num_seqs, dtype=torch.int32, device=device)
        return row_seq, seqs.seq_lens.to(torch.int32), torch.zeros_like(row_seq)
    row_seq = torch.repeat_interleave(torch.arange(num_seqs, dtype=torch.int32, device=device),
                                      starts[1:] - starts[:-1], output_size=num_rows)
    # A sequence's rows hold its last q_len positions: row r of rows [starts[i], starts[i + 1]) is at
    # position seq_lens[i] - (starts[i + 1] - r), and sees keys up to it.
    row_end = (torch.arange(1, num_rows + 1, dtype=torch.int32, device=device)
               + (seqs.seq_lens - starts[1:])[row_seq.long()]).to(torch.int32)
    return row_seq, row_end, torch.zeros_like(row_seq)
