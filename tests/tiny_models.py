"""Small random models written by transformers itself, for the tests of architectures other than the
default model's: the engine loads them from disk as it would a real checkpoint."""

from __future__ import annotations

import torch
import transformers


def tiny_config_args(tokenizer) -> dict:
    """A config's shared sizes: 2 layers of width 64, 4 query and 2 KV heads, the tokenizer's vocabulary."""
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)


def write_tiny_model(config, tokenizer, folder):
    """The model for `config`, with seeded random weights, saved with the tokenizer in `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights large enough that the tiny model's choices are far from ties
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
