"""The tritonllm-client CLI (generate, bench) and its workload/report helpers.

Tests marked `server` run against the real tritonserver from the session fixture `triton_server`
(tests/conftest.py); the others need no server.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "loadtest" / "scenarios"
CLI_TIMEOUT_S = 300


def run_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tritonllm_client.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- no server needed -------------------------------------------------------------------------

def test_generate_without_server_fails_with_one_clear_line():
    proc = run_cli("generate", "Hello", "--url", f"127.0.0.1:{unused_port()}", "--max-tokens", "4", timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach Triton"), proc.stderr
    assert proc.stdout == ""


def test_bench_bad_scenario_fails_cleanly(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_requests: 2\nprompt_len: {dist: nope}\noutput_len: 4\n")
    proc = run_cli("bench", "--scenario", str(bad), "--url", f"127.0.0.1:{unused_port()}", timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "unknown dist" in proc.stderr


@pytest.mark.parametrize("name", ["smoke", "seed_replay", "seed_replay_saturating", "chat_mixed", "burst",
                                  "single_stream"])
def test_shipped_scenarios_are_valid_and_deterministic(name):
    from tritonllm_client.workload import build_requests, load_scenario

    sc = load_scenario(SCENARIOS / f"{name}.yaml")
    a, b = build_requests(sc), build_requests(sc)
    assert len(a) == sc.num_requests
    assert [(r.prompt, r.max_tokens, r.send_offset_s) for r in a] == [(r.prompt, r.max_tokens, r.send_offset_s) for r in b]
    assert all(len(r.prompt.split()) == r.prompt_words for r in a)
    offsets = [r.send_offset_s for r in a]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    if sc.interval_s is not None:
        assert offsets[-1] == pytest.approx(sc.interval_s * (sc.num_requests - 1))


def test_seed_replay_matches_its_brief():
    from tritonllm_client.workload import build_requests, load_scenario

    sc = load_scenario(SCENARIOS / "seed_replay.yaml")
    reqs = build_requests(sc)
    assert sc.num_requests == 64 and sc.interval_s == 0.25 and sc.ignore_eos
    assert all(16 <= r.prompt_words <= 128 and 96 <= r.max_tokens <= 256 for r in reqs)


def test_saturating_replay_sends_the_seed_replays_requests_sooner():
    from tritonllm_client.workload import build_requests, load_scenario

    paced = build_requests(load_scenario(SCENARIOS / "seed_replay.yaml"))
    saturating = build_requests(load_scenario(SCENARIOS / "seed_replay_saturating.yaml"))
    assert [(r.prompt, r.max_tokens) for r in saturating] == [(r.prompt, r.max_tokens) for r in paced]
    assert saturating[-1].send_offset_s == pytest.approx(6.3)


def test_distributions_and_overrides():
    from tritonllm_client.workload import build_requests, scenario_from_dict

    sc = scenario_from_dict({"num_requests": 50, "rate": 10.0, "seed": 3,
                             "prompt_len": {"dist": "choice", "values": [5, 9]},
                             "output_len": {"dist": "normal", "mean": 20, "std": 5, "min": 10, "max": 30}})
    reqs = build_requests(sc)
    assert {r.prompt_words for r in reqs} <= {5, 9}
    assert all(10 <= r.max_tokens <= 30 for r in reqs)
    gaps = [b.send_offset_s - a.send_offset_s for a, b in zip(reqs, reqs[1:])]
    assert len(set(round(g, 9) for g in gaps)) > 10  # Poisson, not fixed
    fixed = build_requests(sc, num_requests=10, interval_s=0.5)
    assert [r.send_offset_s for r in fixed] == [0.5 * i for i in range(10)]
    assert [r.prompt for r in fixed] == [r.prompt for r in reqs[:10]]  # arrivals don't change prompts
    for bad in ({"num_requests": 1, "prompt_len": 0, "output_len": 4},
                {"num_requests": 1, "prompt_len": 4, "output_len": 4, "rate": 1, "interval_s": 1},
                {"num_requests": 1, "prompt_len": 4, "output_len": 4, "typo": 1},
                {"num_requests": 1, "prompt_len": 4, "output_len": 4, "max_concurrency": 0},
                {"num_requests": 1, "prompt_len": 4, "output_len": 4, "max_concurrency": 1.5}):
        with pytest.raises(ValueError):
            scenario_from_dict(bad)
    assert scenario_from_dict({"num_requests": 1, "prompt_len": 4, "output_len": 4}).max_concurrency is None


def test_summary_statistics():
    from tritonllm_client.report import describe, summarize

    d = describe([4.0, 1.0, 3.0, 2.0, None])
    assert d["count"] == 4 and d["mean"] == 2.5 and d["p50"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    recs = [{"index": i, "ok": True, "error": None, "send_time_s": 0.1 * i, "end_time_s": 1.0 + 0.1 * i,
             "num_output_tokens": 10, "expected_output_tokens": 10, "ttft_s": 0.2, "tpot_s": 0.05,
             "e2e_s": 1.0, "itl_s": [0.05] * 9, "send_lag_s": 0.0, "server_timings": {}} for i in range(4)]
    recs.append({"index": 4, "ok": False, "error": "boom", "send_time_s": 0.4, "num_output_tokens": 0,
                 "expected_output_tokens": 10, "ttft_s": None, "tpot_s": None, "e2e_s": None, "send_lag_s": 0.0})
    s = summarize(recs)
    assert (s["num_completed"], s["num_failed"], s["failures"]["first_messages"]) == (4, 1, ["boom"])
    assert s["total_time_s"] == pytest.approx(1.3)
    assert s["output_token_throughput"] == pytest.approx(40 / 1.3)
    assert s["expected_output_tokens"] == 50 and s["num_output_length_mismatch"] == 0


# --- against the real server ------------------------------------------------------------------

@pytest.mark.server
def test_generate_streams_text_and_prints_stats(triton_server):
    proc = run_cli("generate", "What is the capital of France?", "--url", triton_server.grpc_url,
                   "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    assert "ttft" in proc.stderr and "tokens/s" in proc.stderr, proc.stderr


@pytest.mark.server
def test_generate_ignore_eos_gives_exact_token_count(triton_server):
    proc = run_cli("generate", "Count slowly.", "--url", triton_server.grpc_url, "--max-tokens", "12",
                   "--ignore-eos", "--no-chat")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert " 12 tokens in " in proc.stderr, proc.stderr


@pytest.mark.server
def test_generate_repetition_penalty_gives_the_offline_engine_text(triton_server, engine):
    from tritonllm.core.sampling_params import SamplingParams

    proc = run_cli("generate", "Hi", "--url", triton_server.grpc_url, "--max-tokens", "16", "--ignore-eos",
                   "--no-chat", "--repetition-penalty", "1.3")
    assert proc.returncode == 0, proc.stderr
    [ref] = engine.generate(["Hi"], SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3))
    [plain] = engine.generate(["Hi"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert proc.stdout.rstrip("\n") == ref.text != plain.text


@pytest.mark.server
def test_generate_unknown_model_fails_with_one_clear_line(triton_server):
    proc = run_cli("generate", "Hello", "--url", triton_server.grpc_url, "--model", "no_such_model", timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") and "no_such_model" in proc.stderr


@pytest.mark.server
def test_bench_smoke_scenario(triton_server, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_cli("bench", "--scenario", str(SCENARIOS / "smoke.yaml"), "--url", triton_server.grpc_url,
                   "--num-requests", "8", "--out", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout and "total time" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 1
    run = result["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert len(reqs) == 8 == s["num_requests"]
    assert s["num_completed"] + s["num_failed"] == s["num_requests"]
    assert s["num_failed"] == 0, s["failures"]
    assert sorted(r["index"] for r in reqs) == list(range(8))
    for r in reqs:
        assert r["ok"] and r["error"] is None
        assert r["num_output_tokens"] == r["expected_output_tokens"], r
        assert 8 <= r["expected_output_tokens"] <= 16
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["tpot_s"] is not None and r["tpot_s"] > 0
    assert s["total_output_tokens"] == s["expected_output_tokens"] == sum(r["expected_output_tokens"] for r in reqs)
    assert s["num_output_length_mismatch"] == 0
    assert s["total_time_s"] > 0 and s["request_throughput"] > 0 and s["output_token_throughput"] > 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        st = s[key]
        assert st["count"] == 8
        assert 0 < st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
        assert st["mean"] > 0
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_max_concurrency_1_keeps_one_request_in_flight(triton_server, tmp_path):
    """single_stream.yaml's regime: with `max_concurrency: 1` each request is sent only once the one before
    it has ended, though the scenario sends them all at t=0."""
    scenario, out = tmp_path / "one.yaml", tmp_path / "one.json"
    scenario.write_text("name: one\nnum_requests: 3\ninterval_s: 0.0\nmax_concurrency: 1\n"
                        "prompt_len: {dist: fixed, value: 8}\noutput_len: {dist: fixed, value: 6}\n")
    proc = run_cli("bench", "--scenario", str(scenario), "--url", triton_server.grpc_url, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reqs = sorted(json.loads(out.read_text())["runs"][0]["requests"], key=lambda r: r["send_time_s"])
    assert len(reqs) == 3 and all(r["ok"] for r in reqs)
    for before, after in zip(reqs, reqs[1:]):
        assert after["send_time_s"] >= before["end_time_s"]


@pytest.mark.server
def test_generate_passes_any_sampling_parameter_as_json(triton_server, engine):
    from tritonllm.core.sampling_params import SamplingParams

    [plain] = engine.generate(["Hi"], SamplingParams(max_tokens=8, ignore_eos=True))
    banned = plain.token_ids[0]
    proc = run_cli("generate", "Hi", "--url", triton_server.grpc_url, "--max-tokens", "8", "--ignore-eos", "--no-chat",
                   "--param", f'logit_bias={{"{banned}": -100}}', "--param", "min_p=0.5")
    assert proc.returncode == 0, proc.stderr
    [ref] = engine.generate(["Hi"], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={banned: -100.0}))
    assert proc.stdout.rstrip("\n") == ref.text != plain.text
    bad = run_cli("generate", "Hi", "--url", triton_server.grpc_url, "--param", "no_such_knob=1", timeout=60)
    assert bad.returncode == 1 and "no_such_knob" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.server
def test_generate_prints_each_of_n_sampled_completions(triton_server, engine):
    from tritonllm.core.sampling_params import SamplingParams

    proc = run_cli("generate", "Once upon a time", "--url", triton_server.grpc_url, "--max-tokens", "10",
                   "--ignore-eos", "--no-chat", "--temperature", "1.0", "--param", "n=3", "--param", "seed=3")
    assert proc.returncode == 0, proc.stderr
    refs = engine.generate(["Once upon a time"], SamplingParams(n=3, seed=3, temperature=1.0, max_tokens=10,
                                                               ignore_eos=True))
    assert proc.stdout == "".join(f"[completion {i}]\n{r.text}\n" for i, r in enumerate(refs))
    assert " 30 tokens in " in proc.stderr, proc.stderr  # the three completions' tokens


@pytest.mark.server
def test_generate_shows_prompt_and_output_logprobs(triton_server, engine, tokenizer):
    from tritonllm.core.sampling_params import SamplingParams

    proc = run_cli("generate", "The capital of France is", "--url", triton_server.grpc_url, "--max-tokens", "5",
                   "--ignore-eos", "--no-chat", "--logprobs", "2", "--prompt-logprobs", "1")
    assert proc.returncode == 0, proc.stderr
    [ref] = engine.generate(["The capital of France is"], SamplingParams(
        max_tokens=5, ignore_eos=True, top_logprobs=2, prompt_logprobs=1))
    text, rest = proc.stdout.split("prompt log-probs", 1)
    prompt_part, output_part = rest.split("output log-probs", 1)
    assert text.rstrip("\n") == ref.text

    def rows(part: str) -> list[list[str]]:
        return [line.split() for line in part.splitlines()[1:]]

    prompt_rows, output_rows = rows(prompt_part), rows(output_part)
    assert prompt_rows[0] == ["0", "-"] and len(prompt_rows) == len(ref.prompt_logprobs)
    for row, expected, line in zip(output_rows + prompt_rows[1:], ref.top_logprobs + ref.prompt_logprobs[1:],
                                   output_part.splitlines()[1:] + prompt_part.splitlines()[2:]):
        token, lp, rank = expected[0]  # the chosen (or prompt) token, then the other likely ones after "|"
        assert repr(tokenizer.decode([token])) in line
        assert f"#{rank}" in row and float(row[row.index(f"#{rank}") - 1]) == pytest.approx(lp, abs=1e-3)
        assert line.count("|") == (len(expected) > 1)
    assert len(output_rows) == 5
