"""The CPU kernels' instruction-set variants (devices/cpu/kernels.py): which one a CPU gets, every
variant this machine can run passing the kernel tests, and the sources compiling for aarch64."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tritonllm.devices.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "backend" / "devices" / "cpu" / "csrc"

# /proc/cpuinfo flags of a few CPUs, the part the chooser reads (the kernel lists AVX and AVX-512
# only where it saves their registers).
V2 = {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm", "xsave"}
HASWELL = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
SKYLAKE_X = HASWELL | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CASCADE_LAKE = SKYLAKE_X | {"avx512_vnni"}
ZEN4 = CASCADE_LAKE | {"avx512_bf16", "avx512ifma", "avx512vbmi", "avx_vnni"}
SANDY_BRIDGE = V2 | {"avx"}


@pytest.mark.parametrize("flags,machine,expected", [
    (ZEN4, "x86_64", "avx512_bf16"),
    (CASCADE_LAKE, "x86_64", "avx512"),  # VNNI without BF16
    (SKYLAKE_X, "x86_64", "avx512"),
    (SKYLAKE_X | {"avx512_bf16"}, "x86_64", "avx512"),  # BF16 without VNNI
    (HASWELL, "x86_64", "avx2"),
    (ZEN4 - {"avx512vl"}, "x86_64", "avx2"),  # x86-64-v4 is all five AVX-512 subsets
    (HASWELL - {"fma"}, "x86_64", "generic"),
    (HASWELL - {"abm"}, "x86_64", "generic"),  # abm: LZCNT, part of x86-64-v3
    (SANDY_BRIDGE, "x86_64", "generic"),
    (set(), "x86_64", "generic"),
    (None, "x86_64", "generic"),  # no /proc/cpuinfo: nothing is known
    (ZEN4, "AMD64", "avx512_bf16"),
    (ZEN4, "aarch64", "generic"),  # the x86 variants never run on another machine
    ({"fp", "asimd", "sve"}, "aarch64", "generic"),
    (None, "arm64", "generic"),
])
def test_the_best_variant_the_cpu_can_run_is_chosen(flags, machine, expected):
    assert cpu_kernels.choose_variant(flags, machine) == expected
    assert cpu_kernels.runnable_variants(flags, machine)[0] == expected
    assert cpu_kernels.runnable_variants(flags, machine)[-1] == "generic"


def test_a_requested_variant_runs_only_where_the_cpu_can_run_it():
    assert cpu_kernels.choose_variant(ZEN4, "x86_64", "avx2") == "avx2"
    assert cpu_kernels.choose_variant(ZEN4, "x86_64", "generic") == "generic"
    assert cpu_kernels.choose_variant(None, "aarch64", "generic") == "generic"
    with pytest.raises(ValueError, match="TRITONLLM_CPU_ISA=avx512_bf16: this CPU lacks avx512_bf16, avx512_vnni"):
        cpu_kernels.choose_variant(SKYLAKE_X, "x86_64", "avx512_bf16")
    with pytest.raises(ValueError, match="lacks abm, avx2, bmi1, bmi2, f16c, fma, movbe; this CPU can run: generic$"):
        cpu_kernels.choose_variant(SANDY_BRIDGE, "x86_64", "avx2")
    with pytest.raises(ValueError, match="built for x86-64 and this is aarch64"):
        cpu_kernels.choose_variant(ZEN4, "aarch64", "avx2")
    with pytest.raises(ValueError, match="no such CPU kernel variant .*avx512_bf16, avx512, avx2, generic"):
        cpu_kernels.choose_variant(ZEN4, "x86_64", "avx-512")


def test_load_refuses_a_variant_the_cpu_cannot_run(monkeypatch):
    """TRITONLLM_CPU_ISA is refused before anything is built or loaded (as if on a Haswell)."""
    monkeypatch.setattr(cpu_kernels, "_state", {})  # this process's load() not done yet
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(HASWELL))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="TRITONLLM_CPU_ISA=avx512: this CPU lacks avx512bw, avx512cd, avx512dq"):
        cpu_kernels.load()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="TRITONLLM_CPU_ISA=sse9: no such CPU kernel variant"):
        cpu_kernels.load()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels.variant() == "avx2"
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    assert cpu_kernels.variant() == "avx2" and "-march=x86-64-v3" in " ".join(
        cpu_kernels._extension_args("avx2", Path("/nonexistent"))["extra_cflags"])


# g++'s -m options as /proc/cpuinfo names them. MWAIT (cpuinfo "monitor", which VMs often hide) is
# enabled by -march=x86-64-v3 but only emitted by its intrinsics, which the kernels do not use.
GCC_TO_CPUINFO = {"avx": "avx", "avx2": "avx2", "bmi": "bmi1", "bmi2": "bmi2", "f16c": "f16c", "fma": "fma",
                  "lzcnt": "abm", "movbe": "movbe", "popcnt": "popcnt", "sse3": "pni", "ssse3": "ssse3",
                  "sse4": "sse4_2", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "crc32": "sse4_2", "cx16": "cx16",
                  "sahf": "lahf_lm", "xsave": "xsave", "avx512f": "avx512f", "avx512bw": "avx512bw",
                  "avx512cd": "avx512cd", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
                  "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "mwait": None}


def _gcc_enabled(flags) -> set[str]:
    out = subprocess.run(["g++", "-Q", "--help=target", *flags], capture_output=True, text=True, check=True).stdout
    return {line.split()[0][2:] for line in out.splitlines() if line.strip().startswith("-m") and "[enabled]" in line}


@pytest.mark.skipif(not (shutil.which("g++") and cpu_kernels.compiler_targets("avx512_bf16")),
                    reason="no g++ targeting x86-64")
@pytest.mark.parametrize("name", [v.name for v in cpu_kernels.VARIANTS if v.x86])
def test_each_variant_requires_every_cpu_feature_its_flags_enable(name):
    """A variant's compiler flags may emit any instruction they enable: the CPU must show each."""
    variant = next(v for v in cpu_kernels.VARIANTS if v.name == name)
    enabled = _gcc_enabled(variant.cflags) - _gcc_enabled(["-march=x86-64"])
    unknown = enabled - GCC_TO_CPUINFO.keys()
    assert not unknown, f"map these g++ features to /proc/cpuinfo flags: {sorted(unknown)}"
    assert {GCC_TO_CPUINFO[f] for f in enabled} - {None} == variant.cpu_flags


def _default_variant() -> str:
    return cpu_kernels.choose_variant(cpu_kernels._cpu_flags(), platform.machine())


def _why_not_run(name: str) -> str | None:
    """Why the variant test of `name` skips on this machine, or None if it runs."""
    if name not in cpu_kernels.runnable_variants(cpu_kernels._cpu_flags(), platform.machine()):
        return f"this CPU cannot run the {name} variant"
    if name == _default_variant():
        return f"{name} is this CPU's default variant: the rest of the suite tests it"
    return None


HAS_CXX = bool(shutil.which("c++") or shutil.which("g++"))
AARCH64_CXX = "aarch64-linux-gnu-g++"
# torch's headers the sources include, parsed once into a precompiled header, so that each source's
# check is its own code's.
TORCH_HEADERS = sorted({m.group(1) for path in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]
                        for m in re.finditer(r"^#include <((?:ATen|c10|torch)/[^>]+)>", path.read_text(), re.M)})


def _variant_run(name: str) -> list[str]:
    tests = [str(REPO / "tests" / f) for f in ("test_cpu_kernels.py", "test_greedy_screen.py", "test_packed_gemm.py",
                                                 "test_lora_kernel.py",
                                                 "test_exact_blocks.py::test_the_block_gemm_equals_the_float32_gemm_bit_for_bit")]
    # Not the stale-lock test: it checks load()'s Python lock handling, the same for every variant (the
    # default variant's run of the suite has it), and costs a process that imports torch.
    return [sys.executable, "-m", "pytest", *tests, "-q", "-m", "unit",
            "-k", "not engine and not untied and not lock_file_left_by_a_killed_load", "-p", "no:cacheprovider"]


def _aarch64_flags() -> list[str]:
    """The flags torch's builder gives the sources (its C++ standard, c++20 in torch 2.13; its include
    folders and Python's as system headers), the generic variant's (none) and ours."""
    from torch.utils.cpp_extension import include_paths

    return ["-std=c++20", "-fPIC", "-O3", "-ffast-math", "-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]])]


@pytest.fixture(scope="module")
def subprocess_runs(request, tmp_path_factory):
    """The module's slow subprocesses for the selected tests, all started at the first of them and run as many
    at a time as there are cores, so that the aarch64 compiles (one compiler process each) overlap the
    variants' test runs (a pytest process each, mostly one core's work): ("variant", name) and ("aarch64",
    source) -> the finished subprocess, as a future; ("pch", None) -> the torch headers precompiled for
    aarch64 (hundreds of MB, removed after the module), which every aarch64 check includes."""
    selected = [item for item in request.session.items
                if item.module is request.module and "subprocess_runs" in item.fixturenames]
    variants = sorted({item.callspec.params["name"] for item in selected if "name" in item.callspec.params}
                      if HAS_CXX else set())
    variants = [name for name in variants if _why_not_run(name) is None]
    sources = sorted({item.callspec.params["source"] for item in selected if "source" in item.callspec.params}
                     if shutil.which(AARCH64_CXX) else set())
    slots = threading.Semaphore(os.cpu_count() or 1)

    def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
        with slots:
            return subprocess.run(args, capture_output=True, text=True, **kwargs)

    folder = tmp_path_factory.mktemp("aarch64_pch")
    header = folder / "torch_headers.h"
    flags = _aarch64_flags() if sources else []
    header.write_text("".join(f"#include <{h}>\n" for h in TORCH_HEADERS))

    def check(source: str, pch) -> subprocess.CompletedProcess | None:
        if pch.result().returncode != 0:
            return None  # the test reports the precompiled header's failure
        return run([AARCH64_CXX, *flags, "-Winvalid-pch", "-include", str(header), "-fsyntax-only", str(CSRC / source)],
                   timeout=300)

    with ThreadPoolExecutor(max_workers=1 + len(variants) + len(sources)) as pool:
        futures = {}
        if sources:  # first: the longest chain (the header, then the checks)
            futures["pch", None] = pool.submit(run, [AARCH64_CXX, *flags, "-x", "c++-header", str(header), "-o",
                                                     str(header) + ".gch"], timeout=300)
        for name in variants:
            futures["variant", name] = pool.submit(run, _variant_run(name), env={**os.environ, cpu_kernels.ISA_ENV: name},
                                                   cwd=REPO, timeout=900)
        for source in sources:
            futures["aarch64", source] = pool.submit(check, source, futures["pch", None])
        yield futures
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
@pytest.mark.parametrize("name", [v.name for v in cpu_kernels.VARIANTS])
def test_each_variant_this_cpu_runs_passes_the_kernel_tests(name, subprocess_runs):
    """The default variant runs the whole suite; each other one this CPU can run passes the kernel tests
    (the unit tier of tests/test_cpu_kernels.py, test_greedy_screen.py, test_packed_gemm.py and
    test_lora_kernel.py, and test_exact_blocks.py's GEMM against the float32 panels) in a
    process of its own (one variant per process), so an AVX-512 machine also tests the AVX2 and scalar
    code paths. A variant not built yet (install.sh builds them all) is built first."""
    if reason := _why_not_run(name):
        pytest.skip(reason)
    done = subprocess_runs["variant", name].result()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"CPU kernels variant {name} with" in done.stdout, done.stdout[-2000:]


@pytest.mark.skipif(not shutil.which(AARCH64_CXX),
                    reason=f"no {AARCH64_CXX} (scripts/install.sh installs g++-aarch64-linux-gnu for the test extra)")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_each_source_compiles_for_aarch64(source, subprocess_runs):
    """The generic variant on an ARM server: every x86 intrinsic behind its #if. torch's and Python's
    headers pick their own SIMD by the compiler's target defines (__aarch64__ here), not the host's."""
    pch = subprocess_runs["pch", None].result()
    assert pch.returncode == 0, "torch's headers do not compile for aarch64:\n" + pch.stderr[-6000:]
    done = subprocess_runs["aarch64", source].result()
    assert done.returncode == 0, done.stderr[-6000:]
