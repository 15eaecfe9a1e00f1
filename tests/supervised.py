"""Test helper: `tritonllm-serve` (the supervised server, as `bash scripts/serve.sh` runs it) on free loopback
ports, its processes, and one-request gRPC streams that record when and how each request ended."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tritonllm.serving.tritonserver_process import assemble_backend_dir, pick_ports

REPO = Path(__file__).resolve().parent.parent

# Small and quick to load (a few seconds on an idle 2-core machine): these servers are killed and
# reloaded on purpose. Exact-block detection and warm-up change speed only, not what is tested here.
FAST = dict(warmup="false", exact_block_weights="false", num_kv_blocks=256, max_model_len=1024)


def make_repository(dest: Path, with_minilm: bool = True, **params) -> Path:
    """model_repository's smollm2 with `params` set (conftest.write_variant_repo), and minilm beside it."""
    from conftest import write_variant_repo

    write_variant_repo(dest, **params)
    if with_minilm:
        shutil.copytree(REPO / "model_repository" / "minilm", dest / "minilm", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _proc(pid: int) -> tuple[int, str, list[str]] | None:
    """(parent pid, state, argv) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], argv


def children(pid: int) -> list[tuple[int, list[str]]]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _proc(int(entry))
            if info is not None and info[0] == pid and info[1] != "Z":
                found.append((int(entry), info[2]))
    return found


def get(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 10) -> tuple[int | None, str]:
    request = urllib.request.Request(url, method=method, data=body)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return None, repr(exc)


class Supervised:
    """`tritonllm-serve --model-repository REPO` as a child process; `start()`, `signal()`, `wait()`."""

    def __init__(self, repository: Path, log_path: Path, *extra: str, startup_timeout: float = 600):
        self.repository = Path(repository)
        self.log_path = Path(log_path)
        self.http_port, self.grpc_port, self.metrics_port = pick_ports(None, None, None)
        self.extra, self.startup_timeout = extra, startup_timeout
        self.process: subprocess.Popen | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def story(self, last: int = 40) -> str:
        """The supervisor's own lines and tritonserver's crash reports, for an assertion's message."""
        lines = [line for line in self.log_text().splitlines()
                 if "tritonllm-serve" in line or "Signal (" in line or "orphan guard" in line]
        return "\n".join(lines[-last:])

    def start(self) -> "Supervised":
        cmd = [sys.executable, "-m", "tritonllm.serving.launcher", "--model-repository", str(self.repository),
               "--no-prepare", "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port), *self.extra]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonllm-serve exited with {self.process.returncode} while starting:\n"
                                   + "\n".join(self.log_text().splitlines()[-40:]))
            if self.ready():
                return self
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"tritonllm-serve not ready after {self.startup_timeout:g} s:\n"
                           + "\n".join(self.log_text().splitlines()[-40:]))

    def ready(self, model: str | None = None) -> bool:
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        return get(self.http + path, timeout=5)[0] == 200

    def wait_ready(self, model: str, timeout: float) -> float:
        """Seconds until `model` is ready again (asserts it is within `timeout`)."""
        started = time.monotonic()
        while not self.ready(model):
            assert self.process.poll() is None, "tritonllm-serve exited"
            assert time.monotonic() - started < timeout, f"{model} not ready again after {timeout:g} s:\n" + \
                "\n".join(self.log_text().splitlines()[-30:])
            time.sleep(0.25)
        return time.monotonic() - started

    def server_pid(self) -> int:
        """tritonserver's pid (the launcher's child)."""
        found = [pid for pid, argv in children(self.process.pid) if argv and argv[0].endswith("/tritonserver")]
        assert len(found) == 1, found
        return found[0]

    def stubs(self, model: str) -> list[int]:
        """The stub processes of this server's `model` (children of its tritonserver only)."""
        folder = str(self.repository.resolve() / model) + os.sep
        return [pid for pid, argv in children(self.server_pid())
                if len(argv) > 1 and argv[0].endswith("triton_python_backend_stub") and argv[1].startswith(folder)]

    def tp_workers(self, model: str = "smollm2") -> list[int]:
        return [pid for stub in self.stubs(model) for pid, argv in children(stub) if "tritonllm.runner.tp_worker" in argv]

    def metric(self, name: str, **labels) -> float:
        from grpc_stream import metric, scrape

        return metric(scrape(self.metrics_url), name, **labels)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """For cleanup only: the launcher, and tritonserver with it (its parent-death signal)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def stop(self, timeout: float = 120) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode


def start_together(*servers) -> None:
    """start() each server (Supervised or TritonServer) on its own thread, all at once; raise the first failure
    after every start has ended, the ones that did start stopped. A load is mostly one core's work (imports, the
    tokenizer, the weights), so on a machine of two or more cores loads side by side take little more than one."""
    assemble_backend_dir()  # once first: its copies' temporary names are per process, not per thread
    failures: list[BaseException] = []

    def start(server) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(700)  # past any startup_timeout
    if failures:
        stop_together(*servers)
        raise failures[0]


def stop_together(*servers) -> None:
    """stop() the servers (each as its own stop() bounds it) at once: each stop is mostly waiting."""
    threads = [threading.Thread(target=server.stop) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)


def needed_by(request, fixture: str) -> int:
    """How many of the session's selected tests in `request`'s module use `fixture` (a module-scoped fixture
    starts only the servers that the tests being run need)."""
    return sum(1 for item in request.session.items if item.module is request.module and fixture in item.fixturenames)


def generate_inputs(text: str, max_tokens: int, stream: bool = True) -> list:
    from grpc_stream import make_inputs

    return make_inputs(text, stream=stream, sampling={"max_tokens": max_tokens, "ignore_eos": True})


class StreamProbe:
    """One request on its own gRPC stream: every event, and the time of its terminal one."""

    def __init__(self, url: str, request_id: str, inputs: list, model: str = "smollm2"):
        self.request_id = request_id
        self.responses = 0
        self.finals = 0
        self.errors: list[str] = []
        self.late = 0
        self.ended_at: float | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_event)
        self.sent_at = time.monotonic()
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def _on_event(self, result=None, error=None) -> None:
        with self._lock:
            if self.finals or self.errors:
                self.late += 1
                return
            if error is not None:
                self.errors.append(str(error))
            else:
                if result.as_numpy("text_output") is not None:
                    self.responses += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.finals += 1
            if self.finals or self.errors:
                self.ended_at = time.monotonic()
                self.done.set()

    @property
    def error(self) -> str | None:
        return self.errors[0] if self.errors else None

    def close(self, timeout: float = 15) -> bool:
        """Half-close the stream and wait for it to end (what tritonclient's stop_stream does); True if it did."""
        closer = threading.Thread(target=lambda: (self.client.stop_stream(), self.client.close()), daemon=True)
        closer.start()
        closer.join(timeout)
        return not closer.is_alive()


def wait_streaming(probes: list[StreamProbe], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while any(p.responses == 0 and not p.done.is_set() for p in probes):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)


def embed(http: str, text: str = "hello") -> tuple[int | None, str]:
    body = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}]}).encode()
    return get(f"{http}/v2/models/minilm/infer", "POST", body, timeout=60)


class EmbeddingTraffic:
    """minilm requests one after another on a thread, each one's outcome kept: the bystander model."""

    def __init__(self, http: str):
        self.http = http
        self.outcomes: list[tuple[int | None, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(embed(self.http, f"bystander {len(self.outcomes)}"))
            self._stop.wait(0.2)

    def stop(self) -> list[tuple[int | None, str]]:
        self._stop.set()
        self._thread.join(90)
        return self.outcomes


def vector_ok(body: str) -> bool:
    try:
        out = json.loads(body)["outputs"][0]
    except (ValueError, KeyError, IndexError):
        return False
    return out["name"] == "embedding" and len(np.asarray(out["data"])) == 384
