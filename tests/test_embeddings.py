"""The embedding model: equal to sentence-transformers' `encode`, alone or batched with others,
offline and on a real tritonserver; token-budget batching; bad input gets INVALID_ARG."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from prompts import CHAT_PROMPTS, LONG_TEXT, PLAIN_PROMPTS
from sentence_reference import assert_close
from tritonllm.core.parameters import ConfigError
from tritonllm.embeddings.config import EmbeddingConfig
from tritonllm.embeddings.engine import EmbeddingEngine
from tritonllm.embeddings.request import TIMESTAMPS, EmbeddingRequest, TextItem
from tritonllm.embeddings.scheduler import EmbeddingScheduler
from tritonllm.serving.embedding_model import parse_embedding_request
from tritonllm.layers.packed_attention import MAX_PADDING, make_groups
from tritonllm.core.sampling_params import InvalidRequestError

pytestmark = pytest.mark.engine

TEXTS = CHAT_PROMPTS[:6] + PLAIN_PROMPTS[:4] + [
    "x", "Ünïcödé, テキスト, 中文 and an emoji 🙂", "  leading and trailing spaces  ", LONG_TEXT[:900],
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
]


@pytest.fixture(scope="module")
def reference(st_model) -> np.ndarray:
    return st_model.encode(TEXTS, batch_size=8, convert_to_numpy=True)


@pytest.fixture(scope="module")
def embedder():
    eng = EmbeddingEngine(EmbeddingConfig(max_num_batched_tokens=512))
    yield eng
    eng.shutdown()


def test_each_text_alone_matches_sentence_transformers(embedder, reference):
    ours = np.concatenate([embedder.encode([t]) for t in TEXTS])
    assert_close(ours, reference)


def test_texts_batched_with_other_requests_match(embedder, reference):
    before = embedder.stats()
    groups = [list(range(i, min(i + 3, len(TEXTS)))) for i in range(0, len(TEXTS), 3)] + [[i] for i in range(len(TEXTS))]
    barrier = threading.Barrier(len(groups))

    def one(rows):
        barrier.wait()  # all requests arrive together, so the scheduler batches them
        return rows, embedder.encode([TEXTS[r] for r in rows], timeout=60)

    with ThreadPoolExecutor(len(groups)) as pool:
        results = list(pool.map(one, groups))
    for rows, emb in results:
        assert_close(emb, reference[rows])
    after = embedder.stats()
    num_texts = after["texts"] - before["texts"]
    assert num_texts == 2 * len(TEXTS)
    assert after["batches"] - before["batches"] < num_texts / 2  # really batched across requests
    assert after["in_flight_requests"] == 0 and after["queued_texts"] == 0


def test_not_normalized_is_the_plain_mean(embedder, reference):
    raw = embedder.encode(TEXTS[:5], normalize=False)
    norms = np.linalg.norm(raw, axis=1)
    assert (np.abs(norms - 1) > 0.1).all()
    assert_close(raw / norms[:, None], reference[:5])


def test_too_long_text_fails_only_its_request(embedder):
    results = {}
    embedder.submit(["fine", LONG_TEXT * 2], lambda out: results.setdefault("bad", out))
    good = embedder.encode(["a short one"])
    assert good.shape == (1, embedder.dim)
    bad = results.get("bad")  # refused while tokenizing, before the good request was even admitted
    assert bad is not None and bad.embeddings is None and bad.error_kind == "InvalidRequestError"
    assert "text_input[1]" in bad.error and "max_model_len" in bad.error


def test_truncation_and_a_small_token_budget_match_sentence_transformers(st_model):
    texts = [LONG_TEXT * 2, "short", LONG_TEXT[:300]] * 3  # the first is cut at 256 tokens, as ST does
    ref = st_model.encode(texts, convert_to_numpy=True)
    eng = EmbeddingEngine(EmbeddingConfig(truncate=True, max_num_batched_tokens=300, warmup=False))
    try:
        assert_close(eng.encode(texts), ref)
        stats = eng.stats()
        assert stats["batches"] >= 3 and stats["tokens"] <= 300 * stats["batches"]
    finally:
        eng.shutdown()


def test_many_clients_with_a_tiny_budget_all_finish(reference):
    eng = EmbeddingEngine(EmbeddingConfig(max_num_batched_tokens=256, max_num_seqs=4, truncate=True, warmup=False))
    rows = [[i % len(TEXTS), (i * 7) % len(TEXTS)][: 1 + i % 2] for i in range(120)]
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda r: eng.encode([TEXTS[i] for i in r], timeout=60), rows))
        for r, emb in zip(rows, results):
            assert_close(emb, reference[r])
        stats = eng.stats()
        assert stats["texts"] == sum(map(len, rows)) and stats["in_flight_requests"] == stats["queued_texts"] == 0
        assert stats["tokens"] <= 256 * stats["batches"] and stats["texts"] <= 4 * stats["batches"]
    finally:
        eng.shutdown()


def test_timestamps_are_recorded_and_logged(embedder, caplog):
    got, done = [], threading.Event()
    with caplog.at_level(logging.DEBUG, logger="tritonllm"):
        embedder.submit(["when did it happen?"], lambda out: (got.append(out), done.set()))
        assert done.wait(60)
    times = got[0].times
    assert list(times) == list(TIMESTAMPS) and sorted(times.values()) == list(times.values())
    assert any("waiting_time=" in r.message and "inference_time=" in r.message for r in caplog.records)


def _items(lengths):
    request = EmbeddingRequest("r", ["t"] * len(lengths), True, lambda out: None)
    request.token_ids = [[0] * n for n in lengths]
    return [TextItem(request, i) for i in range(len(lengths))]


@pytest.mark.unit
def test_scheduler_fills_the_token_budget_in_arrival_order():
    sched = EmbeddingScheduler(max_num_batched_tokens=100, max_num_seqs=3)
    sched.add(_items([40, 50, 20, 5, 90]))
    first = sched.schedule()
    assert [i.num_tokens for i in first] == [40, 50]  # 20 would overflow: no overtaking
    assert [i.num_tokens for i in sched.schedule()] == [20, 5]  # 90 would overflow
    topped = sched.schedule([first[0]])  # a prepared batch of 40 tokens has no room for 90
    assert topped == []
    first[0].request.done = True  # an aborted request's texts are dropped
    assert sched.schedule() == [] and sched.num_waiting == 0 and sched.num_dropped == 1


@pytest.mark.unit
def test_attention_groups_bound_the_padding():
    lens = [3, 3, 4, 9, 10, 10, 11, 60, 250, 256]
    groups = make_groups(lens)
    assert groups[0].start == 0 and groups[-1].end == sum(lens)
    assert sum(g.num_texts for g in groups) == len(lens)
    for g in groups:
        real = g.end - g.start
        assert g.num_texts * g.max_len - real <= MAX_PADDING * real
        assert (g.pad_index is None) == (g.key_mask is None)
    assert make_groups([7, 7, 7])[0].pad_index is None  # equal lengths: no gather, no mask


@pytest.mark.unit
def test_config_names_the_bad_parameter():
    with pytest.raises(ConfigError, match="'max_num_batch_tokens'"):
        EmbeddingConfig.from_parameters({"max_num_batch_tokens": "512"})
    with pytest.raises(ConfigError, match="'max_model_len'.*'long'"):
        EmbeddingConfig.from_parameters({"max_model_len": "long"})
    with pytest.raises(ConfigError, match="max_model_len"):
        EmbeddingConfig.from_parameters({"max_model_len": "512", "max_num_batched_tokens": "256"})


@pytest.mark.unit
@pytest.mark.parametrize("inputs, message", [
    ({}, "no text_input"),
    ({"text_input": np.array([], dtype=object)}, "no text"),
    ({"text_input": np.array([b"ok", b""], dtype=object)}, r"text_input\[1\] is empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, "UTF-8"),
    ({"text_input": np.array([b"x"], dtype=object), "normalize": np.array([b"maybe"], dtype=object)}, "normalize"),
])
def test_request_parsing_rejects_bad_input(inputs, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_embedding_request(inputs, None)


# ---- a real tritonserver ---------------------------------------------------------------------------

def _infer(url: str, texts: list, normalize: bool | None = None):
    import tritonclient.grpc as grpcclient

    array = np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=object)
    inputs = [grpcclient.InferInput("text_input", [len(texts)], "BYTES")]
    inputs[0].set_data_from_numpy(array)
    if normalize is not None:
        inputs.append(grpcclient.InferInput("normalize", [1], "BOOL"))
        inputs[1].set_data_from_numpy(np.array([normalize]))
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer("minilm", inputs, client_timeout=120).as_numpy("embedding")


@pytest.mark.server
def test_server_many_texts_in_one_request(minilm_server, reference):
    assert_close(_infer(minilm_server.grpc_url, TEXTS), reference)


@pytest.mark.server
def test_server_concurrent_requests(minilm_server, reference):
    groups = [list(range(i, len(TEXTS), 4)) for i in range(4)] + [[i] for i in range(0, len(TEXTS), 2)]
    with ThreadPoolExecutor(len(groups)) as pool:
        results = list(pool.map(lambda rows: _infer(minilm_server.grpc_url, [TEXTS[r] for r in rows]), groups))
    for rows, emb in zip(groups, results):
        assert_close(emb, reference[rows])
    raw = _infer(minilm_server.grpc_url, TEXTS[:2], normalize=False)
    assert_close(raw, reference[:2], normalized=False)


@pytest.mark.server
@pytest.mark.parametrize("texts, message", [
    ([b"\xff\xfe"], "not valid UTF-8"), ([b""], "is empty"), ([LONG_TEXT * 2], "max_model_len")])
def test_server_bad_request_gets_invalid_arg_while_another_completes(minilm_server, reference, texts, message):
    from tritonclient.utils import InferenceServerException

    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(_infer, minilm_server.grpc_url, TEXTS)
        with pytest.raises(InferenceServerException) as info:
            _infer(minilm_server.grpc_url, texts)
        assert_close(good.result(timeout=120), reference)
    assert "INVALID_ARG" in str(info.value.status()) and message in info.value.message()
