"""Shared fixtures: the prepared default model, one engine, the Hugging Face reference, a real tritonserver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from tritonllm.models.model_files import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def engine(model_dir):
    """One engine for the offline tests (tests must leave it idle: no request left running)."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.engine import Engine

    eng = Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=1024, max_model_len=2048,
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
def _session_triton_server(model_dir, tmp_path_factory):
    from tritonllm.serving.launcher import TritonServer

    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(REPO / "model_repository", log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
    server.start()
    yield server
    server.stop()


# Why the session's server stopped serving, and after which test (pytest_runtest_makereport).
_stopped_serving: dict[str, str] = {}


@pytest.fixture
def triton_server(_session_triton_server):
    """A real tritonserver on random loopback ports serving model_repository/ (smollm2), one per session.

    Once a test has left it not serving (server_watch.py), later tests fail at once with that finding
    instead of each waiting out its own timeouts.
    """
    if _stopped_serving:
        pytest.fail(f"the session's tritonserver stopped serving after {_stopped_serving['after']} "
                    "(the run's summary says why)", pytrace=False)
    return _session_triton_server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a test failed against the session's server: does the server still serve? If not, why."""
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("triton_server")
    if report.when != "call" or not report.failed or server is None or _stopped_serving:
        return
    from server_watch import diagnose

    why = diagnose(server)
    if why is not None:
        _stopped_serving.update(after=item.nodeid, why=why)
        report.sections.append(("the session's tritonserver stopped serving", why))


def pytest_terminal_summary(terminalreporter):
    """At the very end of the output (what a CI log's tail shows): the machine, and a stopped server's story."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    try:
        from tritonllm.devices.cpu import kernels as cpu_kernels

        kernels = ("CPU kernels with " + ("AVX-512" if cpu_kernels.packed_gemm_supported() else "no AVX-512") + ", "
                   + ("AVX512-BF16" if cpu_kernels.packed_gemm_bf16_supported() else "no AVX512-BF16") + ", "
                   + ("AVX512-VNNI" if cpu_kernels.int8_screen_supported() else "no AVX512-VNNI"))
    except Exception as exc:  # noqa: BLE001 - a summary line, never a failure
        kernels = f"CPU kernels not loaded ({type(exc).__name__})"
    terminalreporter.write_line(f"machine: {cpu}, {os.cpu_count()} CPUs, {kernels}")
    if _stopped_serving:
        terminalreporter.write_sep("=", f"the session's tritonserver stopped serving after {_stopped_serving['after']}")
        terminalreporter.write_line(_stopped_serving["why"])


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


@pytest.fixture(scope="session")
def minilm_server(tmp_path_factory):
    """A real tritonserver on random loopback ports serving model_repository/minilm only."""
    from tritonllm.serving.launcher import TritonServer

    log = tmp_path_factory.mktemp("triton-minilm") / "tritonserver.log"
    server = TritonServer(REPO / "model_repository", log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=minilm"])
    server.start()
    yield server
    server.stop()


def write_variant_repo(dest: Path, *, instance_count: int | None = None, **params) -> Path:
    """A model repository holding a copy of model_repository/smollm2 with some config.pbtxt parameters set.

    Parameters already in config.pbtxt get the new value; others are added. `instance_count`
    replaces the instance_group with that many KIND_CPU instances.
    """
    import re
    import shutil

    shutil.copytree(REPO / "model_repository" / "smollm2", dest / "smollm2",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = dest / "smollm2" / "config.pbtxt"
    text = config.read_text()
    if instance_count is not None:
        text, found = re.subn(r"^instance_group \[.*\]$", f"instance_group [ {{ count: {instance_count}, kind: KIND_CPU }} ]",
                              text, flags=re.M)
        assert found == 1, "config.pbtxt has no one-line instance_group to replace"
    for key, value in params.items():
        line = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        text, found = re.subn(rf'^parameters: \{{ key: "{re.escape(key)}".*$', line, text, flags=re.M)
        if not found:
            text += line + "\n"
    config.write_text(text)
    return dest


@pytest.fixture(scope="module")
def variant_server(tmp_path_factory):
    """Factory for tritonservers whose smollm2 has other config.pbtxt parameters: start(name, **params).

    start(name, instance_count=N, **params) also sets the number of KIND_CPU instances.

    One variant runs at a time: asking for another stops the one running first; asking again for
    the same one returns it. The last is stopped when the module ends. Explicit model control,
    so tests may unload and load the model.
    """
    from tritonllm.serving.launcher import TritonServer

    current: dict = {}

    def stop() -> None:
        server = current.pop("server", None)
        current.pop("key", None)
        if server is not None:
            server.stop()

    def start(name: str, instance_count: int | None = None, **params) -> TritonServer:
        key = (name, instance_count, tuple(sorted(params.items())))
        if current.get("key") == key:
            return current["server"]
        stop()
        root = tmp_path_factory.mktemp(f"variant-{name}")
        repo = write_variant_repo(root / "repo", instance_count=instance_count, **params)
        server = TritonServer(repo, log_path=root / "tritonserver.log",
                              extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
        server.start()
        current.update(key=key, server=server)
        return server

    yield start
    stop()
