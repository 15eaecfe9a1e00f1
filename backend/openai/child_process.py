"""The OpenAI server as a child process of `tritonllm-serve` (its --openai-port).

Apart from server.py on purpose: the launcher only starts the process, and importing the app (FastAPI,
pydantic, transformers' tokenizer support) would hold up tritonserver's start by most of a second.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


def start_server(triton_url: str, host: str, port: int, log_level: str = "warning",
                 extra_args: Sequence[str] = (), model_repository: str | None = None) -> subprocess.Popen:
    """Start the server as a child process (tritonllm-serve's --openai-port); it stops when its parent does.
    `extra_args`: more of its options (--chat-template, --tool-call-parser, ...); `model_repository`:
    tritonserver's, whose multi_lora.json files name the LoRA adapters it lists."""
    repository = ["--model-repository", model_repository] if model_repository else []
    cmd = [sys.executable, "-m", "tritonllm.openai", "--triton-url", triton_url, "--host", host,
           "--port", str(port), "--log-level", log_level, "--exit-with-parent", *repository, *extra_args]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
