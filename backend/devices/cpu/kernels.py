"""Our C++ CPU kernels (csrc/), compiled once per checkout on first use and cached.

The ops (registered as `torch.ops.tritonllm.*`, wrapped below): paged decode attention reading K/V
in place from the block pool (paged_decode_attention.cpp); the decoder layer's fused elementwise ops,
residual add + RMSNorm, rotary + KV write, SiLU * up (fused_decoder_ops.cpp); the greedy head's
argmax + log-prob in one pass (greedy_head.cpp); on AVX-512 CPUs the GEMM on weights packed once, in
float32 or bfloat16 (packed_gemm.cpp), and on weights that are exactly quantized blocks
(exact_block_gemm.cpp); the float32 greedy head's argmax through a bfloat16 LM head
(screened_greedy_head.cpp) or 8-bit dot products (int8_greedy_screen.cpp); and a Llama-family model's decoder layers in one call (decoder_stack.cpp).

torch's JIT extension builder compiles them with the machine's g++ for its own CPU (-march=native)
into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), one folder
per checkout, one process at a time (`_build_lock`); later processes load the cached build.
`scripts/install.sh` builds them ahead of time so that no server start pays for the compiler. Where
they cannot be built (no compiler, another OS), `load()` returns False with the reason logged and
the engine keeps the torch reference path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
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
             "screened_greedy_head.cpp", "int8_greedy_screen.cpp", "exact_block_gemm.cpp", "decoder_stack.cpp")]
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str


def load() -> bool:
    """Build (first time on this machine) and register `torch.ops.tritonllm.*`; False if impossible."""
    with _lock:
        if "ok" not in _state:
            try:
                from torch.utils.cpp_extension import load as load_extension

                _put_ninja_on_path()
                build_dir = _build_directory()
                with _build_lock(build_dir):
                    # The objects use the OpenMP runtime torch already loaded (same soname, libgomp.so.1):
                    # one thread pool per process, as the rest of the engine needs (engine/engine_loop.py).
                    load_extension(name=_NAME, sources=[str(s) for s in _SOURCES], build_directory=str(build_dir),
                                   extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp", _headers_flag()],
                                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
                _state["ok"] = True
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
                _state["ok"] = False
                _state["error"] = f"{type(exc).__name__}: {exc}"
                logger.warning("CPU kernels unavailable, using the torch attention path: %s", _state["error"])
        return bool(_state["ok"])


def _headers_flag() -> str:
    """A define carrying a digest of csrc/*.h: torch's builder rebuilds when the sources or the flags
    change, and it does not look at included headers, so their digest goes into the flags."""
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]
    return f"-DTRITONLLM_HEADERS_DIGEST={digest}"


def _build_directory() -> Path:
    """Where torch's builder keeps this extension (TORCH_EXTENSIONS_DIR or its default root): one
    folder per checkout. torch's builder rebuilds whenever the source paths differ from the last
    build's, so two checkouts (or installs) sharing one folder would recompile each other's build at
    every server start."""
    folder = f"{_NAME}-{hashlib.sha256(str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]}"
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


def greedy_head(logits: torch.Tensor, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [batch, vocab] float32 -> (argmax ids int64 [batch], their log-probs float32 [batch]; NaN
    without `logprobs`, which skips their pass over the logits)."""
    return torch.ops.tritonllm.greedy_head(logits, logprobs)


def packed_gemm_supported() -> bool:
    """Whether our GEMM runs here: the kernels built, for a CPU with AVX-512 (checked at build time)."""
    return load() and bool(torch.ops.tritonllm.packed_gemm_supported())


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> [ceil(out / 32), in, 32] panels, the layout `packed_gemm` reads."""
    return torch.ops.tritonllm.pack_gemm_weight(weight)


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out_features], W as packed by `pack_gemm_weight`."""
    return torch.ops.tritonllm.packed_gemm(x, packed, bias, out_features)


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
    """Whether our bfloat16-weight GEMM runs here: AVX-512 with its BF16 dot products (checked at build time)."""
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
    """Whether the 8-bit greedy screen runs here: AVX-512 with VNNI (checked at build time)."""
    return load() and bool(torch.ops.tritonllm.int8_screen_supported())


def int8_greedy_screen(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, negq: torch.Tensor, c: torch.Tensor,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 argmax of x @ weight^T through the 8-bit screen (greedy_screen.Int8GreedyScreen packs the
    rest): x [rows, K], weight [V, K] float32 -> (ids int64 [rows], tokens recomputed per row int64 [rows])."""
    return torch.ops.tritonllm.int8_greedy_screen(x, codes, d, negq, c, weight)


def main() -> None:
    """`python -m tritonllm.devices.cpu.kernels`: build now (install time) and say whether it worked."""
    logging.basicConfig(level=logging.INFO)
    ok = load()
    print("tritonllm CPU kernels:", "ready" if ok else f"unavailable ({error()})")


if __name__ == "__main__":
    main()
