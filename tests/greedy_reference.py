"""Transformers' greedy continuation of a prompt, checked from a candidate in one forward pass.

A candidate continuation is exactly what transformers' greedy `generate` would give when, in one
forward pass over the prompt and the candidate, the argmax at each position (after the same logits
processors: EOS masked where `min_new_tokens` masks it, then `processors`) is the candidate's next
token, no token before the last is EOS, and the last is EOS or the limit's. Checking that costs one
forward pass instead of one `generate` step per token, and gives the log-probs too. A candidate that
fails the check is replaced by `generate`'s own output, so a test comparing the engine with the
result fails as it would against `generate`.
"""

from __future__ import annotations

import torch


def transformers_greedy(model, prompt: list[int], candidate: list[int], max_new_tokens: int, *,
                        eos: list[int] | None = None, min_new_tokens: int = 0,
                        processors=()) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of `model.generate(prompt, max_new_tokens, min_new_tokens, greedy,
    logits_processor=processors)`, EOS ids `eos` (default: the model's generation config's). `processors`
    are transformers logits processors (`(input_ids [1, n], scores [1, vocab]) -> scores`)."""
    if eos is None:
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    new = list(candidate)
    if 0 < len(new) <= max_new_tokens:
        sequence = torch.tensor([prompt + new])
        with torch.no_grad():
            # The LM head on the positions that choose the candidate's tokens only (and the last, dropped).
            logits = model(sequence, logits_to_keep=len(new) + 1).logits[0, :-1].float()
        logits[:min_new_tokens, eos] = float("-inf")  # as transformers' MinNewTokensLengthLogitsProcessor
        for i in range(len(new) if processors else 0):
            for processor in processors:
                logits[i:i + 1] = processor(sequence[:, :len(prompt) + i], logits[i:i + 1])
        stops = [t in eos for t in new]
        if (logits.argmax(-1).tolist() == new and not any(stops[:-1])
                and (len(new) == max_new_tokens or stops[-1])):
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None]).squeeze(1)
            return new, logprobs.tolist()
    from transformers import LogitsProcessorList

    # The attention mask given: else transformers takes a prompt's EOS (the pad id here) for padding.
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList(processors), eos_token_id=eos or None,
                         pad_token_id=eos[0] if eos else None)
    new = out.sequences[0, len(prompt):].tolist()
    return new, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new)]
