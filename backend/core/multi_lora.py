"""A model folder's multi_lora.json: the LoRA adapters it serves, as Triton's vLLM backend names them.

Read by the model at load (serving/instance_config.py) and by the OpenAI front, which lists each
adapter as a model of its own (openai/).
"""

from __future__ import annotations

import json
from pathlib import Path

from tritonllm.core.parameters import ConfigError

MULTI_LORA_FILE = "multi_lora.json"  # beside config.pbtxt


def read_multi_lora(model_dir: Path) -> tuple[tuple[str, str], ...]:
    """The adapters of the model folder's multi_lora.json (name -> folder, a relative folder taken from the
    model folder), as (name, absolute folder) pairs in the file's order; () without the file.
    Its presence turns LoRA on; the adapters themselves are read and checked when the engine loads."""
    path = model_dir / MULTI_LORA_FILE
    if not path.is_file():
        return ()
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{path} must be a JSON object naming at least one adapter: {{\"name\": \"folder\"}}")
    adapters = []
    for name, folder in entries.items():
        if not name or not isinstance(folder, str) or not folder:
            raise ConfigError(f"{path}: adapter {name!r} must map to a folder path, got {folder!r}")
        where = (model_dir / folder).resolve()
        if not where.is_dir():
            raise ConfigError(f"{path}: adapter {name!r}: folder {where} does not exist")
        adapters.append((name, str(where)))
    return tuple(adapters)
