"""`POST /v1/embeddings` end to end: the real `openai` SDK -> our OpenAI server -> a real tritonserver
serving minilm, against sentence-transformers' own vectors for the same texts."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from openai_front import openai_front
from prompts import LONG_TEXT
from sentence_reference import assert_close

openai = pytest.importorskip("openai")  # the test extra installs it (scripts/install.sh test)

pytestmark = pytest.mark.server

MODEL = "minilm"
DIM = 384
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "Ünïcödé, テキスト, 中文 and an emoji 🙂", "x"]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def api(minilm_server, tmp_path_factory):
    """Our OpenAI server (its own process, as tritonllm-serve runs it) in front of the minilm tritonserver."""
    log = tmp_path_factory.mktemp("openai-embeddings") / "openai.log"
    with openai_front(minilm_server.grpc_url, log, "--log-level", "info") as base:
        yield base


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def reference(st_model) -> np.ndarray:
    return st_model.encode(TEXTS, convert_to_numpy=True)


def _assert_close(ours, ref: np.ndarray) -> None:
    assert_close(np.asarray(ours, dtype=np.float32), ref)


def test_floats_and_usage_match_sentence_transformers(client, reference, st_model):
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.model == MODEL and response.object == "list"
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    _assert_close([d.embedding for d in response.data], reference)
    tokens = sum(len(ids) for ids in st_model.tokenizer(TEXTS)["input_ids"])  # [CLS] and [SEP] included
    assert response.usage.prompt_tokens == tokens == response.usage.total_tokens


def test_base64_is_the_same_vectors(api, client, reference):
    # The SDK asks for base64 when the caller names no format, and decodes it itself.
    sdk = client.embeddings.create(model=MODEL, input=TEXTS[0])
    _assert_close([sdk.data[0].embedding], reference[:1])
    status, body = _post(f"{api}/v1/embeddings", {"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200, body
    raw = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    np.testing.assert_array_equal(np.stack(raw), np.array([d.embedding for d in floats.data], dtype=np.float32))
    # Explicit nulls are the fields' defaults (float), as in the other endpoints.
    status, body = _post(f"{api}/v1/embeddings", {"model": MODEL, "input": TEXTS[:2], "encoding_format": None,
                                                  "dimensions": None, "user": None})
    assert status == 200 and body["data"][0]["embedding"] == floats.data[0].embedding, body


def test_token_ids_embed_as_their_text(client, reference, st_model):
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    _assert_close([one.data[0].embedding], reference[:1])
    assert one.usage.prompt_tokens == len(ids[0])
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    _assert_close([d.embedding for d in many.data], reference[:3])


def test_models_lists_the_embedding_model(client):
    assert MODEL in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:  # the answer names every kind of model served
        client.models.retrieve("no-such-model")
    assert "the embedding models are ['minilm']" in missing.value.body["message"], missing.value.body
    with pytest.raises(openai.NotFoundError) as not_generating:  # an embedding model asked to chat: where it serves
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "/v1/embeddings" in not_generating.value.body["message"], not_generating.value.body


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "hi", "dimensions": 128}, 400, "dimensions", "matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
    ({"input": []}, 400, "input", "non-empty"),
    ({"input": ["hi", ""]}, 400, "input", "input[1] is an empty string"),
    ({"input": ["hi", [101, 102]]}, 400, "input", "mixes"),
    ({"input": [[101, 999999, 102]]}, 400, "input", "token ids must be in"),
    ({"input": [[7592, 2088]]}, 400, "input", "not this model's tokenization"),  # no [CLS] / [SEP]
    ({"input": [LONG_TEXT * 2]}, 400, "input", "max_model_len"),  # the model's own refusal, passed on
    ({"model": "nonesuch", "input": "hi"}, 404, "model", "nonesuch"),
])
def test_bad_requests_get_openai_errors(api, body, status, param, words):
    got, answer = _post(f"{api}/v1/embeddings", {"model": MODEL, **body})
    assert got == status, answer
    error = answer["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_model_dimension_and_sdk_errors(client, reference):
    same = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=DIM, encoding_format="float")
    _assert_close([same.data[0].embedding], reference[:1])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="hi", dimensions=64)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nonesuch", input="hi")
