"""Locust load test for the Triton LLM model over gRPC streaming (tritonclient), gevent-safe.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host 127.0.0.1:8001 \
        --csv results/locust --html results/locust.html
    locust -f loadtest/locustfile.py --host 127.0.0.1:8001        # web UI on http://127.0.0.1:8089

Each simulated user sends one streaming request at a time, drawn from a workload scenario's
prompt/output length distributions (prompts and lengths per user are deterministic), then waits
`--triton-wait` seconds on average. Locust entries (request type "grpc"):
  ttft          time to first token (ms)
  e2e           whole request (ms); its "size" is the number of output tokens received
  tpot          mean time per output token after the first (ms), for requests with >= 2 tokens
Failures (error responses, broken streams, timeouts, wrong token counts with ignore_eos) are
reported on "e2e" with the error message. Output tokens/s over the run is printed at the end.

Options (command line, web UI, or environment):
  --triton-model     TRITONLLM_MODEL     model name (default smollm2)
  --triton-scenario  TRITONLLM_SCENARIO  scenario YAML (default loadtest/scenarios/chat_mixed.yaml)
  --triton-wait      TRITONLLM_WAIT      mean wait between a user's requests in s (default 0.5)
  --triton-timeout   TRITONLLM_TIMEOUT   per-request timeout in s (default 300)
"""

# grpc must switch to gevent-cooperative I/O before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
from locust import User, events, task  # noqa: E402

from tritonllm_client.locust_exit import exit_before_finalizers  # noqa: E402
from tritonllm_client.stream import (  # noqa: E402
    DEFAULT_MODEL,
    DEFAULT_URL,
    ClientError,
    GenerationParams,
    StreamingClient,
    normalize_url,
)
from tritonllm_client.workload import RequestSampler, load_scenario  # noqa: E402

REQUEST_TYPE = "grpc"
DEFAULT_SCENARIO = "loadtest/scenarios/chat_mixed.yaml"
_user_ids = itertools.count()
_scenarios: dict = {}
_totals = {"tokens": 0, "requests": 0, "first_send": None, "last_end": None}


class GrpcStreamError(Exception):
    """An error response, broken stream or timeout on a streaming request."""


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--triton-model", type=str, env_var="TRITONLLM_MODEL", default=DEFAULT_MODEL,
                        help="Triton model name")
    parser.add_argument("--triton-scenario", type=str, env_var="TRITONLLM_SCENARIO", default=DEFAULT_SCENARIO,
                        help="workload scenario YAML (prompt/output length distributions)")
    parser.add_argument("--triton-wait", type=float, env_var="TRITONLLM_WAIT", default=0.5,
                        help="mean seconds a user waits between requests (uniform in [0, 2x])")
    parser.add_argument("--triton-timeout", type=float, env_var="TRITONLLM_TIMEOUT", default=300.0,
                        help="per-request timeout in seconds")


def _scenario(path: str):
    """Load (once) a scenario; relative paths are tried from the cwd, then from the repo root."""
    if path not in _scenarios:
        p = Path(path)
        if not p.is_absolute() and not p.exists():
            p = Path(__file__).resolve().parent.parent / path
        _scenarios[path] = load_scenario(p)
    return _scenarios[path]


def _option(env, name: str, default):
    value = getattr(env.parsed_options, name, None) if env.parsed_options is not None else None
    return default if value in (None, "") else value


def _scenario_path(env) -> str:
    return str(_option(env, "triton_scenario", os.environ.get("TRITONLLM_SCENARIO", DEFAULT_SCENARIO)))


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    _totals.update(tokens=0, requests=0, first_send=None, last_end=None)
    path = _scenario_path(environment)
    try:
        _scenario(path)
    except (OSError, ValueError) as e:  # one clear line, then stop instead of failing every user
        logging.error("tritonllm: cannot load scenario %s: %s", path, e)
        environment.process_exit_code = 1
        runner = environment.runner
        if runner is not None:
            gevent.spawn_later(0.1, runner.quit if environment.parsed_options.headless else runner.stop)


@events.quit.add_listener
def _exit_without_finalizers(exit_code, **_kw):
    """tritonclient's channel close at interpreter teardown can block for ever under gevent (locust_exit.py)."""
    exit_before_finalizers(exit_code)


@events.test_stop.add_listener
def _print_totals(environment, **_kw):
    if _totals["requests"] and _totals["first_send"] is not None and _totals["last_end"] is not None:
        span = max(_totals["last_end"] - _totals["first_send"], 1e-9)
        print(f"[tritonllm] {_totals['requests']} requests ok, {_totals['tokens']} output tokens in "
              f"{span:.1f} s: {_totals['tokens'] / span:.1f} output tokens/s, "
              f"{_totals['requests'] / span:.2f} requests/s", flush=True)


class TritonLLMUser(User):
    """One chat user: a streaming gRPC request at a time against `--host` (host:port)."""

    host = DEFAULT_URL

    def wait_time(self):
        mean = float(_option(self.environment, "triton_wait", 0.5))
        return self._rng.uniform(0.0, 2.0 * mean) if mean > 0 else 0.0

    def on_start(self):
        env = self.environment
        self.user_id = next(_user_ids)
        self._rng = random.Random(f"wait-{self.user_id}")
        self.model = str(_option(env, "triton_model", os.environ.get("TRITONLLM_MODEL", DEFAULT_MODEL)))
        self.timeout_s = float(_option(env, "triton_timeout", 300.0))
        try:
            self.scenario = _scenario(_scenario_path(env))
        except (OSError, ValueError):  # reported once by _on_test_start, which stops the run
            self.scenario = None
            return
        self.sampler = RequestSampler(self.scenario, self.user_id)
        self.url = normalize_url(self.host or DEFAULT_URL)
        self.client = StreamingClient(self.url, self.model)

    client = None
    scenario = None

    def on_stop(self):
        client = self.client
        if client is not None:
            client.close()

    def _fire(self, name: str, ms: float, length: int, error: str | None = None):
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=name, response_time=ms, response_length=length,
            exception=GrpcStreamError(error) if error else None, context={"user": getattr(self, "user_id", None)},
        )

    @task
    def generate(self):
        if self.scenario is None:
            gevent.sleep(1.0)
            return
        spec = self.sampler.next()
        sc = self.scenario
        params = GenerationParams(max_tokens=spec.max_tokens, ignore_eos=sc.ignore_eos,
                                  temperature=sc.temperature, chat=sc.chat_template)
        start = time.perf_counter()
        try:
            res = self.client.generate(spec.prompt, params, timeout_s=self.timeout_s,
                                       request_id=f"locust-{self.user_id}-{spec.index}")
        except ClientError as e:  # server or model not reachable / not ready
            self._fire("e2e", (time.perf_counter() - start) * 1000.0, 0, str(e))
            return
        n = res.num_output_tokens
        if not res.ok:
            self._fire("e2e", ((res.end_time or time.perf_counter()) - res.send_time) * 1000.0, n, res.error)
            return
        if res.ttft is not None:
            self._fire("ttft", res.ttft * 1000.0, 0)
        if res.tpot is not None:
            self._fire("tpot", res.tpot * 1000.0, 0)
        error = None
        if sc.ignore_eos and n != spec.max_tokens:
            error = f"expected {spec.max_tokens} output tokens with ignore_eos, got {n}"
        self._fire("e2e", res.e2e * 1000.0, n, error)
        if error is None:
            _totals["requests"] += 1
            _totals["tokens"] += n
            first = _totals["first_send"]
            _totals["first_send"] = res.send_time if first is None else min(first, res.send_time)
            last = _totals["last_end"]
            _totals["last_end"] = res.end_time if last is None else max(last, res.end_time)
