"""Output constrained to one of a list of strings (vLLM's `guided_decoding: {"choice": [...]}`).

Each choice is tokenized on its own; at every step the sequence may only take a token that
continues some choice whose tokens match its output so far, or end of sequence once the output
is a whole choice that a longer one extends. A whole choice that nothing extends ends the
sequence at once. The allowed tokens reach the sampler as that step's allowed ids
(logit_adjustments.py), so greedy and sampled requests alike pick the most likely (or a
sampled) token among them.
"""

from __future__ import annotations


class GuidedChoice:
    def __init__(self, choices: list[tuple[int, ...]], eos_token_ids: set[int]):
        self.choices = sorted(set(choices))
        self.eos_token_ids = sorted(eos_token_ids)

    def start(self) -> "GuidedChoice":
        """A sequence's progress through the guide: the guide itself, which keeps none (see guided_regex.RegexCursor)."""
        return self

    def allowed_tokens(self, output: list[int]) -> list[int]:
        """The tokens the next step may take after `output`."""
        done = len(output)
        head = tuple(output)
        allowed = {c[done] for c in self.choices if len(c) > done and c[:done] == head}
        if head in self.choices or not allowed:  # a whole choice (or, defensively, a dead end): may end here
            allowed.update(self.eos_token_ids)
        return sorted(allowed)

    def is_complete(self, output: list[int]) -> bool:
        """Whether `output` is a whole choice that no other choice extends: nothing more may follow."""
        head = tuple(output)
        return head in self.choices and not any(len(c) > len(head) and c[:len(head)] == head for c in self.choices)
