"""The reference device backend: the plain PyTorch model as it is, on any device."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.attention_metadata import AttentionMetadata
from tritonllm.layers.kv_layout import HEAD_MAJOR


class DeviceBackend:
    """What a device adds to the plain model. This base is the torch reference: it changes nothing,
    and each hook below says what a faster backend may do instead.

    A backend is chosen once per engine (`devices.select_backend`) and applied once per loaded model
    (`optimize`, also on every tensor-parallel rank).
    """

    name = "torch"
    # Whether every row of a step is computed exactly as a one-token decode's row would be, so that a
    # speculative draft's rows give the same tokens and log-probs as decoding one at a time.
    exact_rows = False
    # How the KV pools are laid out (layers/kv_layout.py); whether attention also reads the step's
    # sequences as groups with masks (`AttentionMetadata.decode` / `prefill`); and whether it skips the
    # blocks kv_window pruning gives back in the middle of a context.
    kv_layout = HEAD_MAJOR
    takes_groups = False
    skips_pruned_blocks = True

    def optimize(self, model: nn.Module) -> nn.Module:
        """Apply the backend's fast paths to a loaded model (in place); returns it."""
        return model

    def capture(self, model: nn.Module, kv_caches, num_window_blocks: int) -> None:
        """Once the KV pools exist: capture what replays later (a backend's decode graphs)."""

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward for one step (a backend may plan its kernels first, or replay a graph)."""
        return model(input_ids, positions, kv_caches, meta)

    def for_worker(self) -> "DeviceBackend":
        """The backend a tensor-parallel rank >= 1 applies (such a rank never computes logits)."""
        return self

    def screens_greedy(self, rows: int) -> bool:
        """Whether a plain-greedy step of `rows` rows should take `greedy_ids` for the rows that want no
        log-prob (the runner's head: runner/head.py)."""
        return False

    def greedy_ids(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token ids of these final hidden states, found without the full logits."""
        raise NotImplementedError

    def greedy_head(self, logits: torch.Tensor, logprobs: bool = True) -> torch.Tensor | None:
        """Argmax and its log-prob of plain-greedy logits as the sampler packs them (int32 [2, rows]),
        where the backend has a fused op (None: the sampler's torch ops). Without `logprobs` (no row
        asked for one) the log-probs may be left out, as NaN."""
        return None

    def describe(self) -> str:
        return "torch reference (attention through torch ops, decode groups by context length)"
