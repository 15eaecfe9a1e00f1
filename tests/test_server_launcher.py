"""The launcher starts a real tritonserver that serves a decoupled Python-backend model on loopback.

The model here is a tiny upper-casing echo: it tests the launcher (backend directory, stub,
environment, ports, stop), not our engine.
"""

from __future__ import annotations

import queue
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tritonllm.serving import launcher as server_module
from tritonllm.serving.tritonserver_process import build_command, find_pytriton
from tritonserver_harness import TritonServer

pytestmark = pytest.mark.server

CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            upper = np.array([t.decode().upper().encode() for t in text.reshape(-1)], dtype=np.object_)
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", upper)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    try:
        find_pytriton()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    repo = tmp_path_factory.mktemp("model_repository")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    (repo / "echo" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    with TritonServer(repo, startup_timeout=120) as srv:
        yield srv


@pytest.mark.unit
def test_build_command_binds_loopback_by_default(tmp_path):
    cmd = build_command(tmp_path, 1, 2, 3)
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in cmd
    assert cmd[0].endswith("tritonserver")
    assert build_command(tmp_path, 1, 2, 3, extra_args=["--x=1"])[-1] == "--x=1"


@pytest.mark.unit
def test_main_without_supervision_execs_tritonserver_with_passthrough_args(tmp_path, monkeypatch, capsys):
    try:
        find_pytriton()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    calls = []
    monkeypatch.setattr(server_module, "check_numpy", lambda: None)
    monkeypatch.setattr(server_module.os, "execvpe", lambda *a: calls.append(a))
    monkeypatch.setenv("TRITONLLM_BACKEND_DIR", str(tmp_path / "backends"))
    server_module.main(["--model-repository", str(tmp_path), "--no-prepare", "--no-supervise", "--http-port", "9000",
                        "--exit-timeout-secs=5", "--", "--log-info=true"])
    (file, cmd, env), = calls
    assert file == cmd[0] and cmd[0].endswith("tritonserver")
    assert "--http-port=9000" in cmd and "--http-address=127.0.0.1" in cmd
    assert cmd[-2:] == ["--exit-timeout-secs=5", "--log-info=true"]
    assert (tmp_path / "backends" / "python" / "triton_python_backend_stub").is_file()
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert "generate_stream" in capsys.readouterr().out


@pytest.mark.unit
def test_the_openai_servers_options_go_to_it_not_to_tritonserver(tmp_path, monkeypatch):
    try:
        find_pytriton()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    from tritonllm.openai import child_process as openai_server

    started, calls = [], []
    monkeypatch.setattr(server_module, "check_numpy", lambda: None)
    monkeypatch.setattr(server_module.os, "execvpe", lambda *a: calls.append(a))
    monkeypatch.setattr(openai_server, "start_server", lambda *a, **kw: started.append((a, kw)))
    monkeypatch.setenv("TRITONLLM_BACKEND_DIR", str(tmp_path / "backends"))
    server_module.main(["--model-repository", str(tmp_path), "--no-prepare", "--no-supervise", "--openai-port", "9100",
                        "--chat-template", "chatml_hermes_tools", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes"])
    (_, cmd, _), = calls
    (args, kwargs), = started
    assert args[2] == 9100
    assert kwargs["extra_args"] == ["--chat-template", "chatml_hermes_tools", "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes"]
    assert not any("tool" in c or "chat-template" in c for c in cmd)


def test_decoupled_echo_streams_over_grpc(server):
    import tritonclient.grpc as grpcclient

    assert server.is_model_ready("echo")
    assert not server.is_model_ready("no_such_model")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hello triton"], dtype=np.object_))
        client.async_stream_infer("echo", [text], request_id="1", enable_empty_final_response=True)
        outputs = []
        for _ in range(10):  # bounded: one data response, then the empty final one
            result, error = responses.get(timeout=30)
            assert error is None, f"stream error: {error}"
            params = result.get_response().parameters
            if result.as_numpy("text_output") is not None:
                outputs += [t.decode() for t in result.as_numpy("text_output")]
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                break
        else:
            pytest.fail("no final response")
    finally:
        client.stop_stream()
        client.close()
    assert outputs == ["HELLO TRITON"]
    assert server.metrics_url.startswith("http://127.0.0.1:")


def test_start_waits_for_metrics_only_when_they_are_on(server):
    # start() also waits for the metrics port (it opens ~40 ms after HTTP reports ready, and a scrape
    # in between was refused); with metrics switched off there is nothing to wait for.
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        assert response.status == 200
    with TritonServer(server.model_repository, startup_timeout=60, extra_args=["--allow-metrics=false"]) as bare:
        assert bare.is_ready()


def test_stop_terminates_process(server):
    # Runs last in this module: it ends the shared server.
    assert server.process.poll() is None
    server.stop(timeout=30)
    assert server.process.poll() is not None
    assert not server.is_ready()
