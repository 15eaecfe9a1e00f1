"""The only device code of the embedding engine: weights, host-side batch preparation, forward, pooling.

`prepare` runs on the scheduler thread (host tensors; pinned on CUDA so the copy overlaps);
`run` runs on the executor thread and returns float32 embeddings on the host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tritonllm.devices import platform as devices
from tritonllm.models.loader import SafetensorsIndex, load_hf_config
from tritonllm.models.bert import BertEncoder, PackedBatch, pack

logger = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """A forward's host tensors plus the per-text normalisation switch."""

    packed: PackedBatch
    normalize: torch.Tensor  # [texts] bool
    num_tokens: int


class EmbeddingRunner:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        cfg = load_hf_config(folder)
        model = BertEncoder(cfg)
        index = SafetensorsIndex(folder)  # safetensors only: pickled weights are never loaded
        model.load_hf_state_dict(index, list(index._where))
        self.model = model.to(device=device, dtype=dtype).eval()
        self.dim = cfg.hidden_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self._pin = device.type == "cuda"  # page-locked host memory: non-blocking host-to-device copies

    def prepare(self, token_ids: list[list[int]], normalize: list[bool]) -> PreparedBatch:
        """Host tensors for one forward; texts should come sorted by length (less attention padding)."""
        packed = pack(token_ids)
        flags = torch.tensor(normalize, dtype=torch.bool)
        if self._pin:
            packed, flags = packed.pin_memory(), flags.pin_memory()
        return PreparedBatch(packed, flags, int(packed.input_ids.numel()))

    @torch.inference_mode()
    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """[texts, dim] float32 on the host: mean-pooled, L2-normalised where asked."""
        packed = batch.packed.to(self.device, non_blocking=True)
        hidden = self.model(packed)
        pooled = BertEncoder.mean_pool(hidden, packed)
        flags = batch.normalize.to(self.device, non_blocking=True)
        # F.normalize is what sentence-transformers' Normalize module applies (eps 1e-12).
        out = torch.where(flags.unsqueeze(1), F.normalize(pooled, p=2.0, dim=-1), pooled)
        return out.cpu()

    def warmup(self, max_num_batched_tokens: int, max_model_len: int) -> tuple[float, int]:
        """One forward per typical shape so the first requests pay no one-off kernel set-up cost.

        Returns (seconds, tokens) of a last, timed forward: a first estimate of the forward speed.
        """
        lengths = [[8], [8, 16, 32], [min(max_model_len, max_num_batched_tokens)], [16] * 8 + [64] * 2]
        for lens in lengths:
            started = time.perf_counter()
            self.run(self.prepare([[101] + [1000] * (n - 2) + [102] for n in lens], [True] * len(lens)))
            devices.synchronize(self.device)
        return time.perf_counter() - started, sum(lengths[-1])
