"""The gated MLP's activations on the gate, by the config's `hidden_act` (transformers' ACT2FN names)."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
