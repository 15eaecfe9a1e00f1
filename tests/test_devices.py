"""The accelerator backends on their devices: greedy outputs against transformers on the same device,
a served stream, cancellation. Skipped, with the reason, where the device is absent;
`bash scripts/device_check.sh` runs them (and the benchmarks) on a machine that has one."""

from __future__ import annotations

import time

import pytest
import torch

from prompts import PLAIN_PROMPTS

pytestmark = pytest.mark.device


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


DEVICES = [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")),
    pytest.param("npu", marks=pytest.mark.skipif(not _npu_available(), reason="no Ascend NPU (torch_npu) on this machine")),
]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


MAX_NEW = 24
# bfloat16 rounding moves this model's log-probs by tenths of a nat against transformers' own bfloat16
# run (its logits near 20 are rounded to steps of 0.125); a wrong mask, KV slot or position moves them
# by whole nats.
BF16_DRIFT = 0.5


def _reference(model, device: str, prompt_ids: list[list[int]]):
    """transformers' greedy tokens and, per token, the log-softmax over the vocabulary, one prompt at a
    time; EOS is banned as our `min_tokens` bans it."""
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            got = model.generate(torch.tensor([ids], device=device), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
            outs.append((got.sequences[0, len(ids):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in got.scores]))
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_equal_transformers_on_the_device(device, dtype, model_dir, tokenizer):
    """Against transformers' greedy decoding on the same device and dtype. float32: tokens equal,
    log-probs within 0.5 %. bfloat16: log-probs within rounding of transformers' while the tokens agree;
    where they part, the two choices are a near-tie by transformers' own scores, which rounding may tip."""
    from transformers import AutoModelForCausalLM

    from tritonllm.engine.engine import Engine

    prompt_ids = [tokenizer.encode(p) for p in PLAIN_PROMPTS[:4]]
    engine = Engine(model=str(model_dir), device=device, dtype=dtype, max_num_seqs=8, max_model_len=512,
                    num_kv_blocks=256)
    print(f"device backend: {engine.runner.backend.describe()}")
    got = engine.generate(prompt_token_ids=prompt_ids,
                          params={"max_tokens": MAX_NEW, "min_tokens": MAX_NEW, "ignore_eos": True})
    engine.close()
    del engine
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    for out, (tokens, rows) in zip(got, _reference(model, device, prompt_ids)):
        logprobs = [row[t].item() for row, t in zip(rows, tokens)]
        if dtype == "float32":
            assert out.token_ids == tokens
            assert out.logprobs == pytest.approx(logprobs, rel=5e-3, abs=5e-3)
            continue
        parted = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), MAX_NEW)
        drift = max(abs(a - b) for a, b in zip(out.logprobs[:parted] or [0.0], logprobs[:parted] or [0.0]))
        print(f"{parted} tokens in common, log-probs within {drift:.3f} nats of transformers'")
        assert drift < BF16_DRIFT, (parted, drift, out.token_ids, tokens)
        if parted < MAX_NEW:
            gap = logprobs[parted] - rows[parted][out.token_ids[parted]].item()
            print(f"  parted at token {parted}: our choice {gap:.3f} nats below transformers' there")
            assert gap < BF16_DRIFT, (parted, gap, out.token_ids, tokens)


def test_a_served_stream_and_a_cancelled_one_on_the_device(device, tmp_path):
    """The device's config.pbtxt variant (configs/<device>.pbtxt) on a real tritonserver: a stream to its
    end, and a stream cancelled mid-way whose KV blocks come back."""
    from conftest import REPO
    from grpc_stream import StreamClient, make_inputs, metric, scrape, wait_for_kv_blocks_in_use
    from tritonserver_harness import TritonServer

    server = TritonServer(REPO / "model_repository", log_path=tmp_path / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=smollm2",
                                      f"--model-config-name={device}"])
    server.start()
    try:
        client = StreamClient(server.grpc_url)
        client.send("whole", make_inputs("The capital of France is", sampling={"max_tokens": 16, "ignore_eos": True}))
        whole = client.wait(["whole"])["whole"]
        assert whole.error is None and whole.num_output_tokens == 16
        client.send("cut", make_inputs("Count to a thousand:", sampling={"max_tokens": 4000, "ignore_eos": True}))
        wait_for_kv_blocks_in_use(server.metrics_url, timeout=60)
        client.close(cancel=True)
        deadline = time.monotonic() + 30
        while metric(scrape(server.metrics_url), "llm_kv_cache_blocks", state="used") > 0:
            assert time.monotonic() < deadline, "the cancelled request's KV blocks were not freed"
            time.sleep(0.2)
    finally:
        server.stop()


@pytest.mark.unit
def test_float32_on_cuda_runs_the_reference_attention():
    """FlashInfer's kernels take float16 and bfloat16 only: float32 gets the torch reference attention,
    and asking for FlashInfer with float32 is refused at load. (Needs no GPU: the choice is made first.)"""
    from tritonllm.devices.cuda.backend import choose_attention

    assert choose_attention("auto", torch.float32)[0] == "torch"
    with pytest.raises(ValueError, match="cuda_attention=flashinfer needs dtype float16 or bfloat16"):
        choose_attention("flashinfer", torch.float32)
