"""Scale-out that survives a death: two `tritonllm-serve` servers behind HAProxy (deploy/haproxy.cfg, as
scripts/serve_pair.sh runs it), under Locust load through the balancer (gRPC streams over HTTP/2 and
HTTP generate). One server's engine stub is killed: the balancer takes that server out of rotation
within seconds (its readiness check), only the requests that were on it fail, each with one error,
the other server carries the load, and the healed server rejoins and serves again.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervised import (FAST, StreamProbe, Supervised, generate_inputs, get, make_repository, start_together,
                        stop_together)

from tritonllm.serving.tritonserver_process import pick_ports

pytestmark = [pytest.mark.server, pytest.mark.skipif(shutil.which("haproxy") is None,
                                                     reason="haproxy is not installed (scripts/install.sh test installs it)")]

REPO = Path(__file__).resolve().parent.parent
DOWN_WITHIN_S = 5.0  # the balancer stops sending to the dead server within this long
BACK_S = 300.0  # generous: a reload is a model load, on shared cores, under load


class Balancer:
    """HAProxy with deploy/haproxy.cfg in front of servers a and b; their state from its stats page."""

    def __init__(self, a: Supervised, b: Supervised, log_path: Path):
        self.http_port, self.grpc_port, self.stats_port = pick_ports(None, None, None)
        env = dict(os.environ, TRITONLLM_LB_HOST="127.0.0.1", TRITONLLM_LB_HTTP_PORT=str(self.http_port),
                   TRITONLLM_LB_GRPC_PORT=str(self.grpc_port), TRITONLLM_LB_STATS_PORT=str(self.stats_port))
        for name, server in (("A", a), ("B", b)):
            env[f"TRITONLLM_{name}_HTTP"] = f"127.0.0.1:{server.http_port}"
            env[f"TRITONLLM_{name}_GRPC"] = f"127.0.0.1:{server.grpc_port}"
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(["haproxy", "-db", "-f", str(REPO / "deploy" / "haproxy.cfg")], env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def servers(self) -> dict[tuple[str, str], dict]:
        """(backend, server) -> its stats row (status UP/DOWN, stot: requests sent to it)."""
        status, text = get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5)
        if status != 200:
            return {}
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {(r["pxname"], r["svname"]): r for r in rows if r["svname"] in ("a", "b")}

    def status(self, server: str) -> set[str]:
        """The state of `server` in both backends, e.g. {"UP"}; a mixed set while the checks disagree."""
        return {row["status"].split()[0] for (_, name), row in self.servers().items() if name == server}

    def sent_to(self, server: str) -> int:
        return sum(int(row["stot"]) for (_, name), row in self.servers().items() if name == server)

    def wait_status(self, server: str, wanted: str, timeout: float) -> float:
        """time.time() when `server` reached `wanted` in both backends (asserts it does within `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.status(server) != {wanted}:
            assert self.process.poll() is None, "haproxy exited"
            assert time.monotonic() < deadline, f"server {server} not {wanted} after {timeout:g} s: {self.status(server)}"
            time.sleep(0.05)
        return time.time()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        self.log.close()


def _finished(server: Supervised) -> float:
    return server.metric("llm_requests_finished_total", model="smollm2")


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def _ok_since(log: Path, since: float) -> bool:
    lines = log.read_text().splitlines() if log.exists() else []
    return any(r["outcome"] == "ok" and r["start"] > since for r in map(json.loads, lines))


def test_a_dead_server_leaves_the_balancer_and_rejoins_after_it_heals(tmp_path):
    params = dict(FAST, num_threads=1)  # two servers share this machine's cores
    a = Supervised(make_repository(tmp_path / "repo_a", with_minilm=False, **params), tmp_path / "a.log",
                   "--restart-backoff", "0.1")  # the back-off is not what this test is about
    b = Supervised(make_repository(tmp_path / "repo_b", with_minilm=False, **params), tmp_path / "b.log")
    balancer = locust = None
    locust_log = open(tmp_path / "locust.log", "ab")
    try:
        start_together(a, b)
        balancer = Balancer(a, b, tmp_path / "haproxy.log")
        balancer.wait_status("a", "UP", 30)
        balancer.wait_status("b", "UP", 30)

        log = tmp_path / "requests.jsonl"
        locust = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "soak_locustfile.py"), "--headless",
             "--host", f"127.0.0.1:{balancer.grpc_port}", "-u", "4", "-r", "4", "-t", "600s",
             "--soak-http", f"127.0.0.1:{balancer.http_port}", "--soak-kinds", "stream,whole",
             "--soak-log", str(log), "--soak-timeout", "60", "--only-summary", "--loglevel", "WARNING"],
            cwd=REPO, stdout=locust_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        # Both servers take requests through the balancer; then one that surely is on a, sent to it directly.
        _wait(lambda: _finished(a) >= 2 and _finished(b) >= 2, 120, "both servers serving through the balancer")
        on_a = StreamProbe(a.grpc_url, "on-a", generate_inputs("The history of the bicycle", 2000))
        _wait(lambda: on_a.responses > 0, 60, "the direct request streaming on a")
        (stub,) = a.stubs("smollm2")
        killed_at = time.time()
        os.kill(stub, signal.SIGKILL)

        down_at = balancer.wait_status("a", "DOWN", 30)
        assert down_at - killed_at < DOWN_WITHIN_S, f"a left the balancer {down_at - killed_at:.1f} s after the death"
        assert on_a.done.wait(10), "the request on a got no terminal event"
        assert on_a.error and "died" in on_a.error and on_a.finals == 0, (on_a.finals, on_a.errors)
        on_a.close()

        a.wait_ready("smollm2", BACK_S)
        up_at = balancer.wait_status("a", "UP", 30)
        sent, finished = balancer.sent_to("a"), _finished(a)
        # The healed server takes requests again: the balancer routes to it, and its new engine finishes them.
        _wait(lambda: balancer.sent_to("a") >= sent + 2 and _finished(a) > finished, 90, "requests served by a again")
        # Locust logs a request when it ends, and a request a finished may not be logged yet (or may have started
        # before up_at: haproxy marks a UP a poll before this test sees it): wait for one logged after up_at.
        _wait(lambda: _ok_since(log, up_at), 90, "a request that started after a rejoined, finished and logged")
        done_at = time.time()
    finally:
        if locust is not None and locust.poll() is None:
            locust.send_signal(signal.SIGTERM)
            try:
                locust.wait(60)
            except subprocess.TimeoutExpired:
                locust.kill()
        locust_log.close()
        if balancer is not None:
            balancer.stop()
        stop_together(a, b)

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert not [r for r in records if r["outcome"] in ("lost", "extra")], "a request without exactly one FINAL or error"
    failed = [r for r in records if r["outcome"] != "ok"]
    assert all("model 'smollm2' is unavailable" in r["error"] for r in failed), [r["error"] for r in failed]
    # Requests that were on a when it died end with an error naming the death; so does one that reached a in
    # the few tens of ms before its supervisor saw the death (it went into the dead stub) ...
    lost_in_a = [r for r in failed if "the request was lost in it" in r["error"]]
    assert all(r["start"] < killed_at or r["start"] < down_at and r["elapsed_s"] < 1 for r in lost_in_a), \
        [(r["start"] - killed_at, r["elapsed_s"]) for r in lost_in_a]
    # ... and the only others to fail reached it between the death and the balancer's next check: refused at
    # once, never started. None fails once it is out of rotation.
    refused = [r for r in failed if r not in lost_in_a]
    assert all(killed_at - 0.5 < r["start"] < down_at + 0.5 and r["elapsed_s"] < 1 for r in refused), \
        [(r["start"] - killed_at, r["elapsed_s"], r["error"]) for r in refused]
    served_by_b_alone = [r for r in records if r["outcome"] == "ok" and down_at + 0.5 < r["start"] < up_at]
    assert served_by_b_alone, "no request succeeded while a was out of rotation"
    assert [r for r in records if r["outcome"] == "ok" and up_at < r["start"] < done_at], "none after a rejoined"
    kinds = {r["kind"] for r in records if r["outcome"] == "ok"}
    assert kinds == {"stream", "whole"}, kinds
    print(f"\n{len(records)} requests through the balancer: {len(lost_in_a)} lost in a at its death, {len(refused)} "
          f"refused by a before the balancer's next check; a out of rotation {down_at - killed_at:.2f} s after the "
          f"kill, back {up_at - killed_at:.1f} s after; {len(served_by_b_alone)} served by b alone meanwhile")
