"""`response_coalescing`: a stream's responses after its first are built when its sender thread reaches
them (serving/generate_model.py), carrying every token that came while the send waited in line.

On a real tritonserver with one sender thread and many streams: every token arrives once and in order,
each response's counts agree with its ids, the first response carries the first token alone, exactly
one FINAL ends each stream, and a request with n > 1 and a cancelled stream behave as without it.
Whether responses do coalesce depends on how far the sends lag behind the steps, so that count is
reported, not asserted.
"""

from __future__ import annotations

import time

import pytest

from grpc_stream import StreamClient, make_inputs, metric, scrape
from prompts import PLAIN_PROMPTS

pytestmark = pytest.mark.server

COALESCING = dict(response_coalescing="true", response_threads="1", warmup="false")


@pytest.fixture(scope="module")
def server(variant_server):
    return variant_server("coalescing", **COALESCING)


def test_coalesced_streams_carry_every_token_once_in_order(server, capsys):
    client = StreamClient(server.grpc_url)
    try:
        prompts = [PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)] for i in range(16)]
        for i, prompt in enumerate(prompts):
            client.send(f"s{i}", make_inputs(prompt, sampling={"max_tokens": 24, "ignore_eos": True, "logprobs": 0}))
        client.send("pair", make_inputs(prompts[0], sampling={"max_tokens": 12, "ignore_eos": True, "n": 2}))
        got = client.wait(timeout=300)
    finally:
        client.close()
    responses = 0
    for i in range(16):
        s = got[f"s{i}"]
        assert s.error is None and s.final and s.finish_reason == "length", (i, s.error)
        assert len(s.ids) == 24 and sum(s.output_token_counts) == 24
        assert s.output_token_counts == s.response_id_counts  # each response's count is its own tokens
        assert s.response_id_counts[0] == 1  # the first token alone
        assert len(s.logprobs) == 24 and len(s.top_logprobs) == s.num_responses
        assert all(len(entry) == n for entry, n in zip(s.top_logprobs, s.response_id_counts))
        responses += s.num_responses
    # The same prompt in the same batch: the same greedy tokens, however they were split into responses.
    firsts = [got[f"s{i}"].ids for i in range(16) if prompts[i] == prompts[0]]
    assert all(ids == firsts[0] for ids in firsts)
    pair = got["pair"]
    assert pair.error is None and pair.final and len(pair.ids) == 24  # both completions, every step
    with capsys.disabled():
        print(f"\n  16 streams of 24 tokens: {responses} responses (384 without coalescing)")


def test_a_cancelled_coalesced_stream_ends_once_and_frees_its_blocks(server):
    client = StreamClient(server.grpc_url)
    client.send("cut", make_inputs("Count to a thousand:", sampling={"max_tokens": 2000, "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while metric(scrape(server.metrics_url), "llm_kv_cache_blocks", state="used") == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    client.close(cancel=True)
    deadline = time.monotonic() + 30
    while metric(scrape(server.metrics_url), "llm_kv_cache_blocks", state="used") > 0:
        assert time.monotonic() < deadline, "the cancelled request's KV blocks were not freed"
        time.sleep(0.2)
    # Still serving, with one FINAL per stream.
    client = StreamClient(server.grpc_url)
    try:
        client.send("after", make_inputs("The capital of France is", sampling={"max_tokens": 8, "ignore_eos": True}))
        after = client.wait(["after"])["after"]
    finally:
        client.close()
    assert after.error is None and len(after.ids) == 8
    log = server.log_text()
    assert "sending a response" not in log and "building a response" not in log, log[-3000:]
