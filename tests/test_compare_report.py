"""The comparison benchmark's arrival bound (bench/compare_report.py): what the replay's schedule allows;
and how its reports name the CPU (bench/compare.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import compare  # noqa: E402
import compare_report  # noqa: E402


def _serial(total: float, extrapolated: bool = False) -> dict:
    return {"system": "hf_serial", "total_time_s": total, "extrapolated": extrapolated}


def test_no_system_beats_the_last_send_and_one_stream_sets_the_floor():
    requests = [(0.0, 256), (1.0, 100), (2.0, 50)]  # the longest output is not the last one's
    bound = compare_report.arrival_bound(requests, [_serial(100.0)], per_token_s=0.01)
    assert bound["max_ratio_vs_serial"] == pytest.approx(50.0)  # 100 s / the last send at 2 s
    # 0 + 2.56, 1 + 1.0, 2 + 0.5: the first request, though sent first, ends last.
    assert bound["floor_s"] == pytest.approx(2.56)
    assert bound["floor_request"] == {"send_offset_s": 0.0, "output_tokens": 256}
    assert bound["max_ratio_vs_serial_at_per_token"] == pytest.approx(100.0 / 2.56)
    text = compare_report.arrival_bound_lines(bound)
    assert "50.00x" in text and "39.06x" in text


def test_without_a_serial_baseline_or_a_tpot_the_bound_says_less():
    requests = [(0.0, 10), (0.25, 10)]
    assert compare_report.arrival_bound(requests, [], per_token_s=0.01)["max_ratio_vs_serial"] is None
    assert compare_report.arrival_bound_lines(compare_report.arrival_bound(requests, [])) == ""
    bound = compare_report.arrival_bound(requests, [_serial(5.0, extrapolated=True)])
    assert "floor_s" not in bound
    assert compare_report.arrival_bound_lines(bound).count("~") == 2  # extrapolated numbers are marked


def test_a_report_names_the_cpu_by_its_numbers_and_the_instruction_sets_the_run_was_held_to(monkeypatch):
    for var in compare.ISA_LIMITS:
        monkeypatch.delenv(var, raising=False)
    plain = compare.cpu_name()
    assert "logical CPUs" in plain and "held to" not in plain
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and re.search(r"^cpu family\s*:", cpuinfo.read_text(), re.M):  # x86
        assert re.search(r"\(family \d+ model \d+; ", plain), plain
    monkeypatch.setenv("TRITONLLM_CPU_ISA", "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert compare.cpu_name().endswith("; held to TRITONLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2)")
