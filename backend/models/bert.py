"""BERT encoder over packed (unpadded) tokens, with a fused QKV projection and mean pooling.

The batch's texts are concatenated into one token axis, so every GEMM (QKV, output, FFN: nearly all
the FLOPs) runs on real tokens only. Only attention needs a per-text layout: see
`layers/packed_attention.py` (groups of similar length, little padding). Pooling sums each text's
rows with one index_add.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.layers.packed_attention import LengthGroup, make_groups, packed_attention

SUPPORTED_MODEL_TYPES = ("bert",)


@dataclass
class PackedBatch:
    """One forward's inputs, built on the host by `pack` and moved to the device in one go."""

    input_ids: torch.Tensor  # [tokens] int64, texts back to back (ascending length)
    positions: torch.Tensor  # [tokens] int64, 0.. within each text
    seq_index: torch.Tensor  # [tokens] int64: which text each token belongs to
    seq_lens: torch.Tensor  # [texts] float32 (divisor of the mean)
    groups: list[LengthGroup]

    def to(self, device: torch.device, non_blocking: bool = False) -> "PackedBatch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return PackedBatch(move(self.input_ids), move(self.positions), move(self.seq_index), move(self.seq_lens),
                           [g.to(device, non_blocking) for g in self.groups])

    def pin_memory(self) -> "PackedBatch":
        return PackedBatch(self.input_ids.pin_memory(), self.positions.pin_memory(), self.seq_index.pin_memory(),
                           self.seq_lens.pin_memory(), [g.pin_memory() for g in self.groups])

    @property
    def num_padded_tokens(self) -> int:
        """Token slots attention works on, padding included (equal to the tokens when nothing is padded)."""
        return sum(g.num_texts * g.max_len for g in self.groups)


def pack(token_ids: list[list[int]]) -> PackedBatch:
    """Host tensors for texts given as token-id lists, sorted by length (ascending)."""
    lens = [len(ids) for ids in token_ids]
    input_ids = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int64), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    positions = torch.arange(input_ids.numel(), dtype=torch.int64) - starts[seq_index]
    return PackedBatch(input_ids, positions, seq_index, lens_t.float(), make_groups(lens))


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.attn_out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def attention(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return packed_attention(self.qkv(x), batch.groups, self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_out(self.attention(x, batch)))
        # BERT's "gelu" is the exact (erf) form.
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """`forward` returns the final hidden states [tokens, hidden]; `mean_pool` gives [texts, hidden]."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg.position_embedding_type!r} is not supported")
        if cfg.hidden_act != "gelu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only BERT's exact gelu)")
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Position embeddings with token type 0 folded in: single-segment inputs only.
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embed_norm(self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions))
        for layer in self.layers:
            x = layer(x, batch)
        return x

    @staticmethod
    def mean_pool(hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Mean over each text's tokens (all of them are real: sentence-transformers' masked mean), in fp32."""
        sums = hidden.new_zeros(batch.seq_lens.shape[0], hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, batch.seq_index, hidden.float())
        return sums / batch.seq_lens.clamp(min=1e-9).unsqueeze(1)

    def load_hf_state_dict(self, tensors, names: list[str]) -> None:
        """Copy Hugging Face BertModel weights (name -> tensor getter) into the fused layout."""
        prefix = "bert." if any(n.startswith("bert.") for n in names) else ""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def get(name: str) -> torch.Tensor:
            return tensors[prefix + name]

        def put(name: str, value: torch.Tensor) -> None:
            if own[name].shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(own[name].shape)}, got {tuple(value.shape)}")
            own[name].data.copy_(value)
            loaded.add(name)

        put("word_embeddings.weight", get("embeddings.word_embeddings.weight"))
        put("position_embeddings.weight", get("embeddings.position_embeddings.weight")
            + get("embeddings.token_type_embeddings.weight")[0])
        for p in ("weight", "bias"):
            put(f"embed_norm.{p}", get(f"embeddings.LayerNorm.{p}"))
            for i in range(len(self.layers)):
                src, dst = f"encoder.layer.{i}.", f"layers.{i}."
                put(dst + f"qkv.{p}", torch.cat([get(src + f"attention.self.{n}.{p}") for n in ("query", "key", "value")]))
                put(dst + f"attn_out.{p}", get(src + f"attention.output.dense.{p}"))
                put(dst + f"attn_norm.{p}", get(src + f"attention.output.LayerNorm.{p}"))
                put(dst + f"ffn_in.{p}", get(src + f"intermediate.dense.{p}"))
                put(dst + f"ffn_out.{p}", get(src + f"output.dense.{p}"))
                put(dst + f"ffn_norm.{p}", get(src + f"output.LayerNorm.{p}"))
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
