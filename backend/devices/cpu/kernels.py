"""Our C++ CPU kernels (csrc/), compiled once per checkout and instruction-set variant, cached.

The ops (registered as `torch.ops.tritonllm.*`, wrapped below): paged decode attention reading K/V
in place from the block pool (paged_decode_attention.cpp); the decoder layer's fused elementwise ops,
residual add + RMSNorm, rotary + KV write, SiLU * up (fused_decoder_ops.cpp); the greedy head's
argmax + log-prob in one pass (greedy_head.cpp); the GEMM on weights packed once, in
float32 or bfloat16 (packed_gemm.cpp), and on weights that are exactly quantized blocks
(exact_block_gemm.cpp), found at load in one pass (find_exact_blocks.cpp); the float32 greedy head's argmax through a bfloat16 LM head
(screened_greedy_head.cpp) or 8-bit dot products (int8_greedy_screen.cpp); a Llama-family model's decoder layers in one call (decoder_stack.cpp); and multi-LoRA's per-row
adapter deltas, one call per linear (lora_delta.cpp); and tensor parallelism's all-reduce between the
ranks' processes through shared memory (shared_memory_all_reduce.cpp, used by shared_memory_all_reduce.py).

torch's JIT extension builder compiles the same sources once per instruction-set variant (VARIANTS):
`avx512_bf16` (-march=x86-64-v4 -mavx512vnni -mavx512bf16), `avx512` (-march=x86-64-v4), `avx2`
(-march=x86-64-v3: AVX2, FMA, F16C, BMI2) and `generic` (the compiler's baseline: x86-64, or armv8-a
with NEON on aarch64), all with generic tuning, so that one install serves any CPU. At run time a
process loads one of them (they register the same op names): the best one whose CPU features
/proc/cpuinfo lists (`choose_variant`; generic on other machines and systems), or the one named by
TRITONLLM_CPU_ISA (refused with a ValueError if this CPU cannot run it); `variant()` says which, and
`load()` logs it. Builds go into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions), one folder per variant and checkout, one process at a time (`_build_lock`);
later processes load the cached build, and a process builds only its own variant if it is missing.
`scripts/install.sh` builds every variant ahead of time (`python -m tritonllm.devices.cpu.kernels`) so
that no server start pays for the compiler. Where they cannot be built (no compiler, another OS),
`load()` returns False with the reason logged and the engine keeps the torch reference path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

import torch

logger = logging.getLogger(__name__)

_NAME = "tritonllm_cpu_kernels"
_SOURCES = [Path(__file__).parent / "csrc" / name for name in
            ("paged_decode_attention.cpp", "fused_decoder_ops.cpp", "greedy_head.cpp", "packed_gemm.cpp",
             "screened_greedy_head.cpp", "int8_greedy_screen.cpp", "exact_block_gemm.cpp",
             "find_exact_blocks.cpp", "decoder_stack.cpp",
             "lora_delta.cpp", "shared_memory_all_reduce.cpp", "registration.cpp")]
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str, "variant": str
ISA_ENV = "TRITONLLM_CPU_ISA"


@dataclass(frozen=True)
class Variant:
    """One build of the same sources for one instruction-set level: its compiler flags and the
    /proc/cpuinfo flags a CPU must show to run it (empty: any CPU the compiler targets by default)."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]
    x86: bool  # its flags are x86 flags: built and run only on x86-64


# What g++ -march=x86-64-v3 / -v4 enable beyond x86-64, as /proc/cpuinfo names them (pni: SSE3,
# abm: LZCNT, lahf_lm: SAHF; CRC32 comes with sse4_2). Generic tuning: one install serves any CPU.
_X86_V3 = frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1",
                     "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS: tuple[Variant, ...] = (  # best first
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic"),
            _X86_V4 | {"avx512_vnni", "avx512_bf16"}, x86=True),
    Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), _X86_V4, x86=True),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), _X86_V3, x86=True),
    Variant("generic", (), frozenset(), x86=False),  # the compiler's baseline: x86-64 (SSE2), armv8-a (NEON)
)
_BY_NAME = {v.name: v for v in VARIANTS}


def _is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64")


def runnable_variants(cpu_flags: Iterable[str] | None, machine: str) -> list[str]:
    """The variants a CPU with these /proc/cpuinfo flags (None: unknown) and `platform.machine()`
    can run, best first; "generic" always."""
    flags = frozenset(cpu_flags or ())
    return [v.name for v in VARIANTS
            if not v.x86 or (_is_x86(machine) and cpu_flags is not None and v.cpu_flags <= flags)]


def choose_variant(cpu_flags: Iterable[str] | None, machine: str, requested: str | None = None) -> str:
    """The variant to run: `requested` (TRITONLLM_CPU_ISA) if given, else the best the CPU can run.
    Raises ValueError for an unknown name or one this CPU cannot run."""
    runnable = runnable_variants(cpu_flags, machine)
    if not requested:
        return runnable[0]
    if requested not in _BY_NAME:
        raise ValueError(f"{ISA_ENV}={requested}: no such CPU kernel variant (one of: {', '.join(_BY_NAME)})")
    if requested not in runnable:
        wanted = _BY_NAME[requested]
        if not _is_x86(machine):
            why = f"it is built for x86-64 and this is {machine or 'an unknown machine'}"
        elif cpu_flags is None:
            why = "this CPU's flags are unknown (no /proc/cpuinfo)"
        else:
            why = f"this CPU lacks {', '.join(sorted(wanted.cpu_flags - frozenset(cpu_flags)))}"
        raise ValueError(f"{ISA_ENV}={requested}: {why}; this CPU can run: {', '.join(runnable)}")
    return requested


def _cpu_flags() -> frozenset[str] | None:
    """The CPU's flags from /proc/cpuinfo (Linux; the kernel lists AVX/AVX-512 only when it saves
    their registers), None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def variant() -> str:
    """The kernel variant this process runs (or will run at `load()`): TRITONLLM_CPU_ISA if set
    (ValueError if the CPU cannot run it), else the best one the CPU can run."""
    if "variant" in _state:
        return _state["variant"]  # type: ignore[return-value]
    return choose_variant(_cpu_flags(), platform.machine(), os.environ.get(ISA_ENV) or None)


def load() -> bool:
    """Build (first time on this machine) this CPU's variant and register `torch.ops.tritonllm.*`;
    False if impossible. Raises ValueError if TRITONLLM_CPU_ISA names a variant this CPU cannot run.
    One variant per process: they all register the same op names."""
    with _lock:
        if "ok" not in _state:
            name = variant()
            try:
                from torch.utils.cpp_extension import load as load_extension

                _put_ninja_on_path()
                build_dir = _build_directory(name)
                with _build_lock(build_dir):
                    load_extension(**_extension_args(name, build_dir), is_python_module=False, verbose=False)
                _state["ok"] = True
                _state["variant"] = name
                logger.info("CPU kernels: the %s variant (%s)", name, " ".join(_BY_NAME[name].cflags) or "no -march")
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
                _state["ok"] = False
                _state["error"] = f"{type(exc).__name__}: {exc}"
                logger.warning("CPU kernels (%s variant) unavailable, using the torch attention path: %s", name,
                               _state["error"])
        return bool(_state["ok"])


def _extension_args(name: str, build_dir: Path) -> dict:
    """torch's builder arguments for one variant: its own extension name (so its own .so) and folder."""
    # The objects use the OpenMP runtime torch already loaded (same soname, libgomp.so.1):
    # one thread pool per process, as the rest of the engine needs (engine/engine_loop.py).
    return dict(name=f"{_NAME}_{name}", sources=[str(s) for s in _SOURCES], build_directory=str(build_dir),
                extra_cflags=["-O3", *_BY_NAME[name].cflags, "-ffast-math", "-fopenmp", _headers_flag()],
                extra_ldflags=["-fopenmp"])


def _compiler() -> str:
    try:
        from torch.utils.cpp_extension import get_cxx_compiler
        return get_cxx_compiler()
    except ImportError:
        return os.environ.get("CXX", "c++")


def compiler_targets(name: str) -> bool:
    """Whether the C++ compiler accepts this variant's flags (an aarch64 g++ takes no -march=x86-64-v4)."""
    try:
        done = subprocess.run([_compiler(), *_BY_NAME[name].cflags, "-x", "c++", "-E", "-o", os.devnull, "-"],
                              input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def build(name: str) -> None:
    """Compile one variant into its folder without loading it (this CPU need not run it), under the
    same locks as `load()`; a cached, current build costs a ninja no-op."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    build_dir = _build_directory(name)
    args = _extension_args(name, build_dir)
    with _build_lock(build_dir):
        # torch's builder has no public build-without-load; this is the step `load()` runs before loading.
        cpp_extension._write_ninja_file_and_build_library(
            name=args["name"], sources=args["sources"], extra_cflags=args["extra_cflags"], extra_cuda_cflags=[],
            extra_sycl_cflags=[], extra_ldflags=args["extra_ldflags"], extra_include_paths=[],
            build_directory=args["build_directory"], verbose=False, with_cuda=False, with_sycl=False)


def _headers_flag() -> str:
    """A define carrying a digest of csrc/*.h: torch's builder rebuilds when the sources or the flags
    change, and it does not look at included headers, so their digest goes into the flags."""
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]
    return f"-DTRITONLLM_HEADERS_DIGEST={digest}"


def _build_directory(name: str | None = None) -> Path:
    """Where torch's builder keeps a variant (default: this process's) of this extension
    (TORCH_EXTENSIONS_DIR or its default root): one folder per variant and checkout. torch's builder
    rebuilds whenever the source paths or flags differ from the last build's, so two checkouts (or
    installs, or variants) sharing one folder would recompile each other's build at every server start."""
    name = name or variant()
    folder = f"{_NAME}_{name}-{hashlib.sha256(str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]}"
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(folder, verbose=False))
    except ImportError:  # a torch without the helper: the documented root, one folder per extension
        from torch.utils.cpp_extension import get_default_build_root
        path = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / folder
        path.mkdir(parents=True, exist_ok=True)
        return path


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialise loads of the extension across processes with a lock the kernel drops when its
    holder dies, and clear torch's own lock file while holding it.

    Every load, even of a cached build, takes torch's file lock (`build_dir/lock`, created and
    removed by the loading process) while ninja confirms the build. A process killed in that
    window (a server stopped during model load, a machine restarted mid-build) leaves the file
    behind, and every later load on the machine then waits for it forever. All our loads hold this
    lock first, so a `lock` file found while holding it belongs to no live process.
    """
    if fcntl is None:  # not POSIX: torch's own lock only
        yield
        return
    with open(build_dir / "tritonllm.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a process that died while loading the CPU kernels", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` (also to confirm a cached build); PyPI's ninja puts it next to
    the venv's python, which Triton's stub process does not have on its PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")


def error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           row_seq: torch.Tensor, row_end: torch.Tensor, row_start: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Each query row's attention over the keys it sees, read in place from the pool.

    q [rows, heads, d] float32, one row per query token (decodes and prompt tokens alike); caches
    [kv_heads, blocks, block_size, d] (float32, float16 or bfloat16); `block_table` [num_seqs,
    max_blocks] int32: the step's `SequenceBatch.block_table` as is (-1: a block given back, skipped);
    per row, each [rows] int32 (attention_rows.py): `row_seq`, the sequence whose table it reads;
    `row_end`, its position + 1 (it sees keys at positions < row_end); `row_start`, 0 or, in a sliding
    layer, its position + 1 - window clamped at 0 (it sees keys at positions >= row_start).
    -> [rows, heads, d] float32."""
    return torch.ops.tritonllm.paged_decode_attention(q, k_cache, v_cache, block_table, row_seq, row_end, row_start,
                                                      scale)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns RMSNorm(residual) * weight. [tokens, hidden] float32."""
    return torch.ops.tritonllm.add_rms_norm_(residual, x, weight, eps)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotary on Q and K of qkv [tokens, heads + 2 kv_heads, d]; rotated K and V into the pool at
    `slot_mapping`; returns rotated Q [tokens, heads, d]."""
    return torch.ops.tritonllm.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * intermediate] -> SiLU(gate) * up, [tokens, intermediate]."""
    return torch.ops.tritonllm.silu_mul(gate_up)


def lora_delta_(y: torch.Tensor, x: torch.Tensor, a: list, b: list, parts: list, segments: list[int]) -> torch.Tensor:
    """y [rows, out] += each run's adapter delta (x A^T) B, in place: per slot its A [ranks, in], B [ranks, out]
    and parts [P, 4] (or None: a slot that leaves this linear alone); segments: (slot, first, end) flat."""
    return torch.ops.tritonllm.lora_delta_(y, x, a, b, parts, segments)


def greedy_head(logits: torch.Tensor, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [batch, vocab] float32 -> (argmax ids int64 [batch], their log-probs float32 [batch]; NaN
    without `logprobs`, which skips their pass over the logits)."""
    return torch.ops.tritonllm.greedy_head(logits, logprobs)


def packed_gemm_supported() -> bool:
    """Whether our GEMM runs here: the kernels built, in a variant with AVX-512 or AVX2 + FMA (fixed at build time)."""
    return load() and bool(torch.ops.tritonllm.packed_gemm_supported())


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> [ceil(out / 32), in, 32] panels, the layout `packed_gemm` reads."""
    return torch.ops.tritonllm.pack_gemm_weight(weight)


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out_features], W as packed by `pack_gemm_weight`."""
    return torch.ops.tritonllm.packed_gemm(x, packed, bias, out_features)


def find_exact_blocks(weight: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """float32 weight [out, in] -> its Q4_1 (levels 15: q uint8, d, m) or Q8_0 (levels 127: q int8, d, None)
    blocks as exact_blocks.py defines them, found in one pass; None where some block is not of that form."""
    q, d, m = torch.ops.tritonllm.find_exact_blocks(weight, levels)
    if q.numel() == 0 and weight.numel():
        return None
    return q, d, (m if levels == 15 else None)


def pack_block_weight(q: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight given as its exact quantized blocks, per 32 along K: fl(fl(d * q) + m) with q uint8 0..15
    (Q4_1), fl(d * q) with q int8 and m None (Q8_0), or q bfloat16 itself with d and m None; q [out, in],
    d and m [out, in / 32] float32 -> (codes, scales), the layout `block_gemm` reads."""
    return torch.ops.tritonllm.pack_block_weight(q, d, m)


def block_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
    """`packed_gemm` on the quantized blocks of the same weight: the same float32 result, bit for bit."""
    return torch.ops.tritonllm.block_gemm(x, codes, scales, bias, out_features)


def packed_gemm_bf16_supported() -> bool:
    """Whether our bfloat16-weight GEMM runs here: the avx512_bf16 variant (AVX-512 BF16 dot products)."""
    return load() and bool(torch.ops.tritonllm.packed_gemm_bf16_supported())


def pack_gemm_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> bfloat16 [ceil(out / 32), ceil(in / 2), 32, 2]: k pairs of 32-column panels."""
    return torch.ops.tritonllm.pack_gemm_weight_bf16(weight)


def packed_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                     in_features: int) -> torch.Tensor:
    """float32 x [..., in] rounded to bfloat16, @ W^T with float32 sums (+ bias) -> float32 [..., out_features]."""
    return torch.ops.tritonllm.packed_gemm_bf16(x, packed, bias, out_features, in_features)


def screened_greedy_head(x: torch.Tensor, approx: torch.Tensor, weight: torch.Tensor,
                         col_bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 argmax of x @ weight^T from `approx` (bfloat16-GEMM logits) and the error bound
    ||x|| * col_bounds: x [rows, K], approx [rows, V], weight [V, K], col_bounds [V], all float32
    -> (ids int64 [rows], how many tokens each row recomputed in float32 int64 [rows])."""
    return torch.ops.tritonllm.screened_greedy_head(x, approx, weight, col_bounds)


def int8_screen_supported() -> bool:
    """Whether the 8-bit greedy screen runs here: the avx512_bf16 variant (AVX512-VNNI) and the avx2 one."""
    return load() and bool(torch.ops.tritonllm.int8_screen_supported())


def int8_screen_instructions() -> str:
    """The integer dot products the 8-bit screen runs on here: "AVX512-VNNI", "AVX-VNNI" (the avx2 variant
    on a CPU that has it) or "AVX2"; "" without the screen."""
    return str(torch.ops.tritonllm.int8_screen_instructions()) if load() else ""


def int8_greedy_screen(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, negq: torch.Tensor, c: torch.Tensor,
                       weight: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 argmax of x @ weight^T through the 8-bit screen (greedy_screen.Int8GreedyScreen packs the
    rest, c for `steps`): x [rows, K], weight [V, K] float32 -> (ids int64 [rows], tokens recomputed per row
    int64 [rows]). x is quantized to `steps` 127 (a VNNI dot product) or 63 (plain AVX2's)."""
    return torch.ops.tritonllm.int8_greedy_screen(x, codes, d, negq, c, weight, steps)


def int8_screen_steps() -> int:
    """The steps x is quantized to by the fastest integer dot product here: 127 with VNNI, 63 with plain AVX2."""
    return 127 if int8_screen_instructions() in ("AVX512-VNNI", "AVX-VNNI") else 63


def shm_all_reduce_segment_bytes(world_size: int, slot_bytes: int) -> int:
    """The bytes of a shared-memory all-reduce segment for `world_size` ranks with slots of `slot_bytes`
    (a multiple of 128)."""
    return int(torch.ops.tritonllm.shm_all_reduce_segment_bytes(world_size, slot_bytes))


def shm_all_reduce_init(segment: torch.Tensor, world_size: int, slot_bytes: int) -> None:
    """Rank 0 lays out a new segment (uint8, mapped by every rank, zeroed) for `world_size` ranks."""
    torch.ops.tritonllm.shm_all_reduce_init(segment, world_size, slot_bytes)


def shm_all_reduce_join(segment: torch.Tensor, rank: int, pid: int) -> int:
    """`rank` (process `pid`) has mapped the segment; returns the world size it was laid out for."""
    return int(torch.ops.tritonllm.shm_all_reduce_join(segment, rank, pid))


def shm_all_reduce_joined(segment: torch.Tensor) -> int:
    """How many ranks have joined the segment."""
    return int(torch.ops.tritonllm.shm_all_reduce_joined(segment))


def shm_all_reduce_abort(segment: torch.Tensor) -> None:
    """Set the segment's abort word: every rank waiting in an all-reduce on it fails at once."""
    torch.ops.tritonllm.shm_all_reduce_abort(segment)


def shm_all_reduce_(x: torch.Tensor, segment: torch.Tensor, rank: int, timeout_s: float) -> torch.Tensor:
    """x (contiguous float32, bfloat16 or float16) summed in place over every rank of the segment, in rank
    order (the same bits on every rank). RuntimeError, naming the rank, if a rank it waits on dies, the
    abort word is set, or it waits more than `timeout_s`."""
    return torch.ops.tritonllm.shm_all_reduce_(x, segment, rank, timeout_s)


def main() -> None:
    """`python -m tritonllm.devices.cpu.kernels`: build every variant the compiler can target, one
    after another (install time: one install then serves any CPU), load this CPU's, say whether it
    worked. With `--this-cpu`: only load (building if needed) the variant this process runs. With
    `--runnable`: build only the variants this CPU can run (what a test install here uses)."""
    logging.basicConfig(level=logging.INFO)
    args = sys.argv[1:]
    wanted = VARIANTS
    if "--this-cpu" in args:
        wanted = ()
    elif "--runnable" in args:
        runnable = runnable_variants(_cpu_flags(), platform.machine())
        wanted = tuple(v for v in VARIANTS if v.name in runnable)
        if skipped := [v.name for v in VARIANTS if v.name not in runnable]:
            logger.info("CPU kernels: only the variants this CPU runs are built, not %s", ", ".join(skipped))
    built = []
    for v in wanted:
        if v.x86 and not compiler_targets(v.name):
            logger.info("CPU kernels: the compiler does not target the %s variant; skipped", v.name)
            continue
        start = time.perf_counter()
        try:
            build(v.name)
        except Exception as exc:  # noqa: BLE001 - another variant may still build; load() reports this CPU's
            logger.warning("CPU kernels: the %s variant did not build: %s: %s", v.name, type(exc).__name__, exc)
            continue
        built.append(f"{v.name} {time.perf_counter() - start:.1f} s")
    ok = load()
    print("tritonllm CPU kernels:", f"ready, variant {variant()}" if ok else f"unavailable ({error()})",
          f"(built: {', '.join(built) or 'none'})", file=sys.stdout)


if __name__ == "__main__":
    main()
