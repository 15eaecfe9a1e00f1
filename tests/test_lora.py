"""Multi-LoRA: adapters in PEFT's format served beside the base model, in one batch, equal to transformers + PEFT.

The adapters are made here with PEFT on the packaged model (random LoRA weights from a fixed seed, B
nonzero; ranks 8 and 16; q, k, v, o, gate, up and down), saved with `save_pretrained` into a temporary
folder. The reference is PEFT's `PeftModel` over transformers' model, greedy, one prompt at a time.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time

import numpy as np
import pytest
import torch

from greedy_reference import transformers_greedy
from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from tritonllm.core.config import EngineConfig, LoraConfig, SchedulerConfig
from tritonllm.core.parameters import ConfigError
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.core.sequence import FinishReason, Sequence
from tritonllm.scheduling.block_manager import BlockManager
from tritonllm.scheduling.scheduler import Scheduler
from tritonllm.core.multi_lora import read_multi_lora
from tritonllm.serving.request_parsing import parse_request

pytestmark = pytest.mark.engine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"sql": 8, "chat": 16, "poem": 16}
MAX_NEW = 12
# Short, short, long: one paragraph of LONG_TEXT, 7 KV blocks (its six, 40 blocks, only made PEFT's reference
# forwards longer); the twelve prompts of one batch still pass a step's 512 tokens, so one is split between steps.
PROMPTS = [CHAT_PROMPTS[0], PLAIN_PROMPTS[0], LONG_TEXT[:len(LONG_TEXT) // 6] + "In short,"]


def _save_adapters(model_dir, folder) -> dict[str, str]:
    """name -> folder of each adapter, made with PEFT on fresh copies of the packaged model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(1000 + seed)
        # init_lora_weights=False: B random too (PEFT's default zero B would make the adapter the base model).
        peft = get_peft_model(base, PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                   init_lora_weights=False))
        folders[name] = str(folder / name)
        peft.save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, str]:
    return _save_adapters(model_dir, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def lora_engine(model_dir, adapters):
    from tritonllm.engine.engine import Engine

    config = EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=256, max_num_seqs=16, warmup=False,
                                          max_loras=3)
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, adapters=tuple(adapters.items())))
    engine = Engine(config)
    yield engine
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    tok = hf_tokenizer
    chat = list(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))
    return [chat] + [tok.encode(p) for p in PROMPTS[1:]]


@pytest.fixture(scope="module")
def reference(model_dir, adapters, prompt_ids, hf_tokenizer, lora_engine) -> dict[tuple[str | None, int], tuple[list[int], list[float]]]:
    """(adapter or None, prompt index) -> greedy ids and their log-probs from transformers + PeftModel, checked
    from the engine's output for each request alone (greedy_reference.py)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    # The engine's end tokens: the model config's, the tokenizer's and the generation config's.
    eos = sorted({base.config.eos_token_id, hf_tokenizer.eos_token_id, base.generation_config.eos_token_id} - {None})

    def generate(ids, name):
        [out] = lora_engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=MAX_NEW, lora_name=name))
        return transformers_greedy(model, ids, out.token_ids, MAX_NEW, eos=eos)

    cases = {}
    with torch.inference_mode():
        for i, ids in enumerate(prompt_ids):
            with model.disable_adapter():
                cases[(None, i)] = generate(ids, None)
            for name in names:
                model.set_adapter(name)
                cases[(name, i)] = generate(ids, name)
    return cases


def _assert_logprobs_close(ours: list[float], ref: list[float]) -> None:
    # 0.5 %: relative for large magnitudes; in log space 0.005 is 0.5 % of the token's probability.
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 0.005 * max(1.0, abs(b)), (a, b)


def test_three_adapters_and_the_base_in_one_batch_match_peft(lora_engine, reference, prompt_ids):
    names = [None, *RANKS]
    # Every adapter changes the greedy output of some prompt: the comparison below can tell them apart.
    for name in RANKS:
        assert any(reference[(name, i)][0] != reference[(None, i)][0] for i in range(len(prompt_ids))), name
    # Interleaved: base, sql, chat, poem for each prompt, all submitted together and batched as one.
    cases = [(name, i) for i in range(len(prompt_ids)) for name in names]
    outs = lora_engine.generate(prompt_token_ids=[prompt_ids[i] for _, i in cases],
                                params=[SamplingParams(max_tokens=MAX_NEW, lora_name=name) for name, _ in cases])
    for (name, i), out in zip(cases, outs):
        ref_ids, ref_lps = reference[(name, i)]
        assert out.token_ids == ref_ids, (name, i)
        _assert_logprobs_close(out.logprobs, ref_lps)


def test_prefix_cache_is_keyed_by_adapter(lora_engine):
    # A prompt of several blocks that no other test runs: what each request finds cached is this test's doing.
    ids = lora_engine.tokenizer.encode("A preface no other test has. " + PROMPTS[2])
    assert len(ids) > 4 * lora_engine.config.cache.block_size

    def run(name):
        [out] = lora_engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=4, lora_name=name))
        return out.token_ids, out.num_cached_prompt_tokens

    chat, cached = run("chat")
    assert cached == 0
    sql, cached = run("sql")  # the same tokens under another adapter: none of "chat"'s K/V is taken
    assert cached == 0 and sql != chat
    again, cached = run("sql")  # the same adapter reuses its own blocks, with the same result
    assert cached > 0 and again == sql
    assert run(None)[1] == 0  # nor does the base model take an adapter's


def test_an_unknown_adapter_is_refused_and_the_base_still_served(lora_engine, reference, prompt_ids):
    with pytest.raises(InvalidRequestError, match="lora_name 'nope' is not an adapter of this model"):
        lora_engine.add_request(prompt_token_ids=prompt_ids[0], params=SamplingParams(lora_name="nope"))
    [out] = lora_engine.generate(prompt_token_ids=[prompt_ids[0]], params=SamplingParams(max_tokens=MAX_NEW))
    assert out.token_ids == reference[(None, 0)][0]


def test_an_adapter_above_max_lora_rank_fails_the_load_by_name(lora_engine, adapters):
    from tritonllm.models.lora_adapters import AdapterError, read_adapter

    with pytest.raises(AdapterError, match="'chat' has rank 16, above max_lora_rank 8"):
        read_adapter("chat", adapters["chat"], lora_engine.runner.model, max_rank=8)
    assert read_adapter("sql", adapters["sql"], lora_engine.runner.model, max_rank=8).rank == 8


def test_adapter_rows_take_the_cpu_decoder_stack_with_the_modules_results(lora_engine, prompt_ids):
    from torch.profiler import profile

    ops = lora_engine.runner.model.ops
    if ops.decoder_stack is None:
        pytest.skip("no C++ decoder stack on this CPU / build")
    # Base rows and three adapters' rows in every step, runs of 1 to 5 rows, prompts and decodes.
    names = [None, "poem", "sql", "sql", "chat", "chat", "chat", "chat", "chat", "poem"]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, lora_name=name) for name in names]
    prompts = [prompt_ids[i % len(prompt_ids)] for i in range(len(names))]

    def run() -> tuple[list, int]:
        with profile() as prof:
            outs = lora_engine.generate(prompt_token_ids=prompts, params=params)
        calls = sum(event.count for event in prof.key_averages() if event.key == "tritonllm::decoder_stack")
        return [(o.token_ids, o.logprobs) for o in outs], calls

    with_stack, calls = run()
    assert calls > 0
    stack, ops.decoder_stack = ops.decoder_stack, None
    try:
        layer_by_layer, calls = run()
    finally:
        ops.decoder_stack = stack
    assert calls == 0
    # The stack adds each linear's deltas with the kernel the modules' op calls, in the same order: the same bits.
    assert with_stack == layer_by_layer


# ---- no model loaded -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    bm = BlockManager(64, 16)
    scheduler = Scheduler(bm, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), 512, max_loras=2)
    seqs = [Sequence(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(lora_name=name))
            for i, name in enumerate(["a", "b", "c", None, "a"])]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    running = [item.seq.request_id for item in out.scheduled]
    assert running == ["r0", "r1", "r3", "r4"]  # "c" waits: "a" and "b" hold both slots; base rows pass it
    scheduler.commit(out)
    for item in out.scheduled:
        item.seq.append_token(7, 0.0)
    scheduler.finish(seqs[1], FinishReason.STOP)  # "b" ends: "c" takes its slot
    assert [item.seq.request_id for item in scheduler.schedule().scheduled if item.num_new_tokens > 1] == ["r2"]


@pytest.mark.unit
def test_lora_limits_and_multi_lora_json_fail_the_load_by_name(tmp_path):
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig.from_parameters({"max_loras": "4", "max_cpu_loras": "2"})
    with pytest.raises(ConfigError, match="max_lora_rank must be positive"):
        EngineConfig.from_parameters({"max_lora_rank": "0"})
    with pytest.raises(ConfigError, match="parameter 'max_loras' must be an integer"):
        EngineConfig.from_parameters({"max_loras": "two"})
    assert not EngineConfig().lora.enabled and LoraConfig(adapters=(("a", "/x"),)).enabled
    assert read_multi_lora(tmp_path) == ()  # no file: LoRA off
    (tmp_path / "loras" / "a").mkdir(parents=True)
    (tmp_path / "multi_lora.json").write_text(json.dumps({"a": "loras/a"}))
    assert read_multi_lora(tmp_path) == (("a", str((tmp_path / "loras" / "a").resolve())),)
    (tmp_path / "multi_lora.json").write_text(json.dumps({"a": "loras/a", "b": "loras/missing"}))
    with pytest.raises(ConfigError, match="adapter 'b': folder .* does not exist"):
        read_multi_lora(tmp_path)
    (tmp_path / "multi_lora.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_multi_lora(tmp_path)


@pytest.mark.unit
def test_lora_name_is_read_from_sampling_parameters_as_the_vllm_backend_sends_it():
    def parse(sampling: dict, names=()):
        arrays = {"text_input": np.array([b"hi"], dtype=np.object_),
                  "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}
        return parse_request(arrays, None, names)

    assert parse({"lora_name": "sql"}, ("sql", "chat")).params.lora_name == "sql"
    assert parse({}, ("sql",)).params.lora_name is None
    with pytest.raises(InvalidRequestError, match=re.escape("LoRA nope is not supported, we currently support ['")):
        parse({"lora_name": "nope"}, ("sql", "chat"))
    with pytest.raises(InvalidRequestError, match=r"^LoRA feature is not enabled\.$"):
        parse({"lora_name": "sql"})


# ---- through tritonserver ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    """smollm2's config in a model repository of its own, with multi_lora.json naming the adapters by
    folders relative to the model's folder (as the vLLM backend reads them)."""
    from conftest import REPO
    from tritonserver_harness import TritonServer

    root = tmp_path_factory.mktemp("lora_repo")
    model = root / "repo" / "smollm2"
    (model / "1").mkdir(parents=True)
    shutil.copy(REPO / "model_repository" / "smollm2" / "1" / "model.py", model / "1" / "model.py")
    config = (REPO / "model_repository" / "smollm2" / "config.pbtxt").read_text()
    # No exact blocks: a quicker load (it loads twice), the same ids (the reference's come from lora_engine, which reads them).
    for key, value in (("num_kv_blocks", "256"), ("warmup", "false"), ("max_loras", "3"), ("exact_block_weights", "false")):
        config += f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'
    (model / "config.pbtxt").write_text(config)
    for name, folder in adapters.items():
        shutil.copytree(folder, model / "loras" / name)
    (model / "multi_lora.json").write_text(json.dumps({name: f"loras/{name}" for name in adapters}))
    server = TritonServer(root / "repo", log_path=root / "tritonserver.log", startup_timeout=300,
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
    server.start()
    yield server, model
    server.stop_later()


@pytest.mark.server
def test_lora_name_through_tritonserver_as_the_vllm_backend_sends_it(lora_server, reference, prompt_ids):
    from grpc_stream import StreamClient, make_inputs

    server, _ = lora_server
    client = StreamClient(server.grpc_url)
    for name in (None, *RANKS):
        sampling = {"max_tokens": MAX_NEW, **({"lora_name": name} if name else {})}
        client.send(str(name), make_inputs(input_ids=prompt_ids[1], sampling=sampling))
    got = client.wait(timeout=300)
    client.close()
    for name in (None, *RANKS):
        assert got[str(name)].ids == reference[(name, 1)][0], name
    alone = StreamClient(server.grpc_url)  # an error names no request: one stream for it
    alone.send("unknown", make_inputs(input_ids=prompt_ids[1], sampling={"max_tokens": 4, "lora_name": "nope"}))
    refused = alone.wait(timeout=60)["unknown"]
    alone.close()
    assert refused.error and "LoRA nope is not supported, we currently support [" in refused.error
    after = StreamClient(server.grpc_url)
    after.send("base", make_inputs(input_ids=prompt_ids[1], sampling={"max_tokens": MAX_NEW}))
    assert after.wait(timeout=120)["base"].ids == reference[(None, 1)][0]
    after.close()


@pytest.mark.server
def test_vllm_lora_requests_info_names_the_adapters(lora_server):
    from grpc_stream import StreamClient, make_inputs, scrape

    server, _ = lora_server
    client = StreamClient(server.grpc_url)
    client.send("poem", make_inputs("Hello", sampling={"max_tokens": 200, "ignore_eos": True, "lora_name": "poem"}))
    samples = {}
    deadline = time.monotonic() + 30
    while not any('running_lora_adapters="poem"' in key for key in samples):  # gauges refresh twice a second
        assert time.monotonic() < deadline, [k for k in samples if "lora" in k]
        samples = scrape(server.metrics_url)
    client.close(cancel=True)  # seen running: the rest of its 200 tokens shows nothing more
    series = [key for key in samples if key.startswith("vllm:lora_requests_info{")]
    assert series and all('max_lora="3"' in key and "waiting_lora_adapters=" in key for key in series)


@pytest.mark.server
def test_the_openai_api_lists_adapters_with_their_parent_and_serves_them_by_model(lora_server, reference, prompt_ids,
                                                                                   hf_tokenizer):
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    server, model = lora_server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = subprocess.Popen([sys.executable, "-m", "tritonllm.openai", "--triton-url", server.grpc_url, "--port",
                              str(port), "--model-repository", str(model.parent)], stdin=subprocess.DEVNULL)

    def call(path, body=None):
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else
                                         json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                status, listed = call("/v1/models")
                if status == 200 and "smollm2" in {card["id"] for card in listed["data"]}:
                    break
            except OSError:  # not listening yet
                pass
            assert time.monotonic() < deadline and front.poll() is None, "the OpenAI front did not start"
            time.sleep(0.5)
        cards = {card["id"]: card for card in listed["data"]}
        assert cards["smollm2"].get("parent") is None
        assert all(cards[name]["parent"] == "smollm2" for name in RANKS)
        for name in ("smollm2", "chat"):
            status, body = call("/v1/completions", {"model": name, "prompt": prompt_ids[1], "max_tokens": MAX_NEW,
                                                    "temperature": 0})
            assert status == 200 and body["model"] == name
            # The text of the reference's tokens: what the adapter (or the base model) generates.
            ref_ids = reference[("chat" if name == "chat" else None, 1)][0]
            assert body["choices"][0]["text"] == hf_tokenizer.decode(ref_ids, skip_special_tokens=True)
        status, body = call("/v1/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 2})
        assert status == 404 and "nope" in body["error"]["message"]
    finally:
        front.terminate()
        front.wait(timeout=30)


@pytest.mark.server
def test_a_model_control_load_reads_multi_lora_json_again(lora_server, reference, prompt_ids):
    # Last of the module: it replaces the served instance.
    import tritonclient.http as httpclient
    from grpc_stream import StreamClient, make_inputs

    server, model = lora_server
    # A new adapter name for the "sql" weights, added to multi_lora.json; then Triton's load with a config.
    shutil.copytree(model / "loras" / "sql", model / "loras" / "sql2")
    entries = json.loads((model / "multi_lora.json").read_text())
    (model / "multi_lora.json").write_text(json.dumps({**entries, "sql2": "loras/sql2"}))
    # The load answers once the new instance is ready: model load time on a busy machine, not 60 s.
    client = httpclient.InferenceServerClient(server.http_url, connection_timeout=600, network_timeout=600)
    config = client.get_model_config("smollm2")
    client.load_model("smollm2", config=json.dumps(config))
    assert client.is_model_ready("smollm2")
    client.close()
    stream = StreamClient(server.grpc_url)
    stream.send("sql2", make_inputs(input_ids=prompt_ids[1], sampling={"max_tokens": MAX_NEW, "lora_name": "sql2"}))
    assert stream.wait(timeout=300)["sql2"].ids == reference[("sql", 1)][0]
    stream.close()
