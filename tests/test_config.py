"""The engine's configuration: grouped dataclasses built from config.pbtxt parameters by their names."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from tritonllm.embeddings.config import EmbeddingConfig
from tritonllm.core.config import RETIRED_PARAMETERS, EngineConfig, parameter_fields
from tritonllm.core.parameters import ConfigError

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"

# The groups as docs/CONFIG.md heads them.
GROUP_HEADINGS = {"model": "Model", "device": "Device", "scheduler": "Scheduler", "cache": "KV cache",
                  "speculative": "Speculative decoding", "parallel": "Parallelism", "cpu": "CPU backend",
                  "cuda": "CUDA backend", "npu": "Ascend backend", "lora": "LoRA adapters",
                  "serving": "Serving"}


def test_parameters_reach_their_groups_by_their_config_pbtxt_names():
    config = EngineConfig.from_parameters({"max_num_seqs": "8", "num_kv_blocks": "100", "cpu_gemm": "onednn",
                                           "speculative_tokens": "2", "model": "/models/x", "kv_cache_dtype": "float16",
                                           "exact_block_weights": "false", "tensor_parallel_size": "2"})
    assert config.scheduler.max_num_seqs == 8 and config.cache.num_blocks == 100
    assert config.cpu.gemm == "onednn" and config.cpu.exact_blocks is False
    assert config.speculative.num_tokens == 2 and config.model.path == "/models/x"
    assert config.cache.dtype == "float16" and config.parallel.tensor_parallel_size == 2
    assert config.parameters()["max_num_seqs"] == 8
    changed = config.with_parameters(max_num_seqs=4, block_size="32")
    assert (changed.scheduler.max_num_seqs, changed.cache.block_size) == (4, 32)
    assert config.scheduler.max_num_seqs == 8  # the original is unchanged (frozen groups)


def test_every_default_repository_parameter_is_known():
    for path in sorted(REPOSITORY.glob("smollm2/**/*.pbtxt")):
        names = re.findall(r'key:\s*"([^"]+)"', path.read_text())
        unknown = [n for n in names if n not in parameter_fields() and n not in RETIRED_PARAMETERS]
        assert not unknown, f"{path}: {unknown}"
        EngineConfig.from_parameters({n: v for n, v in re.findall(
            r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', path.read_text())})


def test_bad_values_name_the_parameter():
    with pytest.raises(ConfigError, match="'max_num_seqs' must be an integer"):
        EngineConfig.from_parameters({"max_num_seqs": "lots"})
    with pytest.raises(ConfigError, match="unknown parameter 'maxseqs'"):
        EngineConfig.from_parameters({"maxseqs": "4"})
    with pytest.raises(ConfigError, match="num_kv_blocks must be >= 0"):
        EngineConfig.from_parameters(num_kv_blocks=-1)
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        EngineConfig.from_parameters(scheduling_policy="random")
    with pytest.raises(ConfigError, match="cpu_gemm must be one of"):
        EngineConfig.from_parameters(cpu_gemm="mkl")
    with pytest.raises(ConfigError, match="kv_window must be at least 2 \\* block_size"):
        EngineConfig.from_parameters(kv_window=8)
    with pytest.raises(ConfigError, match="device must be auto, cpu"):
        EngineConfig.from_parameters(device="tpu")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_parameters({"kv_cache_dtype": "int8"})
    with pytest.raises(ConfigError, match="greedy_screen must be one of"):
        EngineConfig.from_parameters(greedy_screen="fp8")


@pytest.mark.parametrize("given,kept", [("auto", "auto"), ("int8", "int8"), ("BFloat16", "bfloat16"), ("on", "true"),
                                        (True, "true"), ("0", "false"), (False, "false")])
def test_greedy_screen_takes_a_kind_or_a_boolean(given, kept):
    assert EngineConfig.from_parameters(greedy_screen=given).cpu.greedy_screen == kept


def test_retired_parameters_load_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tritonllm.core.config"):
        config = EngineConfig.from_parameters({"amx_gemm": "true", "seed": "3", "max_num_seqs": "4"})
    assert config.scheduler.max_num_seqs == 4
    assert "'amx_gemm' is ignored" in caplog.text and "'seed' is ignored" in caplog.text


def test_docs_list_every_parameter_under_its_group():
    """docs/CONFIG.md has a row for each parameter, in the section of its group, and each retired one."""
    text = DOCS.read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for name, (group, field) in parameter_fields().items():
        section = sections.get(GROUP_HEADINGS[group], "")
        assert f"| `{name}` |" in section, f"{name} is not listed under '{GROUP_HEADINGS[group]}'"
    for name in RETIRED_PARAMETERS:
        assert f"`{name}`" in sections.get("Retired", ""), name
    embedding = next(body for heading, body in sections.items() if heading.startswith("Embedding model"))
    for field in dataclasses.fields(EmbeddingConfig):
        assert f"| `{field.name}` |" in embedding, field.name
