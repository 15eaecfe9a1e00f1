"""Shared fixtures: the prepared default model, one engine, the Hugging Face reference, a real tritonserver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from tritonllm.model_files import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def engine(model_dir):
    """One engine for the offline tests (tests must leave it idle: no request left running)."""
    from tritonllm.config import EngineConfig
    from tritonllm.engine import Engine

    eng = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=1024, max_model_len=2048,
                              max_num_batched_tokens=512, max_num_seqs=32))
    yield eng
    assert not eng.has_unfinished()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def triton_server(model_dir, tmp_path_factory):
    """A real tritonserver on random loopback ports serving model_repository/ (smollm2)."""
    from tritonllm.server import TritonServer

    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(REPO / "model_repository", log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
    server.start()
    yield server
    server.stop()
