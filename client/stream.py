"""One streaming generation over Triton gRPC: send a request, collect deltas, time every response.

The model interface is Triton's vLLM-backend request format (see docs/CLIENT.md). Each call uses its
own gRPC bidirectional stream, so an error response or a broken stream concerns exactly one request
(tritonclient reports stream errors without a request id, which makes multiplexing many requests on
one stream fragile). A :class:`StreamingClient` keeps its connection and can be reused for many
calls, one at a time.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "smollm2"
# Optional BOOL inputs the client asks for when the model declares them.
_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


class ClientError(RuntimeError):
    """A failure worth one clear line to the user (server down, model missing, bad response)."""


def normalize_url(url: str) -> str:
    """Accept `host:port`, `grpc://host:port` or `http://host:port`; return `host:port`."""
    url = url.strip()
    if "://" in url:
        url = url.split("://", 1)[1]
    return url.rstrip("/") or DEFAULT_URL


@dataclass
class GenerationParams:
    """What one request asks for; mirrors the `sampling_parameters` JSON and the BOOL inputs."""

    max_tokens: int = 128
    min_tokens: Optional[int] = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    priority: Optional[int] = None
    chat: bool = True
    exclude_input_in_output: bool = True
    return_logprobs: bool = False
    extra: dict = field(default_factory=dict)  # any other sampling parameter, by the server's name

    def sampling_json(self) -> str:
        sp: dict = {"max_tokens": int(self.max_tokens), "temperature": float(self.temperature)}
        if self.min_tokens is not None:
            sp["min_tokens"] = int(self.min_tokens)
        if self.ignore_eos:
            sp["ignore_eos"] = True
        if self.stop:
            sp["stop"] = list(self.stop)
        if self.stop_token_ids:
            sp["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.repetition_penalty != 1.0:
            sp["repetition_penalty"] = float(self.repetition_penalty)
        if self.priority is not None:
            sp["priority"] = int(self.priority)
        sp.update(self.extra)
        return json.dumps(sp)


@dataclass
class GenerationResult:
    """Everything measured about one streamed request. Times are `time.perf_counter()` seconds."""

    request_id: str
    text: str = ""  # the (first) completion's text
    texts: list[str] = field(default_factory=list)  # every completion's text, when the request asked for n > 1
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    # With the `logprobs: N` sampling parameter and return_logprobs: per output token of the first
    # completion, {token id: {"logprob", "rank", "decoded_token"}}, the chosen token's key first.
    token_logprobs: list[dict] = field(default_factory=list)
    # With `prompt_logprobs: N`: per prompt token, None for the first, then dicts as token_logprobs'.
    prompt_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    num_input_tokens: Optional[int] = None
    reported_output_tokens: Optional[int] = None  # the sum of the responses' `num_output_tokens`, if returned
    num_responses: int = 0  # responses that carried new text or ids
    send_time: float = 0.0
    first_token_time: Optional[float] = None
    end_time: Optional[float] = None
    # (arrival time, number of new tokens) per response that carried tokens
    token_times: list[tuple[float, int]] = field(default_factory=list)
    server_timings: dict = field(default_factory=dict)  # response parameters named timing_*
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def num_output_tokens(self) -> int:
        """Server-reported count if given, else ids received, else text-bearing responses."""
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        if self.output_ids:
            return len(self.output_ids)
        return sum(n for _, n in self.token_times)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> Optional[float]:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first one."""
        n = self.num_output_tokens
        if self.first_token_time is None or self.end_time is None or n < 2:
            return None
        last = self.token_times[-1][0] if self.token_times else self.end_time
        return max(last - self.first_token_time, 0.0) / (n - 1)

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive token-bearing responses, spread over the tokens they carried."""
        gaps = []
        for (t0, _), (t1, n) in zip(self.token_times, self.token_times[1:]):
            gaps.extend([(t1 - t0) / max(n, 1)] * max(n, 1))
        return gaps

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "ok": self.ok,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "num_input_tokens": self.num_input_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_responses": self.num_responses,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "server_timings": self.server_timings,
        }


def _bool_input(name: str, value: bool) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BOOL")
    t.set_data_from_numpy(np.array([bool(value)], dtype=bool))
    return t


def _string_input(name: str, value: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
    return t


def build_inputs(prompt: str, params: GenerationParams, declared: Optional[set[str]] = None) -> list:
    """The request tensors; optional inputs the model does not declare are left out."""

    def wanted(name: str) -> bool:
        return declared is None or name in declared

    inputs = [_string_input("text_input", prompt), _bool_input("stream", True)]
    inputs.append(_string_input("sampling_parameters", params.sampling_json()))
    if wanted("exclude_input_in_output"):
        inputs.append(_bool_input("exclude_input_in_output", params.exclude_input_in_output))
    if wanted("apply_chat_template"):
        inputs.append(_bool_input("apply_chat_template", params.chat))
    elif params.chat:
        raise ClientError("the model does not declare `apply_chat_template`; use --no-chat")
    for name in _RETURN_FLAGS:
        if wanted(name):
            inputs.append(_bool_input(name, True))
    if params.return_logprobs and wanted("return_logprobs"):
        inputs.append(_bool_input("return_logprobs", True))
    return inputs


def _scalar(result, name):
    try:
        arr = result.as_numpy(name)
    except Exception:
        return None
    if arr is None or arr.size == 0:
        return None
    v = arr.reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v


def _param_value(p):
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def describe_error(error) -> str:
    """One line for a tritonclient exception or gRPC error."""
    msg = error.message() if isinstance(error, InferenceServerException) else str(error)
    msg = " ".join(str(msg or error).split())
    status = error.status() if isinstance(error, InferenceServerException) else None
    if status and status not in msg:
        msg = f"{status}: {msg}"
    return msg or type(error).__name__


class StreamingClient:
    """A connection to one Triton server and model; runs streaming requests one at a time."""

    def __init__(self, url: str = DEFAULT_URL, model: str = DEFAULT_MODEL, connect_timeout_s: float = 10.0):
        self.url = normalize_url(url)
        self.model = model
        self.connect_timeout_s = connect_timeout_s
        self._client = grpcclient.InferenceServerClient(self.url)
        self._declared: Optional[set[str]] = None

    def check_ready(self) -> set[str]:
        """Check the server and model are ready and learn the model's input names (cached)."""
        if self._declared is not None:
            return self._declared
        try:
            live = self._client.is_server_live(client_timeout=self.connect_timeout_s)
        except InferenceServerException as e:
            raise ClientError(f"cannot reach Triton at {self.url}: {describe_error(e)}") from None
        if not live:
            raise ClientError(f"Triton at {self.url} is not live")
        try:
            ready = self._client.is_model_ready(self.model, client_timeout=self.connect_timeout_s)
            meta = self._client.get_model_metadata(self.model, client_timeout=self.connect_timeout_s)
        except InferenceServerException as e:
            raise ClientError(f"model {self.model!r} at {self.url}: {describe_error(e)}") from None
        if not ready:
            raise ClientError(f"model {self.model!r} at {self.url} is not ready")
        self._declared = {t.name for t in meta.inputs}
        return self._declared

    def generate(
        self,
        prompt: str,
        params: GenerationParams,
        on_text: Optional[Callable[[str], None]] = None,
        timeout_s: float = 600.0,
        request_id: Optional[str] = None,
        abort: Optional[threading.Event] = None,
    ) -> GenerationResult:
        """Stream one request to its final response; never raises for server-side errors.

        Responses are folded into the result on tritonclient's stream thread, so `on_text` is
        called from that thread, in order. Errors (an error response, a broken stream, a timeout,
        `abort` being set) end up in `result.error`.
        """
        declared = self.check_ready()
        rid = request_id or uuid.uuid4().hex[:12]
        res = GenerationResult(request_id=rid)
        inputs = build_inputs(prompt, params, declared)
        done = threading.Event()

        def callback(result=None, error=None):
            t = time.perf_counter()
            if done.is_set():
                return
            try:
                if error is not None:
                    msg = describe_error(error)
                    res.error = f"timed out after {timeout_s:g} s" if "DEADLINE_EXCEEDED" in msg else msg
                    done.set()
                elif self._absorb(res, t, result, on_text):
                    res.end_time = t
                    done.set()
            except Exception as e:  # a bad response must not kill the stream thread silently
                res.error = f"bad response: {type(e).__name__}: {e}"
                done.set()

        cancel = True
        # The gRPC deadline is a backstop; the loop below normally times out first.
        self._client.start_stream(callback=callback, stream_timeout=timeout_s + 5.0)
        try:
            res.send_time = time.perf_counter()
            self._client.async_stream_infer(
                self.model, inputs, request_id=rid, enable_empty_final_response=True
            )
            deadline = res.send_time + timeout_s
            while not done.is_set():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    res.error = res.error or f"timed out after {timeout_s:g} s"
                    break
                if abort is not None and abort.is_set():
                    res.error = res.error or "aborted by the client"
                    break
                done.wait(min(remaining, 0.5))
            cancel = res.error is not None
        except InferenceServerException as e:
            res.error = describe_error(e)
        finally:  # also on KeyboardInterrupt or a killed greenlet: leave no stream behind
            done.set()
            self._stop_stream(cancel)
        return res

    def _stop_stream(self, cancel: bool) -> None:
        # stop_stream joins the response thread; cancelling makes that join immediate.
        try:
            self._client.stop_stream(cancel_requests=cancel)
        except Exception:
            pass

    @staticmethod
    def _absorb(res: GenerationResult, t: float, result, on_text) -> bool:
        """Fold one response into `res`; True when it is the final one."""
        response = result.get_response()
        names = {o.name for o in response.outputs}
        text = None
        arr = result.as_numpy("text_output") if "text_output" in names else None
        if arr is not None and arr.size:
            pieces = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]
            text = pieces[0]
            if len(pieces) > 1:  # n completions: one element each (the vLLM backend's format)
                res.texts += [""] * (len(pieces) - len(res.texts))
                res.texts = [have + new for have, new in zip(res.texts, pieces)]
        ids = []
        if "output_ids" in names:
            arr = result.as_numpy("output_ids")
            if arr is not None:
                ids = arr.reshape(-1).tolist()
        if "output_log_probs" in names:
            arr = result.as_numpy("output_log_probs")
            if arr is not None:
                res.log_probs.extend(arr.reshape(-1).tolist())
        if "logprobs" in names:
            arr = result.as_numpy("logprobs")
            if arr is not None and arr.size:  # one JSON list per completion
                res.token_logprobs.extend(json.loads(arr.reshape(-1)[0]) or [])  # null: no `logprobs` count asked
        if "prompt_logprobs" in names:
            arr = result.as_numpy("prompt_logprobs")
            if arr is not None and arr.size:
                res.prompt_logprobs = json.loads(arr.reshape(-1)[0])
        n_new = len(ids) if ids else (1 if text else 0)
        if n_new:
            if res.first_token_time is None:
                res.first_token_time = t
            res.token_times.append((t, n_new))
            res.num_responses += 1
            res.output_ids.extend(ids)
        if text:
            res.text += text
            if on_text is not None:
                on_text(text)
        if "finish_reason" in names:
            res.finish_reason = _scalar(result, "finish_reason")
        if "num_input_tokens" in names:
            v = _scalar(result, "num_input_tokens")
            res.num_input_tokens = None if v is None else int(v)
        if "num_output_tokens" in names:  # the tokens of this response: the request's count is their sum
            arr = result.as_numpy("num_output_tokens")  # one count per completion
            if arr is not None and arr.size:
                res.reported_output_tokens = (res.reported_output_tokens or 0) + int(arr.sum())
        params = response.parameters
        final = params.get("triton_final_response")
        if len(params) > 1:
            for key in params:
                if key.startswith("timing_"):
                    res.server_timings[key] = _param_value(params[key])
        return bool(final is not None and final.bool_param)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass

    def __enter__(self) -> "StreamingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClientPool:
    """Reusable StreamingClients for concurrent requests (one in-flight request per client)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = normalize_url(url), model
        self._free: list[StreamingClient] = []
        self._all: list[StreamingClient] = []
        self._lock = threading.Lock()
        self._declared: Optional[set[str]] = None

    def acquire(self) -> StreamingClient:
        with self._lock:
            if self._free:
                return self._free.pop()
        c = StreamingClient(self.url, self.model)
        if self._declared is not None:
            c._declared = self._declared  # metadata is per model, not per connection
        else:
            self._declared = c.check_ready()
        with self._lock:
            self._all.append(c)
        return c

    def release(self, client: StreamingClient) -> None:
        with self._lock:
            self._free.append(client)

    def close(self) -> None:
        with self._lock:
            clients, self._all, self._free = self._all, [], []
        for c in clients:
            c.close()
