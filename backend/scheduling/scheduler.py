"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step first gives each running sequence its next token (a decode, or the next chunk of a
prompt that did not fit earlier), then fills what is left of the token budget with prompt
chunks of waiting sequences, in the order the policy says. Prefill and decode share one forward.
When KV blocks run out, the most recently admitted running sequence is preempted: its blocks
are freed and it is recomputed later (greedy output is unchanged by that). With
`reserve_known_growth`, preemption is avoided where the future is known: a waiting sequence is
admitted only if the blocks also hold, at their peak, the outputs that the running sequences and it
are certain to produce (`_known_growth`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from tritonllm.core.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tritonllm.core.sequence import FinishReason, Sequence, SequenceStatus
from tritonllm.scheduling.block_manager import BlockManager, KVCopy
from tritonllm.scheduling.ngram_draft import DraftAcceptance, draft_for
from tritonllm.scheduling.window_pool import WindowPoolBlockManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    kv_copies: list[KVCopy] = field(default_factory=list)  # prefix K/V to copy into its blocks before the forward
    first_row: int = -1  # its first token's row among the step's flat tokens (set by step_inputs)
    # Speculative draft tokens fed after its last token (ngram_draft.py); included in num_new_tokens.
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a new token is sampled (with a draft,
        one per row: after the last token and after each draft token)."""
        return bool(self.draft) or self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    num_preempted: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager | WindowPoolBlockManager, config: SchedulerConfig,
                 max_model_len: int, cache: CacheConfig | None = None, speculative: SpeculativeConfig | None = None,
                 max_loras: int = 0):
        """`cache`: for its recent-window pruning settings; `speculative`: drafts as configured where the
        runner computes drafted rows exactly (None: no drafts); `max_loras`: the most LoRA adapters running
        at once (the runner's adapter slots), where adapters are served."""
        self.block_manager = block_manager
        self.config = config
        self.max_model_len = max_model_len
        self.cache = cache or CacheConfig()
        self.speculative = speculative or SpeculativeConfig(num_tokens=0)
        self.waiting: list[tuple[tuple, Sequence]] = []  # sorted by policy key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.max_loras = max_loras

    # ---- queues ----------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple:
        # Preempted sequences go back in front: they already hold the caller's attention.
        first = 0 if seq.num_preemptions else 1
        if self.config.policy == "priority":
            return (first, seq.params.priority, seq.arrival_index)
        if self.config.policy == "longest_output_first":
            limit = seq.params.max_tokens
            return (first, -(limit if limit is not None else self.max_model_len), seq.arrival_index)
        return (first, seq.arrival_index)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, (self._key(seq), seq), key=lambda item: item[0])

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> bool:
        """Remove a sequence wherever it is and free its blocks. False if it was not here."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            for i, (_, s) in enumerate(self.waiting):
                if s is seq:
                    del self.waiting[i]
                    break
            else:
                return False
        self.block_manager.free(seq)
        seq.finish(FinishReason.ABORT)
        return True

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:  # preempted while the token that ends it was on its way (async scheduling): its blocks are free
            self.waiting = [(key, s) for key, s in self.waiting if s is not seq]
        seq.finish(reason)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self, speculate: bool = True) -> SchedulerOutput:
        """The next step. `speculate=False` while a step is still in flight (async scheduling): its
        sequences' last tokens are not on the host yet, and drafts are read from them."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        num_preempted = 0

        # 1. Running sequences: decodes and unfinished prompt chunks, oldest first.
        i = 0
        num_ending = 0  # running sequences whose last token is on its way: they take no more steps
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._at_length_limit(seq):
                # Only while a step is in flight (async scheduling): its token is this sequence's last.
                num_ending += 1
                i += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + num_new
            self._release_behind_windows(seq)  # before growing: its own freed blocks can take the new tokens
            while not bm.can_append(seq, target):
                victim = self.running[-1]
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, target)
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted

        # 2. Waiting sequences, in policy order, while budget, slots and blocks allow.
        # Nothing new is admitted in a step that had to preempt: memory is short.
        # A sibling completion whose prompt is still being computed by its lead is passed over (not
        # blocking the queue): next step it reuses the lead's prompt blocks.
        now = time.time()
        growth = self._known_growth(scheduled) if self.waiting and not num_preempted else []
        # A request for an adapter that is not running waits while max_loras others run (others pass it).
        adapters = {seq.params.lora_name for seq in self.running} - {None} if self.max_loras else set()
        i = 0
        while (i < len(self.waiting) and budget > 0 and not num_preempted
               and len(self.running) - num_ending < self.config.max_num_seqs):
            _, seq = self.waiting[i]
            lora_name = seq.params.lora_name
            if seq.waits_for_prefix or (lora_name is not None and lora_name not in adapters
                                        and len(adapters) >= self.max_loras):
                i += 1
                continue
            match = bm.match_prefix(seq)
            num_cached = match.num_tokens
            num_new = min(seq.num_tokens - num_cached, budget)
            held = num_cached + num_new
            if not self.running and not scheduled:
                # Nothing runs, so nothing is held back for this one; if even an empty pool cannot
                # take this chunk, shrink it to what fits.
                if not bm.can_allocate(match, held):
                    num_new = min(num_new, bm.new_tokens_that_fit(match))
                    held = num_cached + num_new
                    if num_new <= 0 or not bm.can_allocate(match, held):
                        break
            elif not bm.can_allocate(match, held, growth + self._known_growth_of(seq, held)):
                break
            growth += self._known_growth_of(seq, held)  # what those admitted after it leave room for
            self.waiting.pop(i)
            kv_copies = bm.allocate(seq, match, num_cached + num_new)
            seq.status = SequenceStatus.RUNNING
            if not seq.times.scheduled:
                seq.times.scheduled = now
            self.running.append(seq)
            if lora_name is not None:
                adapters.add(lora_name)
            scheduled.append(ScheduledSeq(seq, num_new, kv_copies))
            budget -= num_new

        # 3. Speculative drafts (ngram_draft.py) for the decodes of a step of few sequences, or of any step
        # for a sequence whose drafts keep being right, in the budget and free blocks left over: never at
        # the cost of a prompt chunk or of another sequence's blocks. Not under recent-window pruning: a
        # draft row would see the blocks that decoding up to it would have dropped.
        few = len(scheduled) <= self.speculative.max_batch
        if (speculate and self.speculative.num_tokens and not num_preempted
                and (few or self.speculative.min_acceptance < 1)
                and not (self.cache.kv_window or self.cache.kv_window_ratio)):
            for item in scheduled:
                seq = item.seq
                # A LoRA row's delta (layers/lora.py) is not computed bit for bit alike at every row count,
                # which drafts rely on: adapters' sequences decode one token a step.
                if item.num_new_tokens != 1 or seq.num_uncomputed_tokens != 1 or seq.params.lora_name is not None:
                    continue
                if seq.draft_acceptance is None:
                    seq.draft_acceptance = DraftAcceptance()
                record = seq.draft_acceptance
                record.settle(seq.token_ids)
                length = self.speculative.num_tokens if few else self._trusted_draft_length(record.rate)
                drafting = budget > 0 and length > 0
                draft = draft_for(seq, min(length, budget) if drafting else 1, self.max_model_len)
                if drafting and draft and bm.can_append(seq, seq.num_tokens + len(draft)):
                    bm.append_slots(seq, seq.num_tokens + len(draft))
                    item.draft = draft
                    item.num_new_tokens += len(draft)
                    budget -= len(draft)
                record.expect(seq.num_tokens, draft)  # a draft not fed is still a guess to score

        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, num_preempted)

    def may_draft(self) -> bool:
        """Whether the next step may give a sequence draft tokens (section 3 of `schedule`): a step of few
        sequences, or a sequence whose drafts have earned a place in larger ones."""
        spec = self.speculative
        if not spec.num_tokens or self.cache.kv_window or self.cache.kv_window_ratio:
            return False
        if len(self.running) <= spec.max_batch:
            return True
        return spec.min_acceptance < 1 and any(
            seq.draft_acceptance is not None and self._trusted_draft_length(seq.draft_acceptance.rate)
            for seq in self.running)

    def _at_length_limit(self, seq: Sequence) -> bool:
        """Whether `seq` holds as many tokens as it may: never after its tokens are all applied (it has
        finished then), only while its last one is on the way to the host."""
        limit = seq.params.max_tokens
        return (limit is not None and seq.num_output_tokens >= limit) or seq.num_tokens >= self.max_model_len

    def _trusted_draft_length(self, rate: float) -> int:
        """Draft tokens for a sequence whose draft positions are right at `rate`, in a step of more than
        speculative_max_batch sequences: the j-th is taken while rate^j, the chance that it is accepted
        (the ones before it too), stays at or above speculative_min_acceptance."""
        bar = self.speculative.min_acceptance
        length, chance = 0, rate
        while bar < 1 and length < self.speculative.num_tokens and chance >= bar:
            length += 1
            chance *= rate
        return length

    def _known_growth(self, scheduled: list[ScheduledSeq]) -> list[tuple[int, int]]:
        """(tokens held, tokens certain to be held) of each running sequence (see `_known_growth_of`)."""
        if not self.config.reserve_known_growth:
            return []
        held = {id(item.seq): item.seq.num_computed_tokens + item.num_new_tokens for item in scheduled}
        return [g for seq in self.running for g in self._known_growth_of(seq, held.get(id(seq), seq.num_computed_tokens))]

    def _known_growth_of(self, seq: Sequence, held: int) -> list[tuple[int, int]]:
        """What a sequence holding `held` tokens' K/V is certain to grow to: the rest of its prompt and the
        outputs it must produce, every one up to max_tokens (or max_model_len) with ignore_eos, else up
        to min_tokens. Longer outputs are a guess, and holding blocks back for a guess costs concurrency
        (docs/PERFORMANCE.md, "Admission"). Under recent-window pruning a sequence holds a window's
        blocks whatever its length: nothing is held back."""
        if not self.config.reserve_known_growth or self.cache.kv_window or self.cache.kv_window_ratio:
            return []
        outputs = seq.params.min_tokens
        if seq.params.ignore_eos:
            outputs = seq.params.max_tokens if seq.params.max_tokens is not None else self.max_model_len
        known = min(seq.num_prompt_tokens + max(outputs, seq.num_output_tokens), self.max_model_len)
        return [(held, known)] if known > held else []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _release_behind_windows(self, seq: Sequence) -> None:
        """Free the blocks no query of this step or later attends to.

        The model's own window (the layers that slide) is exact: this step's queries start at position
        `num_computed_tokens` and see keys after `num_computed_tokens - window`, so every block wholly
        before that position is dead (block_manager.py). Recent-window KV pruning (`kv_window`,
        `kv_window_ratio`) is the lossy one: it keeps its window and the sink blocks, and drops what the
        model would still read.
        """
        self.block_manager.release_behind_window(seq)
        window = self.cache.kv_window or int(self.cache.kv_window_ratio * seq.num_prompt_tokens)
        if not window:
            return
        bs = self.block_manager.block_size
        keep_from = seq.num_computed_tokens - window  # first position still attended
        first_block = -(-self.cache.kv_sink_tokens // bs)  # sink blocks are never pruned
        self.block_manager.release_blocks(seq, first_block, max(keep_from, 0) // bs)

    # ---- after the forward -----------------------------------------------------------------
    def commit(self, out: SchedulerOutput) -> None:
        """Advance computed-token counters once the step's K/V are written. Of a drafted sequence only its
        last token's K/V count here; the accepted drafts' count once they are its tokens (`commit_accepted`)."""
        for item in out.scheduled:
            if item.seq.is_finished:  # ended by the step before it, which landed later (async scheduling)
                continue
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            self.block_manager.commit_full_blocks(item.seq)

    def commit_accepted(self, seq: Sequence, num_drafts: int) -> None:
        """`num_drafts` accepted draft tokens, now appended to `seq`, have their K/V in its blocks (written
        at their positions this step); the rejected ones' slots are overwritten as it grows."""
        seq.num_computed_tokens += num_drafts
        self.block_manager.commit_full_blocks(seq)
