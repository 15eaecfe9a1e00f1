"""A model whose config.pbtxt asks for something impossible fails its load with a clear message."""

from __future__ import annotations

import shutil

import pytest

from tritonserver_harness import TritonServer

pytestmark = pytest.mark.server

REPO_MODEL = __import__("pathlib").Path(__file__).resolve().parent.parent / "model_repository" / "smollm2"


def _load_failure(tmp_path, config_text: str | None = None, config_name: str | None = None) -> str:
    repo = tmp_path / "repo"
    shutil.copytree(REPO_MODEL, repo / "smollm2")
    if config_text is not None:
        (repo / "smollm2" / "config.pbtxt").write_text(config_text)
    extra = ["--model-control-mode=explicit", "--load-model=smollm2"]
    if config_name:
        extra.append(f"--model-config-name={config_name}")
    server = TritonServer(repo, extra_args=extra, log_path=tmp_path / "log", startup_timeout=120)
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    return server.log_text()


def test_unknown_parameter_is_named(tmp_path):
    text = (REPO_MODEL / "config.pbtxt").read_text() + 'parameters: { key: "max_num_seqz", value: { string_value: "4" } }\n'
    assert "unknown parameter 'max_num_seqz'" in _load_failure(tmp_path, text)


def test_malformed_parameter_is_named(tmp_path):
    text = (REPO_MODEL / "config.pbtxt").read_text().replace(
        '"max_num_seqs", value: { string_value: "64" }', '"max_num_seqs", value: { string_value: "sixty" }')
    assert "parameter 'max_num_seqs' must be an integer" in _load_failure(tmp_path, text)


def test_missing_npu_fails_the_npu_config_clearly(tmp_path):
    log = _load_failure(tmp_path, config_name="npu")
    assert "torch_npu / an Ascend NPU is not available" in log
