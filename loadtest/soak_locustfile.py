"""Locust users for the soak: mixed traffic, each request's end accounted for (run by loadtest/soak.py).

    locust -f loadtest/soak_locustfile.py --headless -u 8 -r 8 -t 30m --host 127.0.0.1:8001 \
        --soak-http 127.0.0.1:8000 --soak-log results/soak_requests.jsonl

Each user sends one request at a time, of a kind drawn by weight:
  stream       gRPC, streamed, 16-64 tokens
  whole        HTTP generate (not streamed), 16-32 tokens
  cancel       gRPC, streamed; the client cancels after the first token
  invalid      gRPC, a sampling parameter out of range: must be refused (one FINAL carrying an error)
  long         gRPC, a prompt a few tokens short of max_model_len (as token ids), up to the limit
  n2           gRPC, n = 2 sampled completions
  guided       gRPC, guided by a choice, a regex or a JSON object, in turn
  embed        HTTP infer on minilm

Every request is written as one JSON line to --soak-log: kind, outcome, send time, time to first
token, error. Outcomes: ok; rejected (an invalid request refused, as it must be); cancelled; error (an
error the request did not ask for); lost (no FINAL and no error within the timeout); extra (a second
terminal event, or events after one). A gRPC request has its own stream, so events after its
terminal one are seen before the stream closes.
"""

# grpc must switch to gevent-cooperative I/O before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import requests  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from locust import User, events, task  # noqa: E402

from tritonllm_client.locust_exit import exit_before_finalizers  # noqa: E402
from tritonllm_client.stream import describe_error  # noqa: E402

WEIGHTS = {"stream": 8, "whole": 3, "cancel": 2, "invalid": 2, "long": 1, "n2": 2, "guided": 2, "embed": 3}
GUIDES = [{"choice": ["yes", "no", "maybe"]}, {"regex": "[0-9]{3}-[0-9]{4}"}, {"json_object": True}]
PROMPTS = ["Tell me about the sea.", "Write a short poem about rain.", "What is a prime number?",
           "Explain how a bicycle works.", "List three colours.", "Describe a quiet morning in a small town."]
_user_ids = itertools.count()
_log_lock = threading.Lock()


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--soak-http", type=str, env_var="TRITONLLM_SOAK_HTTP", default="127.0.0.1:8000",
                        help="the server's HTTP address (HTTP generate, embeddings)")
    parser.add_argument("--soak-log", type=str, env_var="TRITONLLM_SOAK_LOG", default="soak_requests.jsonl",
                        help="one JSON line per request is appended here")
    parser.add_argument("--soak-max-model-len", type=int, env_var="TRITONLLM_SOAK_MAX_MODEL_LEN", default=2048,
                        help="the model's max_model_len (the long prompts end just short of it)")
    parser.add_argument("--soak-timeout", type=float, env_var="TRITONLLM_SOAK_TIMEOUT", default=120.0,
                        help="a request with no FINAL and no error after this long counts as lost")
    parser.add_argument("--soak-kinds", type=str, env_var="TRITONLLM_SOAK_KINDS", default=",".join(WEIGHTS),
                        help="the kinds of request to send, comma-separated (e.g. without embed for a server "
                             "without minilm)")


@events.quit.add_listener
def _exit_without_finalizers(exit_code, **_kw):
    """tritonclient's channel close at interpreter teardown can block for ever under gevent (locust_exit.py)."""
    exit_before_finalizers(exit_code)


def _tensor(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _inputs(text=None, ids=None, stream=True, sampling=None):
    inputs = []
    if text is not None:
        inputs.append(_tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"))
    if ids is not None:
        inputs.append(_tensor("input_ids", np.asarray(ids, dtype=np.int32), "INT32"))
    inputs.append(_tensor("stream", np.array([stream]), "BOOL"))
    inputs.append(_tensor("sampling_parameters", np.array([json.dumps(sampling or {}).encode()], dtype=np.object_),
                          "BYTES"))
    return inputs


class _Request:
    """One gRPC request on its own stream: its events, counted until the stream has closed."""

    def __init__(self):
        self.finals = 0
        self.errors: list[str] = []
        self.late = 0
        self.first_token: float | None = None
        self.responses = 0
        self.ended = threading.Event()  # the terminal event came
        self.started = threading.Event()  # a first response came

    def on_event(self, result=None, error=None):
        now = time.perf_counter()
        if self.finals or self.errors:
            self.late += 1
            return
        if error is not None:
            self.errors.append(describe_error(error))
        else:
            response = result.get_response()
            if any(o.name == "text_output" for o in response.outputs):
                self.responses += 1
                if self.first_token is None:
                    self.first_token = now
                self.started.set()
            final = response.parameters.get("triton_final_response")
            if final is None or final.bool_param:
                self.finals += 1
        if self.finals or self.errors:
            self.ended.set()


class SoakUser(User):
    """One client: a request at a time, of a kind drawn by WEIGHTS (see the module's docstring)."""

    host = "127.0.0.1:8001"

    def on_start(self):
        options = self.environment.parsed_options
        self.user_id = next(_user_ids)
        self.rng = random.Random(f"soak-{self.user_id}")
        self.http = f"http://{options.soak_http}"
        self.log_path = options.soak_log
        self.max_model_len = int(options.soak_max_model_len)
        self.timeout_s = float(options.soak_timeout)
        self.kinds = [k for k in options.soak_kinds.split(",") if k]
        unknown = set(self.kinds) - set(WEIGHTS)
        if unknown:
            raise ValueError(f"unknown request kinds {sorted(unknown)}; known: {', '.join(WEIGHTS)}")
        self.client = grpcclient.InferenceServerClient(self.host)
        self.session = requests.Session()
        self.count = itertools.count()

    def on_stop(self):
        self.client.close()
        self.session.close()

    def wait_time(self):
        return self.rng.uniform(0.0, 0.4)

    @task
    def one_request(self):
        kind = self.rng.choices(self.kinds, weights=[WEIGHTS[k] for k in self.kinds])[0]
        started = time.time()
        t0 = time.perf_counter()
        outcome, ttft, error = getattr(self, f"_{kind}")()
        elapsed = time.perf_counter() - t0
        failed = outcome in ("error", "lost", "extra")
        self.environment.events.request.fire(
            request_type="soak", name=kind, response_time=elapsed * 1000.0, response_length=0,
            exception=RuntimeError(f"{outcome}: {error}") if failed else None, context={})
        record = {"kind": kind, "outcome": outcome, "start": started, "elapsed_s": round(elapsed, 4),
                  "ttft_s": None if ttft is None else round(ttft, 4), "error": error}
        with _log_lock, open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- gRPC kinds
    def _grpc(self, inputs, expect_error=False, cancel_after_first=False):
        request = _Request()
        request_id = f"soak-{self.user_id}-{next(self.count)}"
        self.client.start_stream(callback=request.on_event, stream_timeout=self.timeout_s + 30)
        sent = time.perf_counter()
        cancelled = False
        try:
            self.client.async_stream_infer("smollm2", inputs, request_id=request_id, enable_empty_final_response=True)
            if cancel_after_first:
                if request.started.wait(self.timeout_s) and not request.ended.is_set():
                    cancelled = True
            else:
                request.ended.wait(self.timeout_s)
        finally:
            # A request that ended: half-close and wait for the stream's end, so late events are counted.
            self.client.stop_stream(cancel_requests=cancelled or not request.ended.is_set())
        ttft = None if request.first_token is None else request.first_token - sent
        error = request.errors[0] if request.errors else None
        if cancelled:
            return "cancelled", ttft, None
        if request.finals + len(request.errors) == 0:
            return "lost", ttft, f"no FINAL and no error within {self.timeout_s:g} s"
        if request.finals + len(request.errors) > 1 or request.late:
            return "extra", ttft, f"{request.finals} FINAL, {len(request.errors)} errors, {request.late} late events"
        if expect_error:
            return ("rejected", None, error) if error else ("error", ttft, "an invalid request was accepted")
        return ("error", ttft, error) if error else ("ok", ttft, None)

    def _prompt(self):
        return self.rng.choice(PROMPTS)

    def _stream(self):
        return self._grpc(_inputs(self._prompt(), sampling={"max_tokens": self.rng.randint(16, 64)}))

    def _cancel(self):
        return self._grpc(_inputs(self._prompt(), sampling={"max_tokens": 256, "ignore_eos": True}),
                          cancel_after_first=True)

    def _invalid(self):
        bad = self.rng.choice([{"temperature": -1.0}, {"max_tokens": 0}, {"top_p": 2.0}, {"no_such_parameter": 1}])
        return self._grpc(_inputs(self._prompt(), sampling=bad), expect_error=True)

    def _long(self):
        # Token ids, so the length is exact: a few tokens short of the limit, which ends the request.
        ids = [self.rng.randint(1000, 20000) for _ in range(self.max_model_len - 8)]
        return self._grpc(_inputs(ids=ids, sampling={"max_tokens": 16, "ignore_eos": True}))

    def _n2(self):
        return self._grpc(_inputs(self._prompt(), sampling={"n": 2, "temperature": 0.8, "max_tokens": 24}))

    def _guided(self):
        guide = GUIDES[next(self.count) % len(GUIDES)]
        return self._grpc(_inputs(self._prompt(), sampling={"max_tokens": 24, "guided_decoding": guide}))

    # -- HTTP kinds
    def _http(self, path, body):
        try:
            response = self.session.post(self.http + path, json=body, timeout=self.timeout_s)
        except requests.Timeout:
            return "lost", None, f"no answer within {self.timeout_s:g} s"
        except requests.RequestException as exc:
            return "error", None, f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return "error", None, f"HTTP {response.status_code}: {response.text[:300]}"
        return "ok", None, None

    def _whole(self):
        return self._http("/v2/models/smollm2/generate",
                          {"text_input": self._prompt(), "max_tokens": self.rng.randint(16, 32), "stream": False})

    def _embed(self):
        texts = [self._prompt() for _ in range(self.rng.randint(1, 4))]
        return self._http("/v2/models/minilm/infer", {"inputs": [
            {"name": "text_input", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]})
