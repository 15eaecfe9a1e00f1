"""Our system under test: a real tritonserver serving a copy of model_repository/smollm2.

The copy lets the benchmark set config.pbtxt parameters (the torch thread count, and any
`--ours-param key=value` such as scheduling_policy) without touching the repository. The replay
is client/bench.py's `run_bench`, exactly what `tritonllm-client bench` runs.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from tritonllm_client.stream import GenerationParams, StreamingClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the tests' tritonserver harness and metrics scraping, shared with the benchmarks
from grpc_stream import metric, scrape  # noqa: E402
from tritonserver_harness import TritonServer  # noqa: E402
MODEL_NAME = "smollm2"


def _parameter_entry(key: str) -> re.Pattern:
    """One `parameters: { key: ..., value: { string_value: ... } }` entry of config.pbtxt; group 1 is its value."""
    return re.compile(r'parameters:\s*\{\s*key:\s*"' + re.escape(key)
                      + r'"\s*,?\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Set one `parameters: { key: ..., value: { string_value: ... } }` entry, adding it if absent."""
    pattern = _parameter_entry(key)
    entry = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    if pattern.search(config_text):
        return pattern.sub(lambda _: entry, config_text, count=1)
    return config_text.rstrip("\n") + "\n" + entry + "\n"


def config_parameter(config: str, key: str) -> str | None:
    """A string parameter of model_repository/smollm2/`config` (e.g. "configs/cuda.pbtxt"), or None."""
    found = _parameter_entry(key).search((REPO / "model_repository" / MODEL_NAME / config).read_text())
    return found.group(1) if found else None


def prepare_repository(dest: Path, params: dict[str, str], config_name: str | None = None) -> Path:
    """Copy model_repository/smollm2 into `dest` with `params` set in its config.pbtxt; returns `dest`.
    `config_name`: the variant configs/<name>.pbtxt (e.g. cuda) becomes its config.pbtxt."""
    if (dest / MODEL_NAME).exists():
        shutil.rmtree(dest / MODEL_NAME)
    shutil.copytree(REPO / "model_repository" / MODEL_NAME, dest / MODEL_NAME,
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = dest / MODEL_NAME / "config.pbtxt"
    if config_name:
        shutil.copyfile(dest / MODEL_NAME / "configs" / f"{config_name}.pbtxt", config)
    text = config.read_text()
    for key, value in params.items():
        text = set_parameter(text, key, value)
    config.write_text(text)
    return dest


STEP_PHASES = ("schedule", "inputs", "launch", "wait", "apply")


def engine_steps(metrics_url: str) -> dict[str, float]:
    """The server's engine step counters (llm_engine_steps_total, llm_engine_step_seconds_total by phase)."""
    samples = scrape(metrics_url)
    return {"steps": metric(samples, "llm_engine_steps_total"),
            **{phase: metric(samples, "llm_engine_step_seconds_total", phase=phase) for phase in STEP_PHASES}}


def step_breakdown(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """The engine thread's steps between two `engine_steps` readings, over a run of `seconds`."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return ""
    per_step = {p: 1000 * (after[p] - before[p]) / steps for p in STEP_PHASES}
    return (f"engine steps: {steps:.0f}, {1000 * seconds / steps:.2f} ms of the run each; on the engine thread per step "
            + ", ".join(f"{p} {ms:.2f}" for p, ms in per_step.items()) + f" ms (sum {sum(per_step.values()):.2f})")


@contextlib.contextmanager
def our_server(work_dir: Path, params: dict[str, str], startup_timeout_s: float = 600.0,
               config_name: str | None = None) -> Iterator[tuple[TritonServer, float]]:
    """Start tritonserver on free loopback ports; yields (server, start-to-ready seconds).

    Start to ready = from launching the process to the first request answered (one token),
    with the default model already prepared (converted to safetensors) beforehand.
    """
    repo = prepare_repository(work_dir / "model_repository", params, config_name)
    server = TritonServer(repo, log_path=work_dir / "tritonserver.log", startup_timeout=startup_timeout_s,
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL_NAME}"])
    started = time.perf_counter()
    with server:
        with StreamingClient(server.grpc_url, MODEL_NAME) as client:
            first = client.generate("Hello!", GenerationParams(max_tokens=1), timeout_s=120)
        if not first.ok:
            raise RuntimeError(f"first request failed: {first.error}")
        yield server, time.perf_counter() - started
