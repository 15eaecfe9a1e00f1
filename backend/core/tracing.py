"""Named ranges of the engine's step for torch's profiler (`bench/offline_engine.py --profile`).

Off (the default), a range costs one global read and enters a shared null context; on, each shows in
the profiler's tables as `tritonllm.<name>`, with the host's time inside it and the calls it made.
"""

from __future__ import annotations

import contextlib

import torch

_enabled = False
_OFF = contextlib.nullcontext()


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def span(name: str):
    """A context naming the work inside it `tritonllm.<name>` while tracing is enabled."""
    return torch.profiler.record_function(f"tritonllm.{name}") if _enabled else _OFF
