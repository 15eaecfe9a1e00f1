"""What the load's timings chose on this CPU, kept between loads (`cache_dir()/timed_choices.json`).

The CPU backend times a few alternatives at load (load_timing.py): up to how many rows the exact blocks
pay, which greedy screen beats the float32 head and from how many rows, which of torch's GEMM libraries
`cpu_gemm=aten` calls. Each gives the same results either way; only the speed depends on the CPU. A later
load on the same CPU, kernel variant and thread count, of weights of the same shapes, takes the choice
made before instead of timing again, and builds only the screen that was chosen: that is most of the
backend's own load time on a small model. The key holds what the timing depends on; a new kernel build
(another `SCHEMA`) or another CPU times again. `TRITONLLM_RETIME=1` times every choice again and keeps
the new results (after a CPU's load changed for good, say); removing the file does the same for all.

Concurrent loads may write the file at once: each write replaces it whole (a rename), so the worst a
race does is forget a choice, which the next load times again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Callable, TypeVar

import torch

from tritonllm.devices.cpu import kernels
from tritonllm.models.model_files import cache_dir

logger = logging.getLogger(__name__)

RETIME_ENV = "TRITONLLM_RETIME"
FILE_NAME = "timed_choices.json"
SCHEMA = 2  # raise when what a choice means, or the kernels it times, change

T = TypeVar("T")


def remembered(what: str, details: Any, time_it: Callable[[], T]) -> tuple[T, bool]:
    """(the choice, whether it was remembered): the one `time_it()` made before on this machine for `what`
    with these `details` (JSON-able: shapes, row counts, options), else `time_it()`'s, kept for next time.
    A tuple comes back as a list when remembered."""
    key = _key(what, details)
    if os.environ.get(RETIME_ENV, "") not in ("1", "true"):
        table = _read()
        if key in table:
            return table[key], True
    value = time_it()
    table = _read()
    table[key] = value
    _write(table)
    return value, False


def recall(what: str, details: Any) -> tuple[bool, Any]:
    """(found, the choice) for `what` with `details`, without timing (found False under TRITONLLM_RETIME)."""
    if os.environ.get(RETIME_ENV, "") in ("1", "true"):
        return False, None
    table = _read()
    key = _key(what, details)
    return (key in table), table.get(key)


def keep(what: str, details: Any, value: Any) -> None:
    """Keep a choice timed by the caller (the pair of `recall`)."""
    table = _read()
    table[_key(what, details)] = value
    _write(table)


def _key(what: str, details: Any) -> str:
    return json.dumps([SCHEMA, what, _machine(), torch.get_num_threads(), details], separators=(",", ":"))


_MACHINE: list[str] = []


def _machine() -> str:
    """This CPU as /proc/cpuinfo names it (its model name alone says "AMD EPYC" on some clouds' VMs: its
    family, model, stepping and flags too), and the kernel variant this process runs."""
    if not _MACHINE:
        fields: dict[str, str] = {}
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if not line.strip():
                        break  # the first processor's block is enough
                    name, _, value = line.partition(":")
                    fields[name.strip()] = value.strip()
        except OSError:
            pass
        described = "|".join(fields.get(k, "") for k in ("model name", "cpu family", "model", "stepping"))
        flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
        _MACHINE.append(f"{described}|{flags}|{kernels.variant()}")
    return _MACHINE[0]


def _path():
    return cache_dir() / FILE_NAME


def _read() -> dict:
    try:
        table = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write(table: dict) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timed_choices.")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=0)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache only costs the next load its timings
        logger.warning("could not keep the load's timed choices in %s: %s", path, exc)
