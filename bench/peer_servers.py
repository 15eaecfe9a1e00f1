"""The peers we measure against, each as its own server process on loopback: vLLM CPU and llama.cpp.

Both speak the OpenAI completions API, so one replay client (openai_stream.py) drives both. They
are optional: vLLM CPU lives in its own virtual environment (its pins clash with ours), given by
`--vllm-python`; llama.cpp's native `llama-server` binary is given by `--llama-server` or found on
PATH. When missing, the comparison says "skipped (not installed)". See docs/PERFORMANCE.md for
how to install them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SERVED_MODEL_NAME = "smollm2"
PORT = "{port}"  # stands for the loopback port in a PeerSpec's command until the server is launched


@dataclass
class PeerSpec:
    """How to start one peer server; `available` is False with `why` when it cannot run here."""

    name: str
    description: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    available: bool = True
    why: str = ""

    def on_port(self, port: int) -> list[str]:
        """The command with `port` in place of PORT."""
        return [str(port) if arg == PORT else arg for arg in self.command]


class PortTakenError(RuntimeError):
    """The server exited at start-up because its port was no longer free."""


# What the peers print when their port is taken: llama-server's and uvicorn's (vLLM) words.
_PORT_TAKEN = ("couldn't bind", "address already in use")


class PeerServer:
    """A peer server as a child process in its own session, so its worker processes stop with it."""

    def __init__(self, spec: PeerSpec, port: int, log_path: Path):
        self.spec, self.port, self.log_path = spec, port, Path(log_path)
        self.process: Optional[subprocess.Popen] = None
        self.started_at: Optional[float] = None
        self._log_start = 0  # where this launch's lines begin in the (appended) log

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        """The last lines this launch wrote to the log."""
        if not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            text = log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> "PeerServer":
        """Launch and wait for /health (200 once the model is loaded); raise with the log's tail."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        self.started_at = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(self.spec.on_port(self.port), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    tail = self.log_tail()
                    error = PortTakenError if any(words in tail.lower() for words in _PORT_TAKEN) else RuntimeError
                    raise error(f"{self.spec.name} exited with code {self.process.returncode} during "
                                f"start-up (log {self.log_path}):\n{tail}")
                if self._healthy():
                    return self
                time.sleep(0.5)
            raise RuntimeError(f"{self.spec.name} not ready after {self.spec.startup_timeout_s:g} s "
                               f"(log {self.log_path}):\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the child's process group (the child and the workers it spawned), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)  # the group this child leads (start_new_session)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "PeerServer":
        return self if self.process is not None else self.start()  # start_on_free_port's is started already

    def __exit__(self, *exc) -> None:
        self.stop()


def start_on_free_port(spec: PeerSpec, log_path: Path, attempts: int = 3) -> PeerServer:
    """Start `spec` on a loopback port picked just before the launch. Another process can still take
    the port before the server binds it (a client connection's ephemeral port, say), so a start-up
    that fails for that reason is tried again on a new port."""
    from tritonllm.serving.tritonserver_process import free_port

    for _ in range(attempts - 1):
        try:
            return PeerServer(spec, free_port(), log_path).start()
        except PortTakenError:
            print(f"  {spec.name}: its port was taken before it bound it; trying another", flush=True)
    return PeerServer(spec, free_port(), log_path).start()


def vllm_spec(python: Optional[str], model_dir: Path, threads: int, max_num_seqs: int,
              max_model_len: int, dtype: str = "float32") -> PeerSpec:
    """vLLM's OpenAI server (its CPU build, or its GPU build on a GPU machine) on our safetensors folder, at
    most `max_num_seqs` sequences."""
    desc = f"vLLM, OpenAI server, {dtype}, max_num_seqs={max_num_seqs}"
    python = python or os.environ.get("TRITONLLM_VLLM_PYTHON")
    if not python:
        return PeerSpec("vllm", desc, available=False, why="skipped (not installed): give --vllm-python")
    if not Path(python).is_file():
        return PeerSpec("vllm", desc, available=False, why=f"skipped (not installed): {python} does not exist")
    try:  # importing vllm takes a while; a broken install should say so here, not after minutes
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return PeerSpec("vllm", desc, available=False, why="skipped: `import vllm` took over 300 s")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return PeerSpec("vllm", desc, available=False, why=f"skipped (not installed): import vllm failed: {last}")
    version = probe.stdout.strip()
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}  # GiB of KV cache
    if threads < (os.cpu_count() or threads):  # pin its OpenMP threads to as many cores as ours use
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype,
               "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", PORT, "--seed", "0"]
    return PeerSpec("vllm", f"vLLM {version}, OpenAI server, {dtype}, max_num_seqs={max_num_seqs}",
                    command, env, startup_timeout_s=900.0)


def llama_spec(binary: Optional[str], gguf: Path, threads: int, slots: int, ctx_per_slot: int) -> PeerSpec:
    """llama.cpp's native `llama-server` on the packaged GGUF with `slots` parallel sequences."""
    name = f"llamacpp-{slots}"
    desc = f"llama.cpp llama-server, {gguf.name} (4-bit weights), {slots} slots"
    binary = binary or shutil.which("llama-server")
    if not binary or not Path(binary).is_file():
        return PeerSpec(name, desc, available=False,
                        why="skipped (not installed): give --llama-server or put llama-server on PATH")
    command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", PORT, "-a", SERVED_MODEL_NAME,
               "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               # the context is shared by the slots: each needs its longest prompt plus output
               "-c", str(slots * ctx_per_slot), "--seed", "0"]
    return PeerSpec(name, desc, command, startup_timeout_s=300.0)
