"""Faults survived, nothing leaked (issue 6), against a real tritonserver on loopback.

Cancellation and disconnect storms, overload (unbounded and with `max_queue_size`), a KV pool too
small for the load, fuzzed requests, prompt and output lengths at and past `max_model_len`, model
unload/reload under load, requests that used to kill the engine thread, and the engine thread
dying (offline, by fault injection). Each test checks that every request got exactly one terminal
event (a FINAL response or an error), that the engine then returns to zero running and waiting
requests and zero used KV blocks (cached prefix blocks aside), and that the server still answers.

Bounded: a fixed number of requests per test with output lengths picked so that the file runs in
a few minutes on a 2-core CPU; hypothesis runs a fixed, derandomized set of examples.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from grpc_stream import MODEL, make_inputs, metric, scrape
from prompts import CHAT_PROMPTS, PLAIN_PROMPTS

pytestmark = pytest.mark.server

PROMPTS = CHAT_PROMPTS[:6] + PLAIN_PROMPTS[:4] + PLAIN_PROMPTS[5:]  # the short ones
IDLE_TIMEOUT_S = 15.0  # gauges refresh twice a second

# Variant configs (servers of this module's own, started together: see _variants). No warm-up: the
# variants start in seconds, and warm-up changes no result.
# Warm-up and exact blocks off where few tokens are decoded: they cost load time and change no result.
SMALL_QUEUE = dict(max_num_seqs=2, max_queue_size=4, num_kv_blocks=128, max_model_len=1024, warmup="false",
                   exact_block_weights="false")
TINY_KV = dict(num_kv_blocks=48, max_model_len=512, warmup="false")  # exact blocks on: its many decodes run faster
VARIANTS = {"small_queue": SMALL_QUEUE, "tiny_kv": TINY_KV}


@pytest.fixture(scope="module")
def _variants(request, tmp_path_factory):
    """The variant servers (VARIANTS) that this module's selected tests need, started side by side when the first
    is asked for: a load is mostly one core's work, and a server waiting for its tests uses ~2 % of one. Explicit
    model control, so tests may unload and load the model. Stopped when the module ends."""
    from conftest import write_variant_repo
    from supervised import needed_by, start_together
    from tritonserver_harness import TritonServer

    servers = {}
    for name, params in VARIANTS.items():
        if needed_by(request, f"{name}_server"):
            root = tmp_path_factory.mktemp(f"variant-{name}")
            servers[name] = TritonServer(write_variant_repo(root / "repo", **params), log_path=root / "tritonserver.log",
                                         extra_args=["--model-control-mode=explicit", "--load-model=smollm2"])
    start_together(*servers.values())
    yield servers
    for server in servers.values():
        server.stop_later()


# ---- helpers -------------------------------------------------------------------------------------
class Probe:
    """One request on its own gRPC stream, so that an error is always attributed to it.

    Records every event; `terminals` counts FINAL responses plus errors (exactly one is right),
    `late` counts events after the terminal one (none is right).
    """

    def __init__(self, url: str, request_id: str, inputs: list, parameters: dict | None = None,
                 send: bool = True):
        self.request_id = request_id
        self._lock = threading.Lock()
        self._closing = self._closed = False
        self.done = threading.Event()
        self.finals = 0
        self.errors: list[str] = []
        self.late = 0
        self.responses = 0  # responses that carried outputs
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.num_input_tokens: int | None = None
        self.num_output_tokens: int | None = None
        self.cancelled = False  # we cancelled it before its terminal event
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_event)
        self._request = (inputs, parameters)
        if send:
            self.send()

    def send(self) -> None:
        """Send the request on the stream already open (at once unless the probe was made with send=False)."""
        inputs, parameters = self._request
        self.client.async_stream_infer(MODEL, inputs, request_id=self.request_id, enable_empty_final_response=True,
                                       parameters=parameters)

    @property
    def terminals(self) -> int:
        return self.finals + len(self.errors)

    @property
    def error(self) -> str | None:
        return self.errors[0] if self.errors else None

    def _on_event(self, result=None, error=None) -> None:
        with self._lock:
            if self.terminals:
                if not (error is not None and self._closing):  # our own close after the end is no event
                    self.late += 1
                return
            if error is not None:
                self.errors.append(str(error))
            else:
                self._apply(result)
            if self.terminals:
                self.done.set()

    def _apply(self, result) -> None:
        text = result.as_numpy("text_output")
        if text is not None:
            self.responses += 1
            self.texts += [t.decode("utf-8", "replace") for t in text.reshape(-1)]
            ids = result.as_numpy("output_ids")
            if ids is not None:
                self.ids += ids.tolist()
            reason = result.as_numpy("finish_reason")
            if reason is not None:
                self.finish_reason = reason.reshape(-1)[0].decode()
            value = result.as_numpy("num_input_tokens")
            if value is not None:
                self.num_input_tokens = int(value.reshape(-1)[0])
            value = result.as_numpy("num_output_tokens")
            if value is not None:  # this response's tokens: the request's count is their sum
                self.num_output_tokens = (self.num_output_tokens or 0) + int(value.reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.finals += 1

    def wait(self, timeout: float = 120.0) -> "Probe":
        assert self.done.wait(timeout), f"{self.request_id}: no FINAL response and no error after {timeout:g} s"
        return self

    def cancel(self) -> None:
        """Close the stream abruptly, cancelling the request (gRPC CANCELLED)."""
        with self._lock:
            self.cancelled = not self.terminals
            self._closing = True
        _bounded(lambda: self.client.stop_stream(cancel_requests=True))

    def close(self) -> None:
        """Half-close the stream once the request is over (cancel it if it is not).

        Not a cancel after the end: tritonserver 2.51 leaks a request that its own input checks
        refused (wrong datatype, shape or input name) when the client then cancels the stream,
        and the model can no longer be unloaded (nor the server stop within its exit timeout).
        """
        with self._lock:
            if self._closed:
                return
            self._closing = self._closed = True
            graceful = bool(self.terminals)
        _bounded(lambda: (self.client.stop_stream(cancel_requests=not graceful), self.client.close()))


def _bounded(call, timeout: float = 15.0) -> None:
    """Run a client-side close with a time limit.

    tritonclient's stop_stream joins its stream thread and has no timeout of its own. What these
    tests judge is the server side (responses received, metrics back to idle), so a client-side
    close that got stuck would be left to its daemon thread instead of hanging the suite.
    """
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout)


def wait_all(probes: list[Probe], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for p in probes:
        p.wait(max(0.1, deadline - time.monotonic()))


def close_all(probes: list[Probe]) -> None:
    for p in probes:
        p.close()


def assert_one_terminal_each(probes: list[Probe]) -> None:
    bad = {p.request_id: (p.finals, p.errors, p.late) for p in probes if p.terminals != 1 or p.late}
    assert not bad, f"requests without exactly one FINAL response or error (finals, errors, late events): {bad}"


def busy(samples: dict) -> dict[str, float]:
    return {"running": metric(samples, "llm_requests", state="running"),
            "waiting": metric(samples, "llm_requests", state="waiting"),
            "used_blocks": metric(samples, "llm_kv_cache_blocks", state="used")}


def wait_idle(server, timeout: float = IDLE_TIMEOUT_S, until=None) -> dict[str, float]:
    """Poll /metrics until zero running/waiting requests and used KV blocks with the engine
    thread alive (and `until(samples)`).

    The state must hold on two scrapes more than one gauge refresh apart, so a stale gauge
    cannot pass for an idle engine.
    """
    deadline = time.monotonic() + timeout
    idle_since = None
    while True:
        samples = scrape(server.metrics_url)
        state = {**busy(samples), "engine_alive": metric(samples, "llm_engine_alive")}
        ok = (not any(v for k, v in state.items() if k != "engine_alive") and state["engine_alive"] == 1
              and (until is None or until(samples)))
        now = time.monotonic()
        if ok:
            idle_since = idle_since or now
            if now - idle_since >= 0.6:
                return samples
        else:
            idle_since = None
        assert now < deadline, f"the engine is not back to idle after {timeout:g} s: {state}"
        time.sleep(0.2)


def counter_delta(before: dict, after: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def assert_serves(server, max_tokens: int = 8) -> None:
    """A normal request still gets its full answer."""
    p = Probe(server.grpc_url, "after", make_inputs("The capital of France is",
                                                    sampling={"max_tokens": max_tokens, "ignore_eos": True}))
    try:
        p.wait(120)
    finally:
        p.close()
    assert p.error is None and p.finals == 1, p.errors
    assert len(p.ids) == max_tokens and p.finish_reason == "length"


def wait_responses(probes: list[Probe], at_least: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(p.responses < at_least and not p.terminals for p in probes):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)


# ---- 1. cancellation storm -----------------------------------------------------------------------
def test_cancellation_storm_leaves_nothing_behind(triton_server):
    rng = random.Random(6)
    before = scrape(triton_server.metrics_url)
    probes, cancel_at = [], []
    start = time.monotonic()
    for i in range(24):
        stream = rng.random() < 0.75
        max_tokens = rng.choice([8, 96, 400, 1500])
        probes.append(Probe(triton_server.grpc_url, f"c{i}", make_inputs(
            PROMPTS[i % len(PROMPTS)], stream=stream, sampling={"max_tokens": max_tokens, "ignore_eos": True})))
        # A few are cancelled at once (still in the inbox or waiting), the rest mid-stream, within 2 s
        # (no 400- or 1500-token request ends that soon).
        cancel_at.append(0.0 if i % 6 == 0 else rng.uniform(0.3, 2.0))
    for t, p in sorted(zip(cancel_at, probes), key=lambda item: item[0]):
        time.sleep(max(0.0, start + t - time.monotonic()))
        p.cancel()
    try:
        wait_all(probes, timeout=30)
        assert_one_terminal_each(probes)
    finally:
        close_all(probes)
    # Disjoint: a FINAL can still land between cancel() marking a probe and the stream's close.
    cancelled = [p for p in probes if p.cancelled and not p.finals]
    finished = [p for p in probes if p.finals]
    assert len(cancelled) >= 12, "the storm cancelled too few requests to mean anything"
    assert all("cancel" in p.error.lower() for p in cancelled), [p.error for p in cancelled]
    assert all(p.error is None and len(p.ids) == p.num_output_tokens for p in finished)
    # Server side, every request that got as far as the engine is retired exactly once: the
    # finished ones plus the cancelled ones that had streamed something, at least.
    reached = len(finished) + sum(1 for p in cancelled if p.responses)

    def all_retired(samples):
        return counter_delta(before, samples, "llm_requests_finished_total") >= reached

    after = wait_idle(triton_server, until=all_retired)
    assert counter_delta(before, after, "llm_requests_finished_total") <= len(probes)
    assert counter_delta(before, after, "llm_requests_finished_total", reason="abort") >= 1
    assert counter_delta(before, after, "llm_request_errors_total") == 0
    assert_serves(triton_server)


# ---- 2. disconnect storm -------------------------------------------------------------------------
_DISCONNECTING_CLIENT = r"""
import sys, time
import numpy as np
import tritonclient.grpc as grpcclient

url, n = sys.argv[1], int(sys.argv[2])
started = {}
clients = []
def tensor(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t
for i in range(n):
    stream = i % 4 != 3  # one in four not streaming: nothing comes back until it ends
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result=None, error=None, i=i: started.setdefault(i, error))
    inputs = [tensor("text_input", np.array([f"Story number {i}: once upon a time".encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL"),
              tensor("sampling_parameters", np.array([b'{"max_tokens": 1500, "ignore_eos": true}'], dtype=np.object_), "BYTES")]
    c.async_stream_infer("smollm2", inputs, request_id=f"d{i}")
    clients.append((c, stream))
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not all(i in started for i, (c, s) in enumerate(clients) if s):
    time.sleep(0.05)
print("READY" if all(i in started for i, (c, s) in enumerate(clients) if s) else "TIMEOUT", flush=True)
time.sleep(600)  # until SIGKILL
"""


def test_disconnect_storm_aborts_what_the_dead_clients_asked_for(triton_server):
    n = 12
    before = scrape(triton_server.metrics_url)
    child = subprocess.Popen([sys.executable, "-c", _DISCONNECTING_CLIENT, triton_server.grpc_url, str(n)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bystanders = []
    try:
        ready, _, _ = select.select([child.stdout], [], [], 90)
        line = child.stdout.readline().strip() if ready else ""
        assert line == "READY", f"the disconnecting client did not start its streams: {line!r} {child.stderr.read() if child.poll() is not None else ''}"
        bystanders = [Probe(triton_server.grpc_url, f"b{i}", make_inputs(
            PROMPTS[i], stream=bool(i % 2), sampling={"max_tokens": 32, "ignore_eos": True})) for i in range(4)]
        time.sleep(0.5)  # the dead client's requests are mid-generation, the bystanders arriving
    finally:
        os.kill(child.pid, signal.SIGKILL)  # abrupt: no stream close, no cancel, sockets just go
        child.wait(30)
        child.stdout.close()
        child.stderr.close()
    try:
        wait_all(bystanders, timeout=120)
        assert_one_terminal_each(bystanders)
    finally:
        close_all(bystanders)
    assert all(p.error is None and len(p.ids) == 32 for p in bystanders), [p.errors for p in bystanders]
    # 1500-token requests cannot have finished: each dead client's request must have been aborted.
    after = wait_idle(triton_server, until=lambda s: counter_delta(before, s, "llm_requests_finished_total",
                                                                   reason="abort") >= n)
    assert counter_delta(before, after, "llm_requests_finished_total", reason="abort") == n
    assert counter_delta(before, after, "llm_requests_finished_total", reason="length") == len(bystanders)
    assert_serves(triton_server)


# ---- 3. overload ---------------------------------------------------------------------------------
def test_requests_beyond_capacity_queue_and_all_finish(triton_server):
    # More than max_num_seqs (64) sent together, each long enough (32 steps of a full batch, seconds,
    # against the metrics' 0.5 s refresh: the gauge showed requests waiting for 3-4 s on a 2-core
    # machine) that the last 8 wait for the first 64. Every stream is opened before the first send:
    # opened and sent one by one on a slow machine, short requests finished before the last ones
    # arrived, and none ever waited.
    n, max_tokens = 72, 32
    before = scrape(triton_server.metrics_url)
    max_waiting = [0.0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            max_waiting[0] = max(max_waiting[0], busy(scrape(triton_server.metrics_url))["waiting"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    probes = [Probe(triton_server.grpc_url, f"o{i}", make_inputs(
        f"{PROMPTS[i % len(PROMPTS)]} ({i})", stream=bool(i % 3), sampling={"max_tokens": max_tokens, "ignore_eos": True}),
        send=False) for i in range(n)]
    try:
        for p in probes:
            p.send()
        wait_all(probes, timeout=180)
        assert_one_terminal_each(probes)
    finally:
        stop.set()
        watcher.join()
        close_all(probes)
    assert all(p.error is None and len(p.ids) == max_tokens for p in probes), [p.error for p in probes if p.error]
    assert max_waiting[0] > 0, "no request ever waited: the load did not exceed capacity"
    after = wait_idle(triton_server)
    assert counter_delta(before, after, "llm_requests_finished_total", reason="length") == n
    assert counter_delta(before, after, "llm_request_errors_total") == 0
    assert_serves(triton_server)


@pytest.fixture
def small_queue_server(_variants):
    return _variants["small_queue"]


def test_a_full_queue_answers_unavailable_and_the_rest_finish(small_queue_server):
    server = small_queue_server
    n, max_tokens = 16, 16
    before = scrape(server.metrics_url)
    # Every stream opened first, then all sent together: a burst, however slow the machine opens streams
    # (the 16 sends take milliseconds; the first request to end needs 16 steps after its prompt).
    probes = [Probe(server.grpc_url, f"q{i}", make_inputs(
        PROMPTS[i % len(PROMPTS)], stream=bool(i % 2), sampling={"max_tokens": max_tokens, "ignore_eos": True}),
        send=False) for i in range(n)]
    try:
        for p in probes:
            p.send()
        wait_all(probes, timeout=120)
        assert_one_terminal_each(probes)
    finally:
        close_all(probes)
    rejected = [p for p in probes if p.error]
    served = [p for p in probes if not p.error]
    # max_num_seqs=2 run, max_queue_size=4 wait: the rest of a burst of 16 cannot all fit.
    assert rejected, "no request was refused"
    assert all("queue is full" in p.error for p in rejected), [p.error for p in rejected]
    assert all(p.responses == 0 for p in rejected)
    assert len(served) >= SMALL_QUEUE["max_queue_size"]
    assert all(len(p.ids) == max_tokens and p.finish_reason == "length" for p in served)
    after = wait_idle(server)
    assert counter_delta(before, after, "llm_request_errors_total", kind="unavailable") == len(rejected)
    assert counter_delta(before, after, "llm_requests_finished_total", reason="length") == len(served)
    assert_serves(server)


# ---- 7. unload/reload under load -----------------------------------------------------------------
def _model_state(admin) -> str:
    index = admin.get_model_repository_index(as_json=True).get("models", [])
    return next((m.get("state", "") for m in index if m["name"] == MODEL), "")


def test_unload_under_load_ends_every_stream_and_reload_serves(small_queue_server):
    server = small_queue_server
    admin = grpcclient.InferenceServerClient(server.grpc_url)
    # Two run (max_num_seqs=2) with 22 tokens or more still to come when the unload is sent, two wait behind them.
    max_tokens = 24
    probes = [Probe(server.grpc_url, f"u{i}", make_inputs(
        PROMPTS[i], stream=i != 3, sampling={"max_tokens": max_tokens, "ignore_eos": True})) for i in range(4)]
    try:
        wait_responses(probes[:2], at_least=2)  # two running (max_num_seqs=2), two waiting
        admin.unload_model(MODEL)  # returns at once; Triton lets the requests in flight finish
        probes.append(Probe(server.grpc_url, "during", make_inputs("Hello", sampling={"max_tokens": 4})))
        wait_all(probes, timeout=120)
        assert_one_terminal_each(probes)
        deadline = time.monotonic() + 30
        while admin.is_model_ready(MODEL):
            assert time.monotonic() < deadline, "the model is still ready after unload"
            time.sleep(0.2)
        # tritonserver 2.51 completes the unload (calls finalize) only once the client streams
        # that carried requests to the model are closed.
        close_all(probes)
        deadline = time.monotonic() + 30
        while _model_state(admin) != "UNAVAILABLE":
            assert time.monotonic() < deadline, f"the unload did not complete: {_model_state(admin)}"
            time.sleep(0.2)
        refused = Probe(server.grpc_url, "refused", make_inputs("Hello", sampling={"max_tokens": 4}))
        probes.append(refused)
        refused.wait(30)
        assert refused.error is not None  # unloaded: refused, not left hanging
        admin.load_model(MODEL)
        assert admin.is_model_ready(MODEL)
    finally:
        close_all(probes)
        admin.close()
    for p in probes[:4]:
        # Triton waits for requests in flight before finalize; an error is allowed, a hang is not.
        assert p.error is not None or (len(p.ids) == max_tokens and p.finish_reason == "length"), (p.request_id, p.errors)
    wait_idle(server)
    assert_serves(server)


# ---- 4. a KV pool too small for the load ---------------------------------------------------------
@pytest.fixture
def tiny_kv_server(_variants):
    return _variants["tiny_kv"]


def test_tiny_kv_pool_preempts_and_everyone_finishes(tiny_kv_server):
    server = tiny_kv_server
    # 16 x 86-100 tokens (prompts of 6-20), 6-7 blocks each, against 48 blocks x 16 = 768 token slots:
    # all 16 are admitted together (their prompts take 16 blocks), grow in step, and need twice the pool
    # long before any ends, so preemption is certain (and asserted below). Every stream is opened before
    # the first send, so the burst arrives together however slowly the streams open.
    n, max_tokens = 16, 80
    before = scrape(server.metrics_url)
    probes = [Probe(server.grpc_url, f"k{i}", make_inputs(
        f"Story {i}: {PROMPTS[i % len(PROMPTS)]}", stream=bool(i % 4),
        sampling={"max_tokens": max_tokens, "ignore_eos": True}), send=False) for i in range(n)]
    try:
        for p in probes:
            p.send()
        wait_all(probes, timeout=480)  # ~130 steps of up to 8 sequences plus recomputed prefixes, on 2 shared cores
        assert_one_terminal_each(probes)
    finally:
        close_all(probes)
    assert all(p.error is None for p in probes), [p.error for p in probes if p.error]
    assert all(len(p.ids) == max_tokens == p.num_output_tokens and p.finish_reason == "length" for p in probes)
    after = wait_idle(server)
    assert counter_delta(before, after, "llm_preemptions_total") > 0
    assert counter_delta(before, after, "llm_requests_finished_total", reason="length") == n
    assert_serves(server)


# ---- 6. lengths at and past max_model_len --------------------------------------------------------
def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _one(server, request_id: str, **kwargs) -> Probe:
    p = Probe(server.grpc_url, request_id, make_inputs(**kwargs))
    try:
        p.wait(120)
    finally:
        p.close()
    assert_one_terminal_each([p])
    return p


def test_prompt_and_output_lengths_at_and_past_max_model_len(tiny_kv_server):
    server = tiny_kv_server
    limit = TINY_KV["max_model_len"]
    # prompt + max_tokens == max_model_len: all of max_tokens.
    p = _one(server, "at", input_ids=_ids(limit - 100, 1), sampling={"max_tokens": 100, "ignore_eos": True})
    assert p.error is None and p.num_input_tokens == limit - 100
    assert len(p.ids) == 100 and p.finish_reason == "length"
    # A prompt of max_model_len - 1 tokens: room for exactly one token.
    p = _one(server, "last", input_ids=_ids(limit - 1, 2), sampling={"max_tokens": 50, "ignore_eos": True})
    assert p.error is None and len(p.ids) == 1 and p.finish_reason == "length"
    # A prompt of max_model_len tokens: no room for any, INVALID_ARG naming the limit.
    p = _one(server, "full", input_ids=_ids(limit, 3), sampling={"max_tokens": 1})
    assert p.error is not None and "max_model_len" in p.error and p.responses == 0
    # max_tokens far past the limit (and past 64 bits): generation ends at max_model_len.
    for request_id, max_tokens in (("huge", 10**9), ("huger", 10**30)):
        p = _one(server, request_id, input_ids=_ids(limit - 32, 4), stream=request_id == "huge",
                 sampling={"max_tokens": max_tokens, "ignore_eos": True})
        assert p.error is None and p.finish_reason == "length", p.errors
        assert len(p.ids) == 32 and p.num_input_tokens + p.num_output_tokens == limit
    wait_idle(server)
    assert_serves(server)


# ---- 5. fuzzed requests --------------------------------------------------------------------------
_FLAGS = ("stream", "exclude_input_in_output", "apply_chat_template", "return_finish_reason",
          "return_num_input_tokens", "return_num_output_tokens", "return_logprobs", "return_cumulative_logprob")
_NOT_A_COUNT = st.one_of(st.none(), st.booleans(), st.integers(max_value=0), st.floats(allow_nan=True),
                         st.text(alphabet=st.characters(blacklist_categories=("Nd", "Cs")), max_size=6),
                         st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
_JUNK = st.one_of(_NOT_A_COUNT, st.integers(), st.text(max_size=6))
# Valid counts stay small so that every example is bounded (<= 16 tokens).
_SAMPLING = st.fixed_dictionaries({}, optional={
    # Not null: that is vLLM's "up to max_model_len", which would not keep the examples bounded.
    "max_tokens": st.one_of(st.integers(1, 8), st.sampled_from(["3", "-2", " 4"]), _NOT_A_COUNT.filter(lambda v: v is not None)),
    "min_tokens": st.one_of(st.integers(0, 8), _NOT_A_COUNT),
    "ignore_eos": st.one_of(st.booleans(), _JUNK),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), _JUNK),
    "stop_token_ids": st.one_of(st.lists(st.integers(), max_size=3), st.lists(st.integers(0, 49151), max_size=3), _JUNK),
    "temperature": st.one_of(st.floats(allow_nan=True), st.integers(), st.sampled_from([0, 0.7, "0.5", "hot"]), _JUNK),
    "top_k": st.one_of(st.integers(), _JUNK),
    "top_p": st.one_of(st.floats(allow_nan=True), _JUNK),
    "seed": st.one_of(st.integers(), st.integers(-(2**70), 2**70), _JUNK),
    "priority": st.one_of(st.integers(), _JUNK),
    "skip_special_tokens": st.one_of(st.booleans(), _JUNK),
    "logprobs": st.one_of(st.booleans(), _JUNK),
    "detokenize": st.one_of(st.booleans(), _JUNK),
    "spaces_between_special_tokens": st.one_of(st.booleans(), _JUNK),
    "stream_interval": st.one_of(st.integers(-1, 4), _JUNK),
    "max_tokenz": _JUNK,
})
_SAMPLING_TEXT = st.one_of(
    st.none(),  # no sampling_parameters input
    _SAMPLING.map(json.dumps),
    st.sampled_from(["", "   ", "{", "[]", "null", "3", '"x"', "{max_tokens: 3}", '{"max_tokens": NaN}']),
    st.text(max_size=24),
)
_PROMPT = st.one_of(
    st.text(max_size=48),  # any unicode, control characters and NUL included (no lone surrogates)
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x1F), max_size=16),
    st.binary(max_size=32),  # may be invalid UTF-8
    st.none(),
)
_INPUT_IDS = st.one_of(st.none(), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
                       st.lists(st.integers(0, 49151), min_size=1, max_size=8))
# Requests that tritonserver's own input checks refuse (datatype, shape, unknown input), now and then.
_MANGLE = st.sampled_from([None] * 6 + ["flag_as_int32", "two_texts", "ids_as_int64", "flag_shape_2", "unknown_input"])
_REQUEST_PARAMETERS = st.one_of(st.none(), st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(1, 8), st.integers(-(2**63), 0), st.sampled_from(["2", "x"])),
    "stream": st.one_of(st.booleans(), st.sampled_from(["true", "maybe", "0"])),
    "temperature": st.sampled_from(["0.5", "warm", "0"]),
    "return_finish_reason": st.one_of(st.booleans(), st.integers(0, 3)),
}))

FUZZ_CASES = st.fixed_dictionaries({
    "prompt": _PROMPT, "input_ids": _INPUT_IDS, "sampling": _SAMPLING_TEXT, "mangle": _MANGLE,
    "flags": st.fixed_dictionaries({}, optional={name: st.booleans() for name in _FLAGS}),
    "parameters": _REQUEST_PARAMETERS,
})


def _tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _fuzz_inputs(case: dict) -> list:
    mangle = case["mangle"]
    inputs = []
    prompt = case["prompt"]
    if prompt is not None:
        raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
        texts = [raw, raw] if mangle == "two_texts" else [raw]
        inputs.append(_tensor("text_input", np.array(texts, dtype=np.object_), "BYTES"))
    if case["input_ids"] is not None:
        if mangle == "ids_as_int64":
            inputs.append(_tensor("input_ids", np.asarray(case["input_ids"], dtype=np.int64), "INT64"))
        else:
            inputs.append(_tensor("input_ids", np.asarray(case["input_ids"], dtype=np.int32), "INT32"))
    if mangle == "unknown_input":
        inputs.append(_tensor("text_inputz", np.array([b"x"], dtype=np.object_), "BYTES"))
    if case["sampling"] is not None:
        inputs.append(_tensor("sampling_parameters", np.array([case["sampling"].encode("utf-8")], dtype=np.object_), "BYTES"))
    for i, (name, value) in enumerate(sorted(case["flags"].items())):
        if mangle == "flag_as_int32" and i == 0:
            inputs.append(_tensor(name, np.array([int(value)], dtype=np.int32), "INT32"))
        elif mangle == "flag_shape_2" and i == 0:
            inputs.append(_tensor(name, np.array([value, value]), "BOOL"))
        else:
            inputs.append(_tensor(name, np.array([value]), "BOOL"))
    return inputs


def test_fuzzed_requests_get_a_final_response_or_invalid_arg(triton_server):
    before = scrape(triton_server.metrics_url)
    count = [0]
    seen = {"ok": 0, "error": 0}

    @settings(max_examples=40, deadline=None, database=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    # Requests that used to kill the engine thread (see the tests below), always tried.
    @example(case={"prompt": "Hi", "input_ids": None, "mangle": None, "flags": {}, "parameters": None,
                   "sampling": json.dumps({"temperature": 0.5, "seed": 2**60, "max_tokens": 2})})
    @example(case={"prompt": "Hi", "input_ids": None, "mangle": None, "flags": {}, "parameters": None,
                   "sampling": json.dumps({"min_tokens": 1, "stop_token_ids": [2**40], "max_tokens": 2})})
    # Not streaming, the prompt's text leads the output: negative ids once failed to decode as an internal error.
    @example(case={"prompt": None, "input_ids": [-1258, -37487, 571], "mangle": None, "flags": {}, "parameters": {},
                   "sampling": None})
    @given(case=FUZZ_CASES)
    def run(case):
        count[0] += 1
        p = Probe(triton_server.grpc_url, f"fz{count[0]}", _fuzz_inputs(case), parameters=case["parameters"])
        try:
            p.wait(60)
        finally:
            p.close()
        assert_one_terminal_each([p])
        if p.error is None:
            seen["ok"] += 1
            assert p.num_output_tokens is None or p.num_output_tokens <= 16
        else:
            seen["error"] += 1
            # An INVALID_ARG from the model or from Triton's own input checks; never an
            # internal error, a dead engine or a refusal.
            lowered = p.error.lower()
            assert "internal error" not in lowered and "engine is not running" not in lowered, p.error
            assert "unavailable" not in lowered and "queue is full" not in lowered, p.error

    run()
    after = wait_idle(triton_server)
    assert counter_delta(before, after, "llm_request_errors_total", kind="internal") == 0
    assert counter_delta(before, after, "llm_request_errors_total", kind="unavailable") == 0
    assert seen["ok"] and seen["error"], seen  # the examples reached both sides
    assert_serves(triton_server)


# ---- 8. health: the engine thread dying ----------------------------------------------------------
# Each of these once passed validation, then raised inside a step: the engine thread died, every
# request in flight failed, and every later request was refused until the model was reloaded.
# Any integer seed is valid now (folded into 64 bits); stop token ids must be in the vocabulary.
POISON = {
    "seed past 64 bits once mixed": ({"temperature": 0.7, "seed": 10**14, "max_tokens": 4}, None),
    "negative seed past 64 bits": ({"temperature": 0.7, "seed": -(10**14), "max_tokens": 4}, None),
    "stop token id past the vocabulary": ({"min_tokens": 2, "stop_token_ids": [10**9], "max_tokens": 4}, "stop_token_ids"),
    "stop token id past int64": ({"min_tokens": 2, "stop_token_ids": [2**70], "max_tokens": 4}, "stop_token_ids"),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_requests_that_killed_the_engine_are_served_or_refused_alone(triton_server, case):
    sampling, refused_for = POISON[case]
    bystander = Probe(triton_server.grpc_url, "bystander", make_inputs(
        "The three laws of thermodynamics are", sampling={"max_tokens": 24, "ignore_eos": True}))
    try:
        wait_responses([bystander], at_least=1)
        poison = _one(triton_server, "poison", text="Hello", sampling=sampling)
        bystander.wait(120)
        assert_one_terminal_each([bystander])
    finally:
        bystander.close()
    if refused_for is None:
        assert poison.error is None and len(poison.ids) == 4, poison.error
    else:
        assert poison.error is not None and refused_for in poison.error, poison.error
    assert bystander.error is None and len(bystander.ids) == 24
    wait_idle(triton_server)
    assert_serves(triton_server, max_tokens=4)


def test_top_k_past_int64_samples_like_no_limit(triton_server):
    # Also used to kill the engine (no int64 tensor holds it); a top_k beyond the vocabulary means no limit.
    sampling = {"temperature": 0.7, "seed": 3, "max_tokens": 6, "ignore_eos": True}
    huge = _one(triton_server, "huge_top_k", text="Hello", sampling={**sampling, "top_k": 2**70})
    plain = _one(triton_server, "no_top_k", text="Hello", sampling=sampling)
    assert huge.error is None and plain.error is None, (huge.errors, plain.errors)
    assert huge.ids == plain.ids
    assert_serves(triton_server, max_tokens=4)


@pytest.fixture(scope="module")
def small_engine(model_dir):
    """A small engine of its own: these tests break it on purpose."""
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    return Engine(EngineConfig.from_parameters(model=str(model_dir), num_kv_blocks=64, max_model_len=512, max_num_seqs=2,
                               warmup=False, exact_block_weights=False))  # a quick load: few tokens are decoded


class _Outputs:
    def __init__(self):
        self.items = []
        self.done = threading.Event()

    def __call__(self, out):
        self.items.append(out)
        if out.finished:
            self.done.set()


def _broken_execute(inputs):
    raise RuntimeError("injected device fault")


@pytest.mark.engine
def test_engine_thread_dying_fails_every_request_and_refuses_new_ones(small_engine, monkeypatch):
    from tritonllm.engine.engine_loop import EngineDeadError, EngineLoop
    from tritonllm.core.sampling_params import SamplingParams

    engine = small_engine
    loop = EngineLoop(engine)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    outs = [_Outputs() for _ in range(4)]
    try:
        for i, cb in enumerate(outs):
            loop.submit(cb, f"Story {i}: once upon a time", params)
        deadline = time.monotonic() + 60
        while not (outs[0].items and outs[1].items):  # two running (max_num_seqs=2), two waiting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(engine.runner, "execute", _broken_execute)
        died = time.monotonic()
        for cb in outs:
            assert cb.done.wait(5), "an in-flight request got no error output"
        assert time.monotonic() - died < 5
        for cb in outs:
            finals = [o for o in cb.items if o.finished]
            assert len(finals) == 1 and "injected device fault" in finals[0].error
            assert finals[0].error_kind == "EngineDeadError"
        assert not loop.alive and "injected device fault" in loop.error
        with pytest.raises(EngineDeadError, match="injected device fault"):
            loop.submit(_Outputs(), "Hello", SamplingParams(max_tokens=2))
        # Nothing leaked even though the engine died mid-step.
        assert not engine.has_unfinished()
        assert engine.block_manager.stats()["used"] == 0
    finally:
        loop.shutdown(timeout_s=10)
    monkeypatch.undo()
    [done] = engine.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(done.token_ids) == 3  # the engine object itself is still usable


@pytest.mark.engine
def test_a_request_submitted_while_the_engine_dies_is_not_lost(small_engine, monkeypatch):
    """submit() checks the loop is alive, then tokenizes, then queues: the loop may die in between.

    The request must then be refused (EngineDeadError) or answered with an error, never queued
    into an inbox nobody drains again.
    """
    from tritonllm.engine.engine_loop import EngineDeadError, EngineLoop
    from tritonllm.core.sampling_params import SamplingParams

    engine = small_engine
    loop = EngineLoop(engine)
    running = _Outputs()
    late = _Outputs()
    tokenizing, release = threading.Event(), threading.Event()
    make_sequence = engine.make_sequence

    def slow_make_sequence(*args, **kwargs):
        seq = make_sequence(*args, **kwargs)
        if kwargs.get("request_id") == "late":
            tokenizing.set()
            release.wait(10)
        return seq

    raised = []

    def submit_late():
        try:
            loop.submit(late, "Hello", SamplingParams(max_tokens=2), request_id="late")
        except EngineDeadError as exc:
            raised.append(exc)

    try:
        loop.submit(running, "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
        monkeypatch.setattr(engine, "make_sequence", slow_make_sequence)
        submitter = threading.Thread(target=submit_late)
        submitter.start()
        assert tokenizing.wait(10)  # past the alive check, not yet queued
        monkeypatch.setattr(engine.runner, "execute", _broken_execute)
        assert running.done.wait(10)
        deadline = time.monotonic() + 5
        while loop._thread.is_alive():  # noqa: SLF001 - wait for the loop to have finished dying
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        submitter.join(10)
        assert raised or late.done.wait(5), "the request submitted as the engine died was lost"
        if not raised:
            assert late.items[-1].error
    finally:
        release.set()
        loop.shutdown(timeout_s=10)
    monkeypatch.undo()
    assert not engine.has_unfinished() and engine.block_manager.stats()["used"] == 0
