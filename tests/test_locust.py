"""loadtest/locustfile.py run headless by Locust against the real tritonserver.

Locust's own exit code is kept (1 when any request failed) rather than `--exit-code-on-error 0`:
the test checks both it and the CSV, so a failure shows the CSV's error messages.
`--stop-timeout` lets requests in flight at the end of `-t` finish and be counted.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

# Only look for locust: importing it monkey-patches the whole test process with gevent, and the
# other tests' threads and gRPC streams then hang. Locust runs in a subprocess below.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
SMOKE = REPO / "loadtest" / "scenarios" / "smoke.yaml"


def run_locust(host: str, csv_prefix: Path, *extra: str, env_extra: dict | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITONLLM_MODEL="smollm2", TRITONLLM_SCENARIO=str(SMOKE), TRITONLLM_WAIT="0.2")
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "--csv", str(csv_prefix), "--only-summary", "--loglevel", "WARNING", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.server
def test_locust_headless_against_server(triton_server, tmp_path):
    prefix = tmp_path / "locust"
    proc = run_locust(triton_server.grpc_url, prefix, "-u", "4", "-r", "4", "-t", "8s", "--stop-timeout", "60")
    stats = {(r["Type"], r["Name"]): r for r in read_rows(Path(f"{prefix}_stats.csv"))}
    failures = read_rows(Path(f"{prefix}_failures.csv"))
    assert not failures, failures
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    e2e, ttft = stats[("grpc", "e2e")], stats[("grpc", "ttft")]
    assert int(e2e["Request Count"]) > 0
    assert int(e2e["Failure Count"]) == 0
    assert int(ttft["Request Count"]) == int(e2e["Request Count"])
    assert 8 <= float(e2e["Average Content Size"]) <= 16  # output tokens per request (smoke: 8-16)
    assert 0 < float(ttft["Average Response Time"]) <= float(e2e["Average Response Time"])
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0
    assert "output tokens/s" in proc.stdout + proc.stderr


def test_locust_missing_scenario_stops_with_clear_error(tmp_path):
    # No server needed: the run stops before any request is sent.
    proc = run_locust("127.0.0.1:1", tmp_path / "locust", "-u", "1", "-r", "1", "-t", "20s",
                      env_extra={"TRITONLLM_SCENARIO": str(tmp_path / "missing.yaml")}, timeout=120)
    assert proc.returncode == 1
    assert "cannot load scenario" in proc.stderr
    assert "Traceback" not in proc.stderr
