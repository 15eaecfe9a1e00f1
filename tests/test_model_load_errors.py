"""A model whose config.pbtxt asks for something impossible fails its load with a clear message."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from tritonserver_harness import TritonServer

from tritonllm.serving.tritonserver_process import assemble_backend_dir

pytestmark = pytest.mark.server

REPO_MODEL = Path(__file__).resolve().parent.parent / "model_repository" / "smollm2"
_CONFIG = (REPO_MODEL / "config.pbtxt").read_text()

# Each test's server: (config.pbtxt text or None for the shipped one, --model-config-name or None).
CASES = {
    "test_unknown_parameter_is_named":
        (_CONFIG + 'parameters: { key: "max_num_seqz", value: { string_value: "4" } }\n', None),
    "test_malformed_parameter_is_named":
        (_CONFIG.replace('"max_num_seqs", value: { string_value: "64" }', '"max_num_seqs", value: { string_value: "sixty" }'),
         None),
    "test_missing_npu_fails_the_npu_config_clearly": (None, "npu"),
}


def _load_failure(root: Path, config_text: str | None, config_name: str | None) -> str:
    repo = root / "repo"
    shutil.copytree(REPO_MODEL, repo / "smollm2")
    if config_text is not None:
        (repo / "smollm2" / "config.pbtxt").write_text(config_text)
    extra = ["--model-control-mode=explicit", "--load-model=smollm2"]
    if config_name:
        extra.append(f"--model-config-name={config_name}")
    server = TritonServer(repo, extra_args=extra, log_path=root / "log", startup_timeout=120)
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    return server.log_text()


@pytest.fixture(scope="module")
def load_failures(request, tmp_path_factory) -> dict:
    """The server log of each selected test's failed start, the servers started side by side: each start is
    mostly one core's work (a stub's imports up to the config check)."""
    wanted = {item.originalname for item in request.session.items if item.module is request.module}
    logs: dict = {}
    assemble_backend_dir()  # once first: its copies' temporary names are per process, not per thread

    roots = {name: tmp_path_factory.mktemp(name[:30]) for name in CASES if name in wanted}  # not thread-safe

    def run(name: str) -> None:
        try:
            logs[name] = _load_failure(roots[name], *CASES[name])
        except BaseException as exc:  # noqa: BLE001 - raised again in the test that needs it
            logs[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in roots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)  # past startup_timeout and the stop's own bound
    return logs


def _log(load_failures: dict, request) -> str:
    log = load_failures[request.node.originalname]
    if isinstance(log, BaseException):
        raise log
    return log


def test_unknown_parameter_is_named(load_failures, request):
    assert "unknown parameter 'max_num_seqz'" in _log(load_failures, request)


def test_malformed_parameter_is_named(load_failures, request):
    assert "parameter 'max_num_seqs' must be an integer" in _log(load_failures, request)


def test_missing_npu_fails_the_npu_config_clearly(load_failures, request):
    assert "torch_npu / an Ascend NPU is not available" in _log(load_failures, request)
