"""Paged KV-cache bookkeeping with automatic prefix caching. Pure Python: no tensors here.

Every block holds `block_size` token slots in every layer's K/V pool. A sequence owns a block
table (list of block ids). Full blocks are identified by a hash chained over (parent hash, the
block's tokens), so equal prefixes map to equal hashes. Blocks that no sequence uses go back to
the free list but keep their hash: a later request with the same prefix reuses them, and they are
overwritten least recently freed first, only when no truly empty block is left.

A prefix rarely ends on a block boundary (a chat template's system prompt of 24 tokens fills one
block of 16 and half of the next). Past the last whole cached block, a new sequence also takes the
longest run of equal leading tokens from a cached block at the same place in the chain (same
parent hash): it gets a fresh block, and the step that admits it first copies those tokens' K/V
into it (`KVCopy`), so only the rest of the prompt is computed.

A manager may hold the K/V of layers that attend only to each query's last `window` positions
(every layer of Mistral; the sliding layers of Gemma 2 and 3, in a pool of their own:
window_pool.py). Blocks wholly behind the window are then freed as a sequence grows
(`release_behind_window`), and a cached prefix is usable when the blocks inside the window before
its end are cached, whatever became of the ones behind it: their table slots are -1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tritonllm.core.sequence import Sequence


# The Sequence attributes holding a sequence's block table in the main pool and in the window pool.
MAIN_TABLE, WINDOW_TABLE = "block_table", "window_block_table"


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class KVCopy(NamedTuple):
    """Copy the K/V of the first `num_tokens` slots of block `src` into block `dst`, in every layer of
    the pool (`window`: the sliding layers' window pool, window_pool.py; else the main one)."""

    src: int
    dst: int
    num_tokens: int
    window: bool = False


@dataclass
class PrefixMatch:
    """What a waiting sequence can reuse: whole cached blocks, then the leading tokens of one more."""

    blocks: list[int] = field(default_factory=list)
    partial_block: int | None = None  # a cached block whose first `partial_tokens` tokens equal ours
    partial_tokens: int = 0
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.partial_tokens


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def chain_root(seq: Sequence) -> int | None:
    """The parent hash of a sequence's first block: None for the base model, the adapter's identity for a
    LoRA request, whose K/V differ from the base model's for the same tokens (two adapters never share)."""
    name = seq.params.lora_name
    return None if name is None else hash(("lora", name))


def extend_block_hashes(seq: Sequence, block_size: int) -> range:
    """Chain the hashes of `seq`'s blocks whose K/V are now completely computed; the indexes added."""
    hashes = seq.block_hashes
    start, full = len(hashes), seq.num_computed_tokens // block_size
    tokens = seq.token_ids
    for i in range(start, full):
        hashes.append(chain_hash(hashes[-1] if hashes else chain_root(seq), tuple(tokens[i * block_size:(i + 1) * block_size])))
    return range(start, max(full, start))


class BlockManager:
    """Hands out KV blocks, keeps per-sequence block tables and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, window: int | None = None, table: str = MAIN_TABLE):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # the layers of this pool attend to each query's last `window` positions only
        self.table = table  # the Sequence attribute holding a sequence's block table in this pool
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is reused first (least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # (parent hash, the first k < block_size tokens of a cached block) -> that block: partial matches.
        self._by_leading_tokens: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self._watermark_blocks = int(watermark * num_blocks)
        self._num_cached_free = 0  # free blocks that still hold a hashed prefix (kept incrementally)
        # Prefix-cache statistics, in tokens.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- statistics -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def stats(self) -> dict[str, float]:
        return {"total": self.num_blocks, "used": self.num_used_blocks, "cached": self.num_cached_blocks,
                "free": self.num_free_blocks, "prefix_hit_rate": self.prefix_hit_rate}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `seq`, whole blocks (at most `max_blocks`) then part of one
        (never its last token). With a window, blocks behind the window of the match's end need not be
        cached: they come as -1."""
        match = PrefixMatch(block_size=self.block_size)
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:  # it scores every prompt position
            return match
        bs = self.block_size
        tokens = seq.token_ids
        limit = (len(tokens) - 1) // bs
        limit = limit if max_blocks is None else min(limit, max_blocks)
        hits: list[int | None] = []
        hashes: list[int] = []
        parent = root = chain_root(seq)
        for i in range(limit):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, block_tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is not None and self.blocks[block_id].token_ids != block_tokens:
                block_id = None
            if block_id is None and not self.window:
                break
            hits.append(block_id)
            hashes.append(h)
            parent = h
        num = self._usable_blocks(hits)
        behind = self.first_attended_block(num * bs)  # never read again: not taken even where cached
        match.blocks = [-1 if b is None or i < behind else b for i, b in enumerate(hits[:num])]
        parent = hashes[num - 1] if num else root
        start = num * bs
        # Longer leading runs are looked up while shorter ones hit; a hit is confirmed token by token.
        for k in range(1, min(bs - 1, len(tokens) - 1 - start) + 1):
            lead = tuple(tokens[start:start + k])
            block_id = self._by_leading_tokens.get((parent, lead))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids[:k] != lead:
                break
            match.partial_block, match.partial_tokens = block_id, k
        return match

    def _usable_blocks(self, hits: list[int | None]) -> int:
        """How many leading blocks of a walk along the hash chain a match can take: up to the first miss,
        or with a window the most whose blocks inside the window of their end are all cached."""
        if not self.window:
            return len(hits)
        best, last_miss = 0, -1
        for num in range(1, len(hits) + 1):
            if hits[num - 1] is None:
                last_miss = num - 1
            if last_miss < self.first_attended_block(num * self.block_size):
                best = num
        return best

    def first_attended_block(self, num_computed_tokens: int) -> int:
        """The first block a step starting at position `num_computed_tokens` (or any later step) reads:
        every block wholly before `num_computed_tokens - window` is behind each query's window."""
        return max(num_computed_tokens - self.window, 0) // self.block_size if self.window else 0

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, match: PrefixMatch, num_tokens: int, growth: Iterable[tuple[int, int]] = ()) -> bool:
        """Whether a waiting sequence can get blocks for `num_tokens` tokens, reusing `match`, with blocks
        left for `growth`: sequences (running ones and this one) expected to go from holding the first
        number of tokens to the second (the scheduler's `reserve_known_growth`)."""
        new = max(self.blocks_for(num_tokens) - len(match.blocks), 0)
        return self._revived(match) + new + self.peak_growth(growth) <= self.num_free_blocks - self._watermark_blocks

    def peak_growth(self, growth: Iterable[tuple[int, int]]) -> int:
        """The most blocks, beyond those they hold now, that sequences growing by a token a step need at
        once, each freeing its blocks when it has grown to its expected size (`growth`: (tokens held,
        tokens expected) each). Sequences end at different times, so the peak is below the sum of their
        growths: it comes just before one of them ends, when the ones that end later have grown as much."""
        growth = np.array(list(growth), dtype=np.int64).reshape(-1, 2)
        held, steps = growth[:, 0], growth[:, 1] - growth[:, 0]
        ends = np.unique(steps[steps > 0])  # the moments that can be a peak
        if not len(ends):
            return 0
        at_end = self._most_live_blocks(held[:, None] + ends[None, :])  # [sequence, moment]
        at_end[steps[:, None] < ends[None, :]] = 0  # ended before that moment: its blocks are back
        held_now = sum(self._live_blocks(int(n)) for n in held)
        return max(int(at_end.sum(axis=0).max()) - held_now, 0)

    def _most_live_blocks(self, num_tokens: np.ndarray) -> np.ndarray:
        """The most blocks a sequence holds on its way to `num_tokens` tokens. Without a window that is
        its blocks then (so the peak is exact); inside a window the count steps between two values as
        blocks fill and fall behind it: the higher one is taken, one block more than held at most."""
        live = -(-num_tokens // self.block_size)
        if self.window:
            live = np.minimum(live, -(-self.window // self.block_size) + 1)
        return live

    def _live_blocks(self, num_tokens: int) -> int:
        """The blocks a sequence of `num_tokens` tokens holds: all of them, or with a window the ones inside it."""
        return self.blocks_for(num_tokens) - self.first_attended_block(num_tokens)

    def _revived(self, match: PrefixMatch) -> int:
        return sum(1 for b in match.blocks if b >= 0 and self.blocks[b].ref_count == 0)

    def new_tokens_that_fit(self, match: PrefixMatch) -> int:
        """How many tokens past `match` the free blocks could take (an upper bound; can_allocate decides)."""
        held = sum(1 for b in match.blocks if b >= 0)
        return (self.num_free_blocks - held) * self.block_size - match.partial_tokens

    def allocate(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> list[KVCopy]:
        """Give a waiting sequence its block table: the matched blocks, then fresh ones.

        Returns the K/V copy that a partial match needs (none or one); the step that admits `seq`
        must run it before its forward writes any K/V (the source block may be handed out again in
        the same step, and is only read by the copy).
        """
        table = getattr(seq, self.table)
        assert not table, f"{seq} already has blocks"
        for block_id in match.blocks:
            table.append(block_id)
            if block_id < 0:  # behind the window: never read
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
        seq.num_computed_tokens = match.num_tokens
        seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        self._grow(seq, num_tokens)
        if not match.partial_tokens:
            return []
        return [KVCopy(match.partial_block, table[len(match.blocks)], match.partial_tokens,
                       window=self.table == WINDOW_TABLE)]

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in total."""
        return self.blocks_for(num_tokens) - len(getattr(seq, self.table)) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        self._grow(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        table = getattr(seq, self.table)
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached prefix
            self._num_cached_free -= 1
            self._forget(block)
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Its tail goes first in the eviction order, its head last."""
        for block_id in reversed(getattr(seq, self.table)):
            if block_id < 0:  # pruned out of the KV window already
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    # Nothing reusable in it: make it the first to be handed out again.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None
                    self._num_cached_free += 1
        setattr(seq, self.table, [])
        seq.num_computed_tokens = 0

    def release_block(self, seq: Sequence, index: int, exact: bool = False) -> None:
        """Drop one block of a running sequence that no later query attends to; its slot becomes -1.

        `exact`: the model's own sliding window passed it, so its K/V are still the prefix's own and a
        cached prefix stays cached (freed last in line, as `free` does). Otherwise (lossy `kv_window`
        pruning) it is forgotten and handed out first.
        """
        table = getattr(seq, self.table)
        block_id = table[index]
        if block_id < 0:
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if exact and block.hash is not None:
                self._num_cached_free += 1
            else:
                self._free.move_to_end(block_id, last=False)
                if block.hash is not None:
                    self._forget(block)
        table[index] = -1

    def release_blocks(self, seq: Sequence, first: int, end: int, exact: bool = False) -> None:
        """Release blocks [first, end) of `seq`, newest first. Every step releases such a range with an
        end that only grows, so the first block found released marks where the last step stopped."""
        table = getattr(seq, self.table)
        for index in range(end - 1, first - 1, -1):
            if table[index] < 0:
                break
            self.release_block(seq, index, exact)

    def release_behind_window(self, seq: Sequence) -> None:
        """Free the blocks no query of this step or later reads, exactly: those behind the window
        (nothing without one). Their K/V are still the prefix's own, so they stay cached."""
        if self.window:
            self.release_blocks(seq, 0, self.first_attended_block(seq.num_computed_tokens), exact=True)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks whose K/V are now completely computed."""
        if self.enable_prefix_caching:
            self.register_blocks(seq, extend_block_hashes(seq, self.block_size))

    def register_blocks(self, seq: Sequence, indexes: range) -> None:
        """Make `seq`'s blocks at `indexes` (hashed already: seq.block_hashes) findable by their prefix."""
        bs = self.block_size
        hashes, table, tokens = seq.block_hashes, getattr(seq, self.table), seq.token_ids
        for i in indexes:
            block_id = table[i]
            if block_id < 0:
                continue
            block = self.blocks[block_id]
            if block.hash is None:
                h, parent = hashes[i], hashes[i - 1] if i else chain_root(seq)
                block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
                block.hash, block.parent_hash, block.token_ids = h, parent, block_tokens
                if self._hash_to_block.setdefault(h, block_id) == block_id:
                    for k in range(1, bs):  # the newest block with these leading tokens is the one found
                        self._by_leading_tokens[(block.parent_hash, block_tokens[:k])] = block_id

    def _forget(self, block: Block) -> None:
        """Drop a block's cached prefix from the indexes (it is about to be overwritten or was pruned)."""
        if self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        for k in range(1, self.block_size):
            key = (block.parent_hash, block.token_ids[:k])
            if self._by_leading_tokens.get(key) == block.block_id:
                del self._by_leading_tokens[key]
        block.hash = block.parent_hash = block.token_ids = None

    def check_invariants(self) -> None:
        """For tests: every block is either free with ref 0 or used with ref > 0."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h
        for (parent, lead), block_id in self._by_leading_tokens.items():
            block = self.blocks[block_id]
            assert block.hash is not None and block.parent_hash == parent and block.token_ids[:len(lead)] == lead
        assert self._num_cached_free == sum(1 for b in self._free if self.blocks[b].hash is not None)
