"""`openai_front`: our OpenAI server (`python -m tritonllm.openai`, a process of its own, as
tritonllm-serve runs it) in front of a test's tritonserver, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_front(triton_grpc_url: str, log: Path, *args: str, ready_path: str = "/health", ready_text: str = "",
                 timeout: float = 300) -> Iterator[str]:
    """Start the server with `args`, wait until `ready_path` answers 200 (with `ready_text` in its body),
    yield its base URL, then stop it. Its output goes to `log`, whose tail a failed start shows.

    TRITONLLM_OPENAI_ARGS is cleared: the test's arguments are all the server gets."""
    port = free_port()
    cmd = [sys.executable, "-m", "tritonllm.openai", "--triton-url", triton_grpc_url, "--port", str(port), *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "TRITONLLM_OPENAI_ARGS": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(base + ready_path, timeout=5) as r:
                    if r.status == 200 and ready_text in r.read().decode():
                        break
            except (urllib.error.URLError, OSError):  # not listening yet
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
