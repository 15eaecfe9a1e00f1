"""The models declare their inputs and outputs (auto_complete_config): a config.pbtxt that lists none,
one that lists them all (written before), and one that lists some all serve the same tensors."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from conftest import REPO, write_variant_repo
from grpc_stream import StreamClient, make_inputs
from tritonllm.serving.tritonserver_process import find_pytriton
from tritonserver_harness import TritonServer
from tritonllm.serving.model_io import EMBEDDING_INPUTS, GENERATE_INPUTS, GENERATE_OUTPUTS, complete_config

pytestmark = pytest.mark.unit

# The tensors as config.pbtxt listed them before the models declared them: what Triton must still serve,
# and what a repository written then still holds.
LEGACY_SMOLLM2 = """
max_batch_size: 0  # the engine batches continuously across requests itself
model_transaction_policy { decoupled: true }

input [
  { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ], optional: true },
  { name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "exclude_input_in_output", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "apply_chat_template", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_finish_reason", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_input_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_num_output_tokens", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_logprobs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "return_cumulative_logprob", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }
]
output [
  { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "output_log_probs", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "logprobs", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "finish_reason", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "num_input_tokens", data_type: TYPE_UINT32, dims: [ 1 ] },
  { name: "num_output_tokens", data_type: TYPE_UINT32, dims: [ -1 ] },
  { name: "cumulative_logprob", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "prompt_logprobs", data_type: TYPE_STRING, dims: [ 1 ] }
]
"""
LEGACY_MINILM = """
max_batch_size: 0  # the engine batches across requests itself (no Triton dynamic batching)

input [
  { name: "text_input", data_type: TYPE_STRING, dims: [ -1 ], optional: true },  # one or many texts
  { name: "normalize", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }  # default: parameter normalize
]
output [
  { name: "embedding", data_type: TYPE_FP32, dims: [ -1, 384 ] }
]
"""
EMBED_TEXTS = ["A man is eating food.", "The girl is carrying a baby."]


def _parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _tensors(config: model_config_pb2.ModelConfig) -> tuple[dict, dict]:
    """({input: (type, dims, optional)}, {output: (type, dims)}), types by their TYPE_* names."""
    name = model_config_pb2.DataType.Name
    return ({t.name: (name(t.data_type), list(t.dims), t.optional) for t in config.input},
            {t.name: (name(t.data_type), list(t.dims)) for t in config.output})


def _served(server: TritonServer, model: str) -> model_config_pb2.ModelConfig:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return client.get_model_config(model).config


def _with_legacy_block(config: Path, block: str) -> None:
    """Put the old tensor block into config.pbtxt right after its backend line, as it stood before."""
    text = config.read_text()
    assert text.count('backend: "python"\n') == 1
    config.write_text(text.replace('backend: "python"\n', 'backend: "python"\n' + block))


def _embed(server: TritonServer, texts: list[str]) -> np.ndarray:
    array = np.array([t.encode() for t in texts], dtype=object)
    text_input = grpcclient.InferInput("text_input", [len(texts)], "BYTES")
    text_input.set_data_from_numpy(array)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return client.infer("minilm", [text_input], client_timeout=120).as_numpy("embedding")


# ---- the shipped configs on a real tritonserver ---------------------------------------------------

@pytest.mark.server
def test_served_smollm2_config_has_every_tensor_config_pbtxt_no_longer_lists(triton_server):
    assert not _parse((REPO / "model_repository" / "smollm2" / "config.pbtxt").read_text()).input
    served = _served(triton_server, "smollm2")
    assert _tensors(served) == _tensors(_parse(LEGACY_SMOLLM2))
    assert served.model_transaction_policy.decoupled and served.max_batch_size == 0


@pytest.mark.server
def test_served_minilm_config_has_every_tensor_and_the_embedding_size(minilm_server):
    assert not _parse((REPO / "model_repository" / "minilm" / "config.pbtxt").read_text()).input
    served = _served(minilm_server, "minilm")
    assert _tensors(served) == _tensors(_parse(LEGACY_MINILM))  # embedding [-1, 384] as before
    assert not served.model_transaction_policy.decoupled and served.max_batch_size == 0
    assert _embed(minilm_server, EMBED_TEXTS).shape == (2, 384)


# ---- a repository written before: config.pbtxt lists the tensors itself -------------------------

@pytest.fixture(scope="module")
def legacy_server(tmp_path_factory):
    """Both models, their config.pbtxt holding the old tensor block (small smollm2 limits: a fast start)."""
    root = tmp_path_factory.mktemp("legacy")
    repo = write_variant_repo(root / "repo", warmup="false", exact_block_weights="false", num_kv_blocks=128,
                              max_model_len=512)
    _with_legacy_block(repo / "smollm2" / "config.pbtxt", LEGACY_SMOLLM2)
    shutil.copytree(REPO / "model_repository" / "minilm", repo / "minilm", ignore=shutil.ignore_patterns("__pycache__"))
    _with_legacy_block(repo / "minilm" / "config.pbtxt", LEGACY_MINILM)
    server = TritonServer(repo, log_path=root / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2", "--load-model=minilm"])
    server.start()
    yield server
    server.stop_later()


@pytest.mark.server
def test_a_config_listing_the_tensors_still_loads_and_serves(legacy_server):
    assert _tensors(_served(legacy_server, "smollm2")) == _tensors(_parse(LEGACY_SMOLLM2))
    assert _tensors(_served(legacy_server, "minilm")) == _tensors(_parse(LEGACY_MINILM))
    client = StreamClient(legacy_server.grpc_url)
    try:
        client.send("a", make_inputs("Paris is a city in", stream=True, sampling={"max_tokens": 6, "ignore_eos": True}))
        got = client.wait(["a"])["a"]
    finally:
        client.close()
    assert got.error is None and got.final and len(got.ids) == 6 and got.finish_reason == "length"
    assert _embed(legacy_server, EMBED_TEXTS).shape == (2, 384)


# ---- tritonserver without auto-complete --------------------------------------------------------

@pytest.mark.server
def test_without_auto_complete_a_config_listing_no_tensors_fails_clearly(tmp_path):
    """--disable-auto-complete-config: Triton would load the model without inputs and refuse every request."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "model_repository" / "smollm2", repo / "smollm2", ignore=shutil.ignore_patterns("__pycache__"))
    server = TritonServer(repo, log_path=tmp_path / "log", startup_timeout=120,
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2",
                                      "--disable-auto-complete-config"])
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    assert "config.pbtxt lists no inputs and Triton did not add them" in server.log_text()


# ---- complete_config with the Python backend's own ModelConfig (no server) ----------------------

def _backend_utils():
    """triton_python_backend_utils from the tritonserver wheel: the ModelConfig auto_complete_config gets."""
    path = find_pytriton() / "tritonserver" / "backends" / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_config(**fields):
    """A ModelConfig holding what Triton passes for a config.pbtxt that sets `fields` (JSON as Triton writes it)."""
    import json

    return _backend_utils().ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [], "output": [],
                                                    **fields}))


def test_complete_config_adds_only_what_config_pbtxt_leaves_out():
    listed = {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": False}  # the user's choice
    config = complete_config(_model_config(input=[listed]), GENERATE_INPUTS, GENERATE_OUTPUTS, decoupled=True).as_dict()
    assert [t["name"] for t in config["input"]] == ["input_ids"] + [s.name for s in GENERATE_INPUTS if s.name != "input_ids"]
    assert config["input"][0] == listed
    assert [t["name"] for t in config["output"]] == [s.name for s in GENERATE_OUTPUTS]
    assert config["model_transaction_policy"] == {"decoupled": True} and config["max_batch_size"] == 0


def test_complete_config_keeps_an_explicit_transaction_policy():
    config = _model_config(model_transaction_policy={"decoupled": False})
    assert complete_config(config, GENERATE_INPUTS, GENERATE_OUTPUTS, decoupled=True).as_dict()[
        "model_transaction_policy"] == {"decoupled": False}  # initialize then says the model streams
    embedding = complete_config(_model_config(), EMBEDDING_INPUTS, ()).as_dict()
    assert "model_transaction_policy" not in embedding  # Triton's default: not decoupled


def test_complete_config_refuses_tritons_batching():
    with pytest.raises(ValueError, match="max_batch_size 8 asks for Triton's batching"):
        complete_config(_model_config(max_batch_size=8), GENERATE_INPUTS, GENERATE_OUTPUTS, decoupled=True)


# ---- the shipped config files --------------------------------------------------------------------

DEVICE_PARAMETERS = {"device", "dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_fraction",
                     "block_size"}  # torch_npu's paged attention takes blocks of 128 to 512 tokens
CPU_ONLY_PARAMETERS = {"cpu_gemm", "exact_block_weights", "greedy_screen"}
DEVICE_ONLY_PARAMETERS = {"cuda": {"cuda_attention", "cuda_graphs"}, "npu": {"npu_attention"}}


@pytest.mark.parametrize("variant", ["cuda", "npu"])
def test_device_configs_differ_from_the_cpu_one_only_where_the_device_must(variant):
    cpu = _parse((REPO / "model_repository" / "smollm2" / "config.pbtxt").read_text())
    other = _parse((REPO / "model_repository" / "smollm2" / "configs" / f"{variant}.pbtxt").read_text())
    assert not (other.input or other.output or other.max_batch_size or other.HasField("model_transaction_policy"))
    cpu_params = {k: v.string_value for k, v in cpu.parameters.items()}
    params = {k: v.string_value for k, v in other.parameters.items()}
    assert set(params) - DEVICE_ONLY_PARAMETERS[variant] == set(cpu_params) - CPU_ONLY_PARAMETERS
    assert {k for k in params if k in cpu_params and params[k] != cpu_params[k]} <= DEVICE_PARAMETERS
    assert other.backend == cpu.backend and other.instance_group[0].kind != cpu.instance_group[0].kind
