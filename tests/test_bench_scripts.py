"""Every benchmark script starts: `python bench/<script>.py --help` exits 0.

A script is a bench/*.py with an `if __name__ == "__main__":` block; the others are modules the scripts
import (compare.py's peers, baselines and report), which tests/test_repository_paths.py reads for their
imports. `--help` imports the script and its module-level imports and builds its argument parser, but
loads no model and starts no server. Each script is its own Python process (about 0.1-4 s here, most of
it importing torch); they run two at a time, so the whole test takes some 10-20 s on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def _help(script: Path) -> tuple[Path, int, str]:
    try:
        done = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return script, -1, "no exit within 120 s"
    return script, done.returncode, done.stderr


def test_there_are_bench_scripts():
    assert len(SCRIPTS) >= 5, f"found only {[p.name for p in SCRIPTS]} in bench/: has the main-block test gone wrong?"


@pytest.mark.unit  # subprocesses, but no model and no server: ~10-20 s in all (the module's docstring)
def test_every_bench_script_starts_with_help():
    with ThreadPoolExecutor(max_workers=max(2, min(4, (os.cpu_count() or 2) // 2))) as pool:
        results = list(pool.map(_help, SCRIPTS))
    failed = [f"bench/{script.name}: exit {rc}\n{err[-1500:]}" for script, rc, err in results if rc != 0]
    assert not failed, f"{len(failed)} of {len(SCRIPTS)} bench scripts fail to start:\n\n" + "\n\n".join(failed)
