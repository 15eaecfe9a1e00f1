"""Test helper: drive the smollm2 model over tritonclient gRPC streaming and collect responses."""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

MODEL = "smollm2"


def make_inputs(text: str | None = None, stream: bool = True, sampling: dict | str | None = None,
                chat: bool = False, exclude_input: bool | None = None, input_ids: list[int] | None = None,
                extra: dict | None = None) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = []
    if text is not None:
        inputs.append(tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"))
    if input_ids is not None:
        inputs.append(tensor("input_ids", np.asarray(input_ids, dtype=np.int32), "INT32"))
    inputs.append(tensor("stream", np.array([stream]), "BOOL"))
    if chat:
        inputs.append(tensor("apply_chat_template", np.array([True]), "BOOL"))
    if exclude_input is not None:
        inputs.append(tensor("exclude_input_in_output", np.array([exclude_input]), "BOOL"))
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(tensor("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES"))
    for name in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
                 "return_cumulative_logprob"):
        inputs.append(tensor(name, np.array([True]), "BOOL"))
    for name, (array, dtype) in (extra or {}).items():
        inputs.append(tensor(name, array, dtype))
    return inputs


@dataclass
class Collected:
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_responses: int = 0  # responses that carried outputs
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    output_token_counts: list[int] = field(default_factory=list)  # each response's num_output_tokens
    response_id_counts: list[int] = field(default_factory=list)  # each response's number of output_ids
    cumulative_logprobs: list[float] = field(default_factory=list)  # each response's cumulative_logprob
    top_logprobs: list[list[dict] | None] = field(default_factory=list)  # each response's `logprobs` JSON, parsed
    arrays: list[dict[str, np.ndarray]] = field(default_factory=list)  # each response's outputs, as sent
    error: str | None = None
    final: bool = False

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def num_output_tokens(self) -> int | None:
        """The request's output tokens: the sum of the responses' counts (None when not returned)."""
        return sum(self.output_token_counts) if self.output_token_counts else None


class StreamClient:
    """One gRPC stream; many requests multiplexed on it by request id."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.results: dict[str, Collected] = {}
        self.client.start_stream(callback=lambda result=None, error=None: self.events.put((result, error)))

    def send(self, request_id: str, inputs: list) -> None:
        self.results[request_id] = Collected()
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def wait(self, request_ids: list[str] | None = None, timeout: float = 120.0) -> dict[str, Collected]:
        wanted = set(request_ids or self.results)
        deadline = time.monotonic() + timeout
        while any(not (self.results[r].final) for r in wanted):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no final response for {[r for r in wanted if not self.results[r].final]}")
            try:
                result, error = self.events.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                continue
            self._apply(result, error)
        return {r: self.results[r] for r in wanted}

    def _apply(self, result, error) -> None:
        if error is not None:
            # Errors carry the request id in the message-less InferenceServerException; the
            # stream callback gives us the result of the failed request when it can.
            rid = getattr(error, "request_id", None) or self._only_pending(error)
            c = self.results[rid]
            c.error, c.final = str(error), True
            return
        response = result.get_response()
        c = self.results[response.id]
        text = result.as_numpy("text_output")
        if text is not None:
            c.arrays.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            c.num_responses += 1
            c.texts += [t.decode() for t in text.reshape(-1)]
            ids = result.as_numpy("output_ids").tolist()
            c.ids += ids
            c.response_id_counts.append(len(ids))
            lps = result.as_numpy("output_log_probs")
            if lps is not None:
                c.logprobs += lps.tolist()
            reason = result.as_numpy("finish_reason")
            if reason is not None:
                c.finish_reason = reason.reshape(-1)[0].decode()
            value = result.as_numpy("num_input_tokens")
            if value is not None:
                c.num_input_tokens = int(value.reshape(-1)[0])
            value = result.as_numpy("num_output_tokens")
            if value is not None:
                c.output_token_counts.append(int(value.reshape(-1)[0]))
            value = result.as_numpy("cumulative_logprob")
            if value is not None:
                c.cumulative_logprobs.append(float(value.reshape(-1)[0]))
            value = result.as_numpy("logprobs")
            if value is not None:
                c.top_logprobs.append(json.loads(value.reshape(-1)[0]))
        if response.parameters["triton_final_response"].bool_param:
            c.final = True

    def _only_pending(self, error) -> str:
        pending = [r for r, c in self.results.items() if not c.final]
        assert len(pending) == 1, f"cannot attribute an error among {pending}: {error}"
        return pending[0]

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def scrape(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as printed)."""
    import urllib.request

    out = {}
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def wait_for_kv_blocks_in_use(metrics_url: str, timeout: float = 10.0) -> None:
    """Until llm_kv_cache_blocks{state="used"} shows a running request (gauges refresh twice a second)."""
    deadline = time.monotonic() + timeout
    while metric(scrape(metrics_url), "llm_kv_cache_blocks", state="used") == 0:
        assert time.monotonic() < deadline, "the running request never showed in llm_kv_cache_blocks"
        time.sleep(0.1)
