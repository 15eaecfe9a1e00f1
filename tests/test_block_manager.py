"""Block manager invariants and the prefix cache (pure Python, no model)."""

from __future__ import annotations

import pytest

from tritonllm.scheduling.block_manager import BlockManager, KVCopy, PrefixMatch, chain_hash
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import Sequence

pytestmark = pytest.mark.unit

BS = 4


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit a whole prompt as the scheduler would; returns the number of cached tokens."""
    match = bm.match_prefix(s)
    assert bm.can_allocate(match, s.num_tokens)
    bm.allocate(s, match, s.num_tokens)
    cached = s.num_computed_tokens
    s.num_computed_tokens = s.num_tokens  # as if the step ran
    bm.commit_full_blocks(s)
    bm.check_invariants()
    return cached


def test_free_plus_used_is_total_and_nothing_leaks():
    bm = BlockManager(16, BS)
    seqs = [seq(range(i, i + 9), f"s{i}") for i in range(3)]
    for s in seqs:
        admit(bm, s)
        assert bm.num_free_blocks + bm.num_used_blocks == 16
    assert bm.num_used_blocks == 9  # 3 blocks each
    for s in seqs:
        bm.free(s)
        bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_hash_is_chained_over_parent_and_tokens():
    a = chain_hash(None, (1, 2, 3, 4))
    assert chain_hash(a, (5, 6, 7, 8)) != chain_hash(None, (5, 6, 7, 8))
    assert chain_hash(a, (5, 6, 7, 8)) == chain_hash(chain_hash(None, (1, 2, 3, 4)), (5, 6, 7, 8))


def test_prefix_hit_reuses_full_blocks_but_never_the_last_prompt_token():
    bm = BlockManager(16, BS)
    first = seq(range(12), "a")  # 3 full blocks
    assert admit(bm, first) == 0
    bm.free(first)
    same = seq(range(12), "b")
    # 12 tokens: 2 whole blocks, then 3 of the third block's 4 tokens; the last one is computed.
    assert admit(bm, same) == 11
    longer = seq(list(range(12)) + [99, 98], "c")
    assert admit(bm, longer) == 12
    assert bm.prefix_hit_tokens == 23


def test_miss_on_different_tokens_and_on_hash_collision():
    bm = BlockManager(16, BS)
    admit(bm, seq(range(9), "a"))
    assert admit(bm, seq([7] + list(range(1, 9)), "b")) == 0
    # Force a hash collision: a block registered under the right hash with other tokens is refused.
    s = seq(range(9), "c")
    h = chain_hash(None, (0, 1, 2, 3))
    bid = bm._hash_to_block[h]
    bm.blocks[bid].token_ids = (9, 9, 9, 9)
    assert bm.match_prefix(s).num_tokens == 0


def test_two_running_requests_share_a_prefix_with_reference_counts():
    bm = BlockManager(16, BS)
    a, b = seq(list(range(8)) + [50], "a"), seq(list(range(8)) + [60], "b")
    admit(bm, a)
    assert admit(bm, b) == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert all(bm.blocks[x].ref_count == 2 for x in shared)
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in shared)  # still in use by b: never evicted
    bm.check_invariants()
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks >= 2


def test_lru_eviction_order_and_no_eviction_of_blocks_in_use():
    bm = BlockManager(6, BS, watermark=0.0)
    old, new = seq(range(100, 109), "old"), seq(range(200, 209), "new")
    admit(bm, old)
    bm.free(old)
    admit(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4  # two full blocks each
    # Needs 3 blocks: 2 plain free blocks go first, then the least recently freed cached block.
    user = seq(range(300, 309), "user")
    admit(bm, user)
    assert len(bm.match_prefix(seq(range(200, 209))).blocks) == 2  # the newer prefix survives
    older = bm.match_prefix(seq(range(100, 109)))  # the older one lost its tail block first
    assert len(older.blocks) == 1 and older.num_tokens == 4
    held = seq(range(400, 405), "held")
    assert bm.num_free_blocks == 3 and not bm.can_allocate(PrefixMatch(), 16)  # blocks in use are never taken
    bm.free(user)
    bm.check_invariants()


def test_kv_window_release_frees_blocks_and_marks_them():
    bm = BlockManager(8, BS)
    s = seq(range(16), "w")
    admit(bm, s)
    bm.release_block(s, 1)
    assert s.block_table[1] == -1 and bm.num_used_blocks == 3
    bm.free(s)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_exact_release_keeps_the_prefix_cached_and_last_in_line():
    # Behind the model's own sliding window a block's K/V are still the prefix's: a later request
    # with the same prompt reuses it, and fresh blocks are handed out before it.
    bm = BlockManager(8, BS)
    s = seq(range(16), "w")
    admit(bm, s)
    released = s.block_table[0]
    bm.release_block(s, 0, exact=True)
    assert s.block_table[0] == -1 and bm.num_used_blocks == 3 and bm.num_cached_blocks == 1
    bm.check_invariants()
    other = seq(range(100, 104), "o")
    admit(bm, other)
    assert bm.num_cached_blocks == 1  # the fresh free block went first
    assert bm.match_prefix(seq(range(9), "again")).blocks == [released, s.block_table[1]]
    bm.free(s)
    bm.free(other)
    bm.check_invariants()


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    assert admit(bm, seq(range(9), "b")) == 0 and bm.num_cached_blocks == 0


def test_zero_blocks_is_refused():
    with pytest.raises(ValueError):
        BlockManager(0, BS)


def test_a_prefix_ending_inside_a_block_reuses_its_leading_tokens_through_a_copy():
    bm = BlockManager(16, BS)
    a = seq(range(10), "a")  # blocks (0-3) (4-7) committed; (8, 9) not full
    admit(bm, a)
    b = seq([0, 1, 2, 3, 4, 5, 99, 98, 97], "b")
    match = bm.match_prefix(b)
    assert match.blocks == a.block_table[:1] and match.partial_block == a.block_table[1]
    assert match.partial_tokens == 2 and match.num_tokens == 6
    kv_copies = bm.allocate(b, match, b.num_tokens)
    # b's second block is its own (it will hold 99, 98 too); the copy fills its first two slots.
    assert kv_copies == [KVCopy(a.block_table[1], b.block_table[1], 2)]
    assert b.block_table[1] != a.block_table[1] and b.num_computed_tokens == 6
    assert bm.blocks[a.block_table[1]].ref_count == 1  # the source is only read, not shared
    bm.check_invariants()


def test_a_partial_match_needs_the_same_parent_and_the_same_leading_tokens():
    bm = BlockManager(16, BS)
    admit(bm, seq(range(10), "a"))
    # The same tokens as a's second block, but after another first block: a different place in the chain.
    assert bm.match_prefix(seq([9, 9, 9, 9, 4, 5, 6, 50], "b")).num_tokens == 0
    # The same first block, then a token that differs at once: nothing more than the whole block.
    match = bm.match_prefix(seq([0, 1, 2, 3, 77, 5, 6, 50], "c"))
    assert match.num_tokens == 4 and match.partial_block is None
    # A prompt's first block can be a partial match too (parent: none).
    match = bm.match_prefix(seq([0, 1, 2, 55, 56], "d"))
    assert match.blocks == [] and match.partial_tokens == 3


def test_an_evicted_block_is_no_longer_a_partial_match():
    bm = BlockManager(4, BS, watermark=0.0)
    a = seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    assert bm.match_prefix(seq([0, 1, 2, 3, 4, 5, 60], "probe")).partial_tokens == 2
    admit(bm, seq(range(100, 116), "b"))  # needs all 4 blocks: every cached prefix is overwritten
    assert bm.match_prefix(seq([0, 1, 2, 3, 4, 5, 60], "probe")).num_tokens == 0
    assert not bm._by_leading_tokens or all(bm.blocks[b].hash is not None for b in bm._by_leading_tokens.values())
    bm.check_invariants()


def exact_peak_growth(bm: BlockManager, growth: list[tuple[int, int]]) -> int:
    """Step by step: at step T each sequence not yet ended holds min(held + T, expected) tokens' blocks."""
    held_now = sum(bm._live_blocks(held) for held, _ in growth)
    last = max((expected - held for held, expected in growth), default=0)
    return max([0] + [sum(bm._live_blocks(held + t) for held, expected in growth if expected - held >= t) - held_now
                      for t in range(1, last + 1)])


def test_peak_growth_is_the_most_blocks_needed_at_once_not_the_sum_of_growths():
    # Blocks of 4. Two sequences hold 8 tokens (2 blocks) each: `a` grows to 48 tokens (10 more blocks),
    # `b` to 16 (2 more). `b` ends first and frees its 2 blocks; the peak is `a` at 48 tokens alone:
    # 12 blocks against the 4 both hold now, 8 more (not 12).
    bm = BlockManager(100, 4)
    assert bm.peak_growth([(8, 48), (8, 16)]) == 8
    assert bm.peak_growth([(8, 48)]) == 10
    assert bm.peak_growth([(8, 8), (8, 16)]) == 0  # `a` is done: its blocks are back before `b` needs more
    assert bm.peak_growth([]) == 0
    # With a window of 8 tokens a sequence never holds more than 3 blocks.
    assert BlockManager(100, 4, window=8).peak_growth([(8, 48)]) == 1


@pytest.mark.parametrize("window", [None, 24])
def test_peak_growth_is_the_step_by_step_peak(window):
    # Exact without a window; with one, at most a block per sequence more (the upper of the two counts
    # a sequence steps between inside its window).
    import random
    rng = random.Random(0)
    bm = BlockManager(100, 4, window=window)
    for _ in range(300):
        growth = []
        for _ in range(rng.randint(1, 8)):
            held = rng.randint(0, 40)
            growth.append((held, held + rng.choice([0, rng.randint(1, 60)])))
        exact = exact_peak_growth(bm, growth)
        if window:
            assert exact <= bm.peak_growth(growth) <= exact + len(growth), growth
        else:
            assert bm.peak_growth(growth) == exact, growth


def test_can_allocate_keeps_the_peak_growth_free():
    bm = BlockManager(14, 4, watermark=0.0)
    seq = Sequence("s", list(range(1, 9)), SamplingParams())
    match = bm.match_prefix(seq)
    assert bm.can_allocate(match, 8, [(8, 48)])  # 2 blocks now + 10 later = 12 of 14
    assert bm.can_allocate(match, 8, [(8, 48), (8, 24)])  # growths of 10 + 4 blocks, but 8 at the peak
    assert not bm.can_allocate(match, 8, [(8, 48), (8, 48)])  # ending together: 20 at the peak
