"""Shared fixtures: the prepared default model, one engine, the Hugging Face reference, a real tritonserver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# ---- Test tiers (pytest -m unit|engine|server|device; docs/ARCHITECTURE.md, "Tests") -------------
#
# Every test is in exactly one tier, lightest to heaviest:
#   unit    no model loaded, no server started: seconds
#   engine  loads a real model (or a tiny random one) in-process; no tritonserver
#   server  starts a real tritonserver (or tritonllm-serve, or the OpenAI front)
#   device  needs a GPU or an Ascend NPU; skipped where there is none
# A test's tier is the nearest tier marker (the test's own, else its class's, else the module's
# `pytestmark`), raised to what its fixtures need: a test that uses a fixture of SERVER_FIXTURES is
# at least `server`, one that uses a fixture of ENGINE_FIXTURES (directly or through another fixture)
# is at least `engine`. So each module states its default tier in one `pytestmark` line, and a test
# that needs more than its fixtures show (an Engine or a TritonServer built in its body) carries its
# own marker. A test with no tier at all stops the collection.
TIERS = ("unit", "engine", "server", "device")  # lightest first
SERVER_FIXTURES = frozenset({"_session_triton_server", "triton_server", "minilm_server", "variant_server"})
ENGINE_FIXTURES = frozenset({"model_dir", "engine", "hf_model", "tokenizer", "st_model"})


def _tier(item) -> str | None:
    nearest = next((mark.name for mark in item.iter_markers() if mark.name in TIERS), None)
    fixtures = set(getattr(item, "fixturenames", ()))
    needed = "server" if fixtures & SERVER_FIXTURES else "engine" if fixtures & ENGINE_FIXTURES else None
    if nearest is None:
        return needed
    return nearest if needed is None else max(nearest, needed, key=TIERS.index)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers
def pytest_collection_modifyitems(config, items):
    """Give each test exactly one tier marker (see TIERS above); fail the collection where a test has none."""
    tiers = {item: _tier(item) for item in items}
    untiered = [item.nodeid for item, tier in tiers.items() if tier is None]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) have no tier: give the module a `pytestmark = pytest.mark.<tier>` line "
            f"(tiers: {', '.join(TIERS)}; tests/conftest.py):\n  " + "\n  ".join(untiered[:20]))
    # A module's (or class's) marker is only a default: move it onto the items, so that `-m unit` never
    # selects a test of that module whose own marker or fixtures put it in another tier.
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
    no_device = None
    for item, tier in tiers.items():
        item.add_marker(tier)
        if tier == "device":
            if no_device is None:
                no_device = not _has_accelerator()
            if no_device:
                item.add_marker(pytest.mark.skip(reason="no GPU or NPU on this machine (a `device` tier test)"))


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from tritonllm.models.model_files import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def engine(model_dir):
    """One engine for the offline tests (tests must leave it idle: no request left running)."""
    from tritonllm.core.config import EngineConfig
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
def st_model():
    """sentence-transformers' model of the default embedding model: the embedding tests' reference."""
    from sentence_reference import load_sentence_transformer

    return load_sentence_transformer()


@pytest.fixture(scope="session")
def _session_triton_server(model_dir, tmp_path_factory):
    from tritonserver_harness import TritonServer

    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(REPO / "model_repository", log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
    server.start()
    yield server
    server.stop_later()


@pytest.fixture(scope="session")
def openai_tools_server(_session_triton_server, tmp_path_factory):
    """Our OpenAI server with the shipped tool template, the hermes parser and the qwen3 reasoning parser
    (as vLLM serves Qwen3), beside the session's tritonserver (smollm2): the tool call, Responses API and
    reasoning tests' (test_openai_tools.py, test_openai_responses.py, test_openai_reasoning.py)."""
    from openai_front import openai_front

    log = tmp_path_factory.mktemp("openai-tools") / "openai.log"
    with openai_front(_session_triton_server.grpc_url, log, "--chat-template", "chatml_hermes_tools",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                      ready_path="/v1/models", ready_text="smollm2") as base:
        yield base


@pytest.fixture(scope="session")
def openai_tools_client(openai_tools_server):
    import openai

    return openai.OpenAI(base_url=f"{openai_tools_server}/v1", api_key="unused", timeout=600, max_retries=0)


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


def pytest_sessionfinish(session, exitstatus):
    """Wait for the servers that fixtures stopped without waiting (TritonServer.stop_later)."""
    import sys

    harness = sys.modules.get("tritonserver_harness")
    if harness is not None:
        harness.wait_for_stopped()


def pytest_terminal_summary(terminalreporter):
    """At the very end of the output (what a CI log's tail shows): the machine, and a stopped server's story."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    try:
        from tritonllm.devices.cpu import kernels as cpu_kernels

        if cpu_kernels.load():
            kernels = (f"CPU kernels variant {cpu_kernels.variant()} with "
                       + ("packed GEMM" if cpu_kernels.packed_gemm_supported() else "no packed GEMM") + ", "
                       + ("BF16 GEMM" if cpu_kernels.packed_gemm_bf16_supported() else "no BF16 GEMM") + ", "
                       + (f"8-bit screen on {cpu_kernels.int8_screen_instructions()}"
                          if cpu_kernels.int8_screen_supported() else "no 8-bit screen"))
        else:
            kernels = f"CPU kernels variant {cpu_kernels.variant()} not built ({cpu_kernels.error()})"
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
    from tritonserver_harness import TritonServer

    log = tmp_path_factory.mktemp("triton-minilm") / "tritonserver.log"
    server = TritonServer(REPO / "model_repository", log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=minilm"])
    server.start()
    yield server
    server.stop_later()


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
    from tritonserver_harness import TritonServer

    current: dict = {}

    def stop() -> None:
        server = current.pop("server", None)
        current.pop("key", None)
        if server is not None:
            server.stop_later()

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
