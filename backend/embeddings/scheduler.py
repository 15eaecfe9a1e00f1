"""Token-budget batching for prefill-only work: pure Python, no torch.

Texts wait in arrival order. A forward takes texts from the head of the queue until the next one
would overflow `max_num_batched_tokens` (real tokens: the encoder packs texts without padding) or
`max_num_seqs`. Taking from the head keeps service first-come first-served, so no text starves;
the batch is then sorted by length, so that attention (the only padded part) groups similar lengths.
A batch that is prepared but not yet running can be topped up with texts that arrived since.
"""

from __future__ import annotations

from collections import deque

from tritonllm.embeddings.request import TextItem


class EmbeddingScheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[TextItem] = deque()
        self.num_dropped = 0  # texts of done (aborted/failed) requests dropped so far

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, items: list[TextItem]) -> None:
        for item in items:
            if item.num_tokens > self.max_num_batched_tokens:
                raise ValueError(f"a text of {item.num_tokens} tokens exceeds the token budget")
        self.waiting.extend(items)

    def schedule(self, current: list[TextItem] | None = None) -> list[TextItem]:
        """Texts to add to `current` (the batch being prepared, possibly empty) within the limits.

        Texts of requests that are already done (failed or aborted) are dropped on the way.
        """
        num_tokens = sum(item.num_tokens for item in current or ())
        num_seqs = len(current or ())
        picked: list[TextItem] = []
        while self.waiting and num_seqs < self.max_num_seqs:
            item = self.waiting[0]
            if item.request.done:
                self.waiting.popleft()
                self.num_dropped += 1
                continue
            if num_tokens + item.num_tokens > self.max_num_batched_tokens:
                break  # first-come first-served: no smaller text overtakes it
            self.waiting.popleft()
            picked.append(item)
            num_tokens += item.num_tokens
            num_seqs += 1
        return picked
