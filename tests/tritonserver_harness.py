"""`TritonServer`: a real tritonserver with our Python-backend models, a child process on loopback
ports, for tests and benchmarks (bench/ imports it from here). It waits until the server and its
metrics answer, keeps the server's log, and stops it on exit.

How tritonserver is found and started is the package's (tritonllm/serving/tritonserver_process.py),
shared with `tritonllm-serve`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tritonllm.serving.tritonserver_process import (assemble_backend_dir, build_command, check_numpy, pick_ports,
                                                    server_env)


# tritonserver's fatal-signal handler's first line (SIGSEGV, SIGABRT, ...), and how long the process
# then gets to write its backtrace and exit by itself.
_CRASH = re.compile(r"^Signal \((?!15\))\d+\) received\.$", re.M)
_CRASH_GRACE_S = 3.0


# Servers told to stop by stop_later() and not yet awaited, oldest first.
_stopping: list["TritonServer"] = []
_MAX_STOPPING = 3


def wait_for_stopped(timeout: float = 60) -> None:
    """Wait for every server stop_later() stopped to exit (each killed after `timeout` s, as stop() does)."""
    while _stopping:
        _stopping.pop(0).stop(timeout)


class TritonServer:
    """A tritonserver child process on loopback, for tests and benchmarks; use as a context manager."""

    def __init__(self, model_repository: str | Path, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None,
                 log_path: str | Path | None = None, log_verbose: int = 0,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 startup_timeout: float = 300):
        self.http_port, self.grpc_port, self.metrics_port = pick_ports(http_port, grpc_port, metrics_port)
        self.model_repository = Path(model_repository)
        self.log_path = Path(log_path) if log_path else None
        self.log_verbose, self.extra_args = log_verbose, tuple(extra_args)
        self.env, self.startup_timeout = env, startup_timeout
        self.process: subprocess.Popen | None = None
        self._signalled = False  # SIGTERM sent (stop, stop_later)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        """Everything the server has written so far (stdout and stderr)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def _get_ok(self, path: str, timeout: float = 2.0, base: str | None = None) -> bool:
        try:
            with urllib.request.urlopen(f"http://{base or self.http_url}{path}", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def is_ready(self) -> bool:
        """True when /v2/health/ready answers 200 (server up and all models loaded)."""
        return self._get_ok("/v2/health/ready")

    def _metrics_up(self) -> bool:
        """The metrics endpoint starts a little after HTTP reports ready: a scrape right after start()
        must not be refused. True at once when metrics are switched off."""
        if any(a.replace(" ", "") in ("--allow-metrics=false", "--allow-metrics=0") for a in self.extra_args):
            return True
        return self._get_ok("/metrics", base=f"127.0.0.1:{self.metrics_port}")

    def is_model_ready(self, name: str) -> bool:
        """True when model `name` is loaded and ready."""
        return self._get_ok(f"/v2/models/{name}/ready")

    def _failure(self, why: str) -> RuntimeError:
        tail = "\n".join(self.log_text().splitlines()[-60:])
        return RuntimeError(f"tritonserver {why} (log: {self.log_path}); last lines:\n{tail}")

    def start(self) -> "TritonServer":
        """Launch the server and wait until it is ready; raise with the log's tail if it is not.

        The log file (a temporary file unless `log_path` was given) is kept for post-mortems.
        """
        if self.process is not None:
            raise RuntimeError("server already started")
        check_numpy()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        backend_dir = assemble_backend_dir()
        cmd = build_command(self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
                            backend_dir=backend_dir, log_verbose=self.log_verbose, extra_args=self.extra_args)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=server_env(self.env))
        try:
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise self._failure(f"exited with code {self.process.returncode} during start-up")
                if self.is_ready() and self._metrics_up():
                    return self
                time.sleep(0.25)
            raise self._failure(f"was not ready after {self.startup_timeout:g} s")
        except BaseException:
            # __exit__ does not run when __enter__ raises (Ctrl-C included): never leave a server behind.
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (the server unloads models, calling their finalize), wait, then SIGKILL.

        Returns the exit code, or None if the server was never started. A server already told to
        stop (stop_later) is not signalled again: a second signal would skip its unload.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._terminate()
            deadline = time.monotonic() + timeout
            crashed_at = None
            while self.process.poll() is None and time.monotonic() < deadline:
                # A crash, before or while shutting down (tritonserver 2.51 can abort in malloc after a
                # model-control reload left two instances to unload), prints "Signal (6) received." and can
                # then hang in its handler's backtrace: it would be killed at the deadline anyway, so it is
                # killed now.
                if crashed_at is None and _CRASH.search(self.log_text()):
                    crashed_at = time.monotonic()
                if crashed_at is not None and time.monotonic() - crashed_at > _CRASH_GRACE_S:
                    break
                time.sleep(0.1)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode

    def _terminate(self) -> None:
        """SIGTERM once: a second signal would make tritonserver skip its unload."""
        if not self._signalled:
            self.process.send_signal(signal.SIGTERM)
            self._signalled = True

    def stop_later(self) -> None:
        """SIGTERM now and return at once: the server unloads and exits while the caller goes on (a
        stop takes seconds, most of them tritonserver's and its stub's own waits). wait_for_stopped()
        ends every server stopped so; at most _MAX_STOPPING of them are left stopping at a time."""
        if self.process is None or self.process.poll() is not None:
            return
        self._terminate()
        _stopping.append(self)
        while len(_stopping) > _MAX_STOPPING:  # each holds its model and KV pool until it has exited
            _stopping.pop(0).stop()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
