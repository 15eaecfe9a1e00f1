"""How the step's decodes are cut into attention groups by context length."""

from __future__ import annotations

import itertools
import random

from tritonllm.sampling_params import SamplingParams
from tritonllm.scheduler import ScheduledSeq
from tritonllm.sequence import Sequence
from tritonllm.step_inputs import GROUP_COST_BLOCKS, split_by_length


def _decodes(lengths: list[int]) -> list[ScheduledSeq]:
    items = []
    for i, n in enumerate(sorted(lengths)):
        seq = Sequence(f"r{i}", list(range(n + 1)), SamplingParams())
        seq.num_computed_tokens = n
        items.append(ScheduledSeq(seq, 1))
    return items


def _cost(groups, block_size):
    return sum(len(g) * -(-(g[-1].seq.num_computed_tokens + 1) // block_size) + GROUP_COST_BLOCKS for g, _ in groups)


def test_groups_cover_every_decode_in_order_with_offsets():
    decodes = _decodes([5, 40, 41, 300, 310, 900, 901, 902, 17, 18])
    groups = split_by_length(decodes, 16, 4)
    assert [d for g, _ in groups for d in g] == decodes
    assert [offset for _, offset in groups] == list(itertools.accumulate([0] + [len(g) for g, _ in groups[:-1]]))


def test_groups_are_the_cheapest_cuts():
    rng = random.Random(0)
    for _ in range(20):
        decodes = _decodes([rng.randint(1, 2000) for _ in range(rng.randint(1, 9))])
        n = len(decodes)
        best = min(_cost([(decodes[i:j], i) for i, j in zip((0,) + cuts, cuts + (n,))], 16)
                   for k in range(0, min(3, n - 1) + 1) for cuts in itertools.combinations(range(1, n), k))
        assert _cost(split_by_length(decodes, 16, 4), 16) == best


def test_one_group_when_asked_or_when_lengths_are_alike():
    decodes = _decodes([10, 500, 1000, 1500] * 4)
    assert len(split_by_length(decodes, 16, 1)) == 1
    assert len(split_by_length(_decodes([100] * 64), 16, 4)) == 1
    assert split_by_length([], 16, 4) == []
