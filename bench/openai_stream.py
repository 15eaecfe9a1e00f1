"""Streaming completions from an OpenAI-compatible server (vLLM, llama.cpp's llama-server).

`OpenAIPool` has the shape of tritonllm_client's `ClientPool` (acquire / release / close; its
clients' `generate(prompt, params, timeout_s=, request_id=, abort=)` returns a GenerationResult),
so client/bench.py's `run_requests` replays a scenario against these servers unchanged, with the
same timing and statistics code as for our Triton server.

Prompts are sent as token ids (the chat template applied by our tokenizer), so every system sees
exactly the same tokens; `ignore_eos` makes every output exactly `max_tokens` long.
Only the standard library is used (http.client), so nothing is added to our dependencies.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Callable, Optional

from tritonllm_client.stream import GenerationParams, GenerationResult

_ABORT_POLL_S = 0.5


class OpenAIStreamingClient:
    """Runs one streamed `/v1/completions` request at a time against `host:port`."""

    def __init__(self, pool: "OpenAIPool"):
        self._pool = pool

    def request_body(self, prompt_ids: list[int], params: GenerationParams) -> dict:
        """The JSON body; `ignore_eos` is a vLLM / llama-server extension.

        No `min_tokens`: it bans EOS, while our server's `ignore_eos` (and vLLM's) lets EOS be
        chosen without ending the sequence; banning it would change the text, not the work.
        """
        body = {"model": self._pool.model, "prompt": prompt_ids, "max_tokens": int(params.max_tokens),
                "temperature": float(params.temperature), "stream": True,
                "stream_options": {"include_usage": True}}
        if params.ignore_eos:
            body["ignore_eos"] = True
        return body

    def generate(self, prompt: str, params: GenerationParams, on_text: Optional[Callable[[str], None]] = None,
                 timeout_s: float = 600.0, request_id: Optional[str] = None,
                 abort: Optional[threading.Event] = None) -> GenerationResult:
        """Stream one request to its end; errors end up in `result.error`, never raised."""
        res = GenerationResult(request_id=request_id or uuid.uuid4().hex[:12])
        prompt_ids = self._pool.prompt_ids.get(prompt)
        if prompt_ids is None:
            res.error = "prompt has no token ids (not part of the workload given to OpenAIPool)"
            return res
        body = json.dumps(self.request_body(prompt_ids, params))
        # The socket timeout bounds a silent server; a queued request may legitimately wait long.
        conn = http.client.HTTPConnection(self._pool.host, self._pool.port, timeout=timeout_s)
        token = self._pool.watch(conn, abort)
        try:
            res.send_time = time.perf_counter()
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {' '.join(resp.read(400).decode(errors='replace').split())}"
                return res
            self._read_stream(resp, res, res.send_time + timeout_s, abort, on_text)
        except (OSError, http.client.HTTPException, ValueError) as e:
            if abort is not None and abort.is_set():
                res.error = "aborted by the client"
            else:
                res.error = res.error or f"{type(e).__name__}: {e}"
        finally:
            self._pool.unwatch(token)
            conn.close()
        return res

    @staticmethod
    def _read_stream(resp, res: GenerationResult, deadline: float, abort, on_text) -> None:
        """Fold server-sent events into `res` until `[DONE]`, the end of the stream, or the deadline."""
        finished = False
        while True:  # ends: [DONE], end of stream, deadline, abort (the watcher shuts the socket)
            if time.perf_counter() > deadline:
                res.error = "timed out"
                return
            if abort is not None and abort.is_set():
                res.error = "aborted by the client"
                return
            line = resp.readline()
            t = time.perf_counter()
            if not line:  # llama-server may end the stream without [DONE]
                if finished:
                    res.end_time = t
                else:
                    res.error = "stream ended before the request finished"
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                res.end_time = t
                return
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = f"server error: {chunk['error']}"
                return
            finished = _absorb(res, t, chunk, on_text) or finished


def _absorb(res: GenerationResult, t: float, chunk: dict, on_text) -> bool:
    """Fold one completion chunk into `res`; True once a finish reason was seen."""
    finished = False
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or ""
        # One streamed chunk per generated token is how both servers stream by default; the
        # exact count comes from `usage` at the end, so a chunk carrying more only blurs ITL.
        if text or choice.get("finish_reason") is None:
            if res.first_token_time is None:
                res.first_token_time = t
            res.token_times.append((t, 1))
            res.num_responses += 1
        if text:
            res.text += text
            if on_text is not None:
                on_text(text)
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
            finished = True
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or {}  # llama-server's own counters
    count = usage.get("completion_tokens", timings.get("predicted_n"))
    if isinstance(count, int):
        res.reported_output_tokens = count
    if usage.get("prompt_tokens") is not None:
        res.num_input_tokens = int(usage["prompt_tokens"])
    return finished


class OpenAIPool:
    """Clients for one OpenAI-compatible server, and a watcher that breaks streams on abort.

    `prompt_ids` maps each workload prompt (text) to its token ids with the chat template applied.
    """

    def __init__(self, host: str, port: int, model: str, prompt_ids: Mapping[str, list[int]]):
        self.host, self.port, self.model = host, port, model
        self.url = f"http://{host}:{port}"
        self.prompt_ids = dict(prompt_ids)
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[http.client.HTTPConnection, threading.Event]] = {}
        self._next = 0
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def acquire(self) -> OpenAIStreamingClient:
        return OpenAIStreamingClient(self)  # one connection per request: nothing to reuse

    def release(self, client: OpenAIStreamingClient) -> None:
        pass

    def watch(self, conn: http.client.HTTPConnection, abort: Optional[threading.Event]) -> Optional[int]:
        """Shut `conn`'s socket if `abort` is set while it streams (a blocked read then returns)."""
        if abort is None:
            return None
        with self._lock:
            self._next += 1
            self._watched[self._next] = (conn, abort)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="openai-abort", daemon=True)
                self._watcher.start()
            return self._next

    def unwatch(self, token: Optional[int]) -> None:
        if token is not None:
            with self._lock:
                self._watched.pop(token, None)

    def _watch_loop(self) -> None:
        while not self._closed.wait(_ABORT_POLL_S):
            with self._lock:
                doomed = [conn for conn, abort in self._watched.values() if abort.is_set()]
            for conn in doomed:
                sock = conn.sock
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
