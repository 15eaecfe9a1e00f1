"""The token ids our engine makes of a scenario's prompt, for the baselines and peers that must get the
same ones. Imports only what tokenizing needs, so benchmarks on machines without tritonclient use it too."""

from __future__ import annotations


def chat_token_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt in the model's chat template, as our engine builds it (`apply_chat_template=True`)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def prompt_token_ids(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """The token ids our engine makes of a scenario's prompt: in the chat template where the scenario
    says `chat_template: true`, else the text as it is (`apply_chat_template=False`)."""
    if chat_template:
        return chat_token_ids(tokenizer, prompt)
    return list(tokenizer.encode(prompt, add_special_tokens=True))
