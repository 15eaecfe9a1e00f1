"""n completions of one prompt (vLLM's `n`): in the engine, and through tritonserver in the vLLM backend's format."""

from __future__ import annotations

import time

import pytest

from grpc_stream import StreamClient, make_inputs, metric, scrape, wait_for_kv_blocks_in_use
from prompts import LONG_TEXT
from tritonllm.core.sampling_params import MAX_N, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit

PROMPT = "Parallel completions share one prompt. " + LONG_TEXT[:400]


def test_greedy_completions_equal_the_single_one_and_share_its_prompt_blocks(engine):
    prompt = "Three completions of a prompt seen for the first time. " + LONG_TEXT[:300]
    outs = engine.generate([prompt], SamplingParams(n=3, max_tokens=12, ignore_eos=True))
    [alone] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({o.request_id for o in outs}) == 3
    assert all(o.token_ids == alone.token_ids and o.text == alone.text for o in outs)
    # The first computed the prompt; the others took every whole block of it from the cache.
    bs = engine.config.cache.block_size
    num_prompt = len(outs[0].prompt_token_ids)
    assert all(o.num_cached_prompt_tokens >= bs * ((num_prompt - 1) // bs) for o in outs[1:])
    assert outs[0].num_cached_prompt_tokens < bs


def test_seeded_completions_differ_and_completion_i_samples_with_seed_plus_i(engine):
    params = dict(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = engine.generate(["Once upon a time"], SamplingParams(n=3, seed=11, **params))
    alone = [engine.generate(["Once upon a time"], SamplingParams(seed=11 + i, **params))[0] for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stream_yields_every_completion_and_abort_by_request_id_stops_them_all(engine):
    seen = {}
    for out in engine.stream("Count to ten:", SamplingParams(n=2, max_tokens=5, ignore_eos=True)):
        seen.setdefault(out.index, []).extend(out.new_token_ids)
    assert sorted(seen) == [0, 1] and all(len(ids) == 5 for ids in seen.values())

    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    stopped = engine.abort(rid)
    assert sorted(o.index for o in stopped) == [0, 1, 2] and all(o.finish_reason == "abort" for o in stopped)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_truncate_prompt_tokens_keeps_the_prompt_end(engine, tokenizer):
    ids = tokenizer.encode(PROMPT)
    [cut] = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=20))
    [tail] = engine.generate(prompt_token_ids=[ids[-20:]], params=SamplingParams(max_tokens=6, ignore_eos=True))
    assert cut.prompt_token_ids == ids[-20:] and cut.token_ids == tail.token_ids


@pytest.mark.parametrize("values, message", [
    ({"n": 0}, "n must be >= 1"),
    ({"n": MAX_N + 1}, "n must be at most"),
    ({"n": 2, "best_of": 3}, "best_of must equal n"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_counts_are_clear_errors(values, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict(values)


def test_null_values_mean_the_defaults_as_in_the_vllm_backend():
    params = SamplingParams.from_dict({"temperature": None, "max_tokens": 5, "n": 1, "best_of": None, "seed": None})
    assert params.temperature == 0.0 and params.max_tokens == 5 and params.n == 1


@pytest.fixture
def stream(triton_server):
    client = StreamClient(triton_server.grpc_url)
    yield client
    client.close()


@pytest.mark.server
def test_streamed_completions_come_as_arrays_of_n_in_each_response(stream, engine):
    sampling = {"n": 2, "max_tokens": 10, "ignore_eos": True}
    stream.send("g", make_inputs(PROMPT, stream=True, sampling=sampling))
    got = stream.wait(["g"])["g"]
    assert got.error is None and got.final
    [ref] = engine.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))
    texts, ids = ["", ""], [[], []]
    for arrays in got.arrays:
        assert arrays["text_output"].shape == (2,) and arrays["num_output_tokens"].shape == (2,)
        counts = arrays["num_output_tokens"].tolist()
        assert len(arrays["output_ids"]) == sum(counts)  # completions' tokens one after another
        for i in range(2):
            texts[i] += arrays["text_output"][i].decode()
            ids[i] += arrays["output_ids"][sum(counts[:i]):sum(counts[:i + 1])].tolist()
        assert arrays["cumulative_logprob"].shape == (2,)
    assert texts == [ref.text] * 2 and ids == [ref.token_ids] * 2
    # A step's tokens of both completions go out in one response, not one response each.
    assert got.num_responses <= 10 + 1
    final = got.arrays[-1]
    assert [r.decode() for r in final["finish_reason"]] == ["length", "length"]
    assert final["num_input_tokens"].tolist() == [len(ref.prompt_token_ids)]


@pytest.mark.server
def test_not_streamed_completions_come_in_one_response_and_sampled_ones_differ(stream):
    sampling = {"n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    stream.send("s", make_inputs("Once upon a time", stream=False, exclude_input=True, sampling=sampling))
    got = stream.wait(["s"])["s"]
    assert got.error is None and got.num_responses == 1
    [arrays] = got.arrays
    texts = [t.decode() for t in arrays["text_output"]]
    assert len(texts) == 3 and len(set(texts)) > 1
    assert arrays["num_output_tokens"].tolist() == [12, 12, 12] and len(arrays["output_ids"]) == 36
    stream.send("bad", make_inputs("Hi", sampling={"n": 2, "best_of": 4}))
    bad = stream.wait(["bad"])["bad"]
    assert bad.error is not None and "best_of must equal n" in bad.error


@pytest.mark.server
def test_a_cancelled_request_stops_every_completion_and_frees_their_blocks(triton_server):
    client = StreamClient(triton_server.grpc_url)
    aborted_before = metric(scrape(triton_server.metrics_url), "llm_requests_finished_total", reason="abort")
    client.send("long", make_inputs(PROMPT, stream=True, sampling={"n": 3, "max_tokens": 1000, "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while client.results["long"].num_responses < 5 and time.monotonic() < deadline:
        client._apply(*client.events.get(timeout=30))
    assert client.results["long"].num_responses >= 5
    wait_for_kv_blocks_in_use(triton_server.metrics_url)
    client.close(cancel=True)
    deadline = time.monotonic() + 15
    while True:
        samples = scrape(triton_server.metrics_url)
        aborted = metric(samples, "llm_requests_finished_total", reason="abort") - aborted_before
        idle = (metric(samples, "llm_requests", state="running") + metric(samples, "llm_requests", state="waiting")
                + metric(samples, "llm_kv_cache_blocks", state="used")) == 0
        if (idle and aborted >= 3) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and aborted == 3, f"after the cancel: idle={idle}, completions aborted={aborted}"


@pytest.mark.server
def test_http_generate_returns_the_completions_as_a_json_array(triton_server, engine):
    import json
    import urllib.request

    body = {"text_input": "Paris is", "exclude_input_in_output": True, "max_tokens": 8, "n": 2, "ignore_eos": True}
    request = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/smollm2/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        got = json.loads(response.read())
    [ref] = engine.generate(["Paris is"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert got["text_output"] == [ref.text, ref.text]
