"""KV blocks of a model whose sliding layers keep their K/V in a pool of their own.

Gemma 2 (every other layer), Gemma 3 and OLMo 3 (five and three of every six or four), and Qwen from
`max_window_layers` on mix layers that attend to the whole sequence with layers that attend to each
query's last `sliding_window` positions. With one pool, every layer's K/V of every position stay
as long as the sequence, because the full layers read them all. Here the full layers' K/V live in
the main pool and the sliding layers' in the window pool, each with its own blocks and a block
table per sequence (`Sequence.block_table`, `Sequence.window_block_table`, the same logical block
at the same index). The window pool frees what is behind the window as a sequence grows, so past the
window a sequence holds the sliding layers' K/V of about a window's worth of positions: for Gemma
3 (window 512-1024, five sliding layers in six) a long sequence then needs ~1/6 of the memory.

The scheduler sees one block manager: a sequence is admitted, grown and preempted when both pools
allow it, and a cached prefix is reused as far as both pools hold it (the window pool only needs
the blocks inside the window before the prefix's end). Outputs are unchanged: the sliding layers
never read what is freed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tritonllm.core.sequence import Sequence
from tritonllm.scheduling.block_manager import WINDOW_TABLE, BlockManager, KVCopy, PrefixMatch, extend_block_hashes


@dataclass
class PoolMatches:
    """A waiting sequence's prefix match in each pool: the same tokens, each pool's own blocks."""

    main: PrefixMatch
    window: PrefixMatch

    @property
    def num_tokens(self) -> int:
        return self.main.num_tokens


def window_pool_blocks_per_sequence(window: int, max_num_batched_tokens: int, max_model_len: int,
                                    block_size: int) -> int:
    """The most window-pool blocks one sequence holds: a step's new tokens (up to the token budget) and
    the window before them, rounded out to whole blocks at both ends; never more than max_model_len's."""
    return min(-(-(window + max_num_batched_tokens) // block_size) + 2, -(-max_model_len // block_size))


class WindowPoolBlockManager:
    """The main pool's BlockManager and the window pool's, driven together (the scheduler's interface)."""

    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool = True):
        self.main = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.window = BlockManager(num_window_blocks, block_size, enable_prefix_caching, window=window,
                                   table=WINDOW_TABLE)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    # ---- statistics: the main pool's, with the window pool's beside them ------------------------
    @property
    def num_blocks(self) -> int:
        return self.main.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.main.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.main.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.main.num_cached_blocks

    @property
    def prefix_hit_tokens(self) -> int:
        return self.main.prefix_hit_tokens

    @property
    def prefix_query_tokens(self) -> int:
        return self.main.prefix_query_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.main.prefix_hit_rate

    def stats(self) -> dict:
        window = self.window.stats()
        del window["prefix_hit_rate"]
        return {**self.main.stats(), "window_pool": window}

    # ---- the scheduler's interface ---------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PoolMatches:
        """The longest prefix both pools hold, and the leading tokens of one more block both hold."""
        main = self.main.match_prefix(seq)
        window = self.window.match_prefix(seq, max_blocks=len(main.blocks))
        if len(window.blocks) < len(main.blocks):  # its partial block is looked up at the same place
            main = self.main.match_prefix(seq, max_blocks=len(window.blocks))
        shared = min(main.partial_tokens, window.partial_tokens)
        for match in (main, window):  # any leading run of a block's tokens is a match too
            match.partial_tokens = shared
            if not shared:
                match.partial_block = None
        return PoolMatches(main, window)

    def can_allocate(self, match: PoolMatches, num_tokens: int, growth: Iterable[tuple[int, int]] = ()) -> bool:
        growth = list(growth)
        return (self.main.can_allocate(match.main, num_tokens, growth)
                and self.window.can_allocate(match.window, num_tokens, growth))

    def new_tokens_that_fit(self, match: PoolMatches) -> int:
        return min(self.main.new_tokens_that_fit(match.main), self.window.new_tokens_that_fit(match.window))

    def allocate(self, seq: Sequence, match: PoolMatches, num_tokens: int) -> list[KVCopy]:
        return self.main.allocate(seq, match.main, num_tokens) + self.window.allocate(seq, match.window, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.main.can_append(seq, num_tokens) and self.window.can_append(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        self.main.append_slots(seq, num_tokens)
        self.window.append_slots(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self.main.free(seq)
        self.window.free(seq)

    def release_behind_window(self, seq: Sequence) -> None:
        self.window.release_behind_window(seq)

    def release_blocks(self, seq: Sequence, first: int, end: int, exact: bool = False) -> None:
        """Recent-window pruning (lossy) drops the same positions from every layer."""
        self.main.release_blocks(seq, first, end, exact)
        self.window.release_blocks(seq, first, end, exact)

    def commit_full_blocks(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            new = extend_block_hashes(seq, self.block_size)
            self.main.register_blocks(seq, new)
            self.window.register_blocks(seq, new)

    def check_invariants(self) -> None:
        self.main.check_invariants()
        self.window.check_invariants()
