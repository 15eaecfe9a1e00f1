"""Engine configuration: one validated dataclass, built from kwargs or from config.pbtxt parameters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

SCHEDULING_POLICIES = ("fcfs", "priority", "longest_output_first")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_GEMMS = ("avx512", "avx512_bf16", "onednn", "aten")


class ConfigError(ValueError):
    """A configuration value is unknown or malformed; the message names the parameter."""


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Field names are the config.pbtxt parameter names."""

    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size the pool from memory (kv_cache_memory_fraction)
    kv_cache_memory_fraction: float = 0.5
    kv_cache_max_bytes: int = 2 << 30  # CPU cap on the pool, so one model cannot take all RAM
    kv_cache_dtype: str = "auto"  # the pool's element type; auto: the model's dtype (16-bit halves KV memory and reads)
    enable_prefix_caching: bool = True
    # Models that mix sliding and full layers (Gemma 2 and 3, OLMo 3): the sliding layers' K/V in a pool
    # of their own, freed behind the window (window_pool.py); false: one pool that keeps every layer's
    window_pool: bool = True
    num_window_kv_blocks: int = 0  # the window pool's blocks (0: room for max_num_seqs windows, at most num_kv_blocks)
    kv_window: int = 0  # recent-window KV pruning: keep this many recent tokens (0: off)
    kv_window_ratio: float = 0.0  # ... or this fraction of the prompt (0: off)
    kv_sink_tokens: int = 4
    scheduling_policy: str = "fcfs"
    # true: admission holds back the KV blocks that running sequences are certain to need at their peak
    # (outputs of ignore_eos or min_tokens), so that none of them is preempted: steadier streams, fewer
    # sequences at once (scheduler.py; docs/PERFORMANCE.md "Admission"); false: admit whatever fits now (vLLM's)
    reserve_known_growth: bool = False
    max_queue_size: int = 0  # 0: unbounded waiting queue
    # Streamed responses carry at least this many new tokens (the first and the last excepted); a
    # request's `stream_interval` can raise it (vLLM's). Fewer responses cost less CPU per token.
    stream_interval: int = 1
    # Speculative decoding for greedy requests, on CPU with our kernels (where every row of a step is a
    # one-token decode's arithmetic, so the tokens are the same): up to this many draft tokens per step,
    # found where the sequence's last n-gram occurred before in it (ngram_draft.py; 0: off) ...
    speculative_tokens: int = 4
    # ... in steps of at most this many sequences. A draft row costs about what a sequence's row costs:
    # it pays where the step's fixed part (the weights streamed once) outweighs its rows, or where most
    # drafts are accepted (outputs that copy their prompt; docs/PERFORMANCE.md, engine work log)
    speculative_max_batch: int = 1
    # ... and in larger steps for a sequence whose drafts keep being right: its j-th draft token while
    # rate^j >= this, rate being how often its draft positions were right (an average kept per sequence,
    # also from the drafts it would have made; scheduler._trusted_draft_length; 1: never). A draft row
    # costs about what a sequence's row costs, so at 0.8 it gives about what a row gives at ~16 sequences
    speculative_min_acceptance: float = 0.8
    num_threads: int = 0  # torch intra-op threads on CPU (0: torch's default; per rank with tensor parallelism)
    # CPU linears, weights packed once: our AVX-512 kernel (avx512; else onednn), the same on bfloat16
    # weights (avx512_bf16: faster, lossy, opt-in; else avx512), oneDNN (onednn); or F.linear (aten)
    cpu_gemm: str = "avx512"
    # With cpu_gemm=avx512: GEMM weights that are exactly quantized blocks (a GGUF Q4_1 / Q8_0 origin, as the
    # default model's) or bfloat16 values also kept in that form for steps of few rows: same results, 2-5.3x fewer bytes
    exact_block_weights: bool = True
    # With exact_block_weights, on CPUs with AMX-BF16 (Intel Xeon 4th generation on): GEMMs of 8 rows or more run
    # those blocks on AMX tiles, exactly split into bfloat16 parts: a float32 GEMM's accuracy, not its bits. Opt-in:
    # one test run saw its results differ from run to run, not yet explained (docs/PERFORMANCE.md, engine work log)
    amx_gemm: bool = False
    cpu_kernels: bool = True  # CPU float32: our C++ kernels (decode attention, fused layer ops, greedy head); torch path if unbuilt
    # CPU float32 greedy rows that want no log-prob: the float32 head's argmax found through a bfloat16
    # LM head and a proven error bound (layers/greedy_screen.py; needs cpu_kernels and AVX512-BF16)
    greedy_screen: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split across (one process each; see tp_workers.py)
    warmup: bool = True
    enable_metrics: bool = True  # Triton /metrics families (serving only)
    log_level: str = "info"  # debug adds one line per finished request with its timestamps
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive(name: str) -> None:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "tensor_parallel_size",
                     "stream_interval"):
            positive(name)
        if self.num_kv_blocks < 0:
            raise ConfigError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if self.num_window_kv_blocks < 0:
            raise ConfigError(f"num_window_kv_blocks must be >= 0, got {self.num_window_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.kv_window < 0 or not 0.0 <= self.kv_window_ratio < 1.0:
            raise ConfigError("kv_window must be >= 0 and kv_window_ratio in [0, 1)")
        if self.kv_window and self.kv_window < 2 * self.block_size:
            raise ConfigError(f"kv_window must be at least 2 * block_size ({2 * self.block_size})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:  # auto: the model's dtype (device.resolve_kv_cache_dtype)
            raise ConfigError(f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ConfigError(f"cpu_gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        dev = self.device.split(":")[0]
        if dev not in ("auto", "cpu", "cuda", "npu"):
            raise ConfigError(f"device must be auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        if self.max_queue_size < 0 or self.num_threads < 0 or self.speculative_tokens < 0 \
                or self.speculative_max_batch < 0:
            raise ConfigError("max_queue_size, num_threads, speculative_tokens and speculative_max_batch must be >= 0")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ConfigError(f"speculative_min_acceptance must be in [0, 1], got {self.speculative_min_acceptance}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], **overrides) -> "EngineConfig":
        """Build from string parameters (config.pbtxt `parameters`); unknown names are an error."""
        return cls(**{**parse_parameters(cls, params), **overrides})

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def config_from_triton(cls, args: dict, model_config: dict):
    """config.pbtxt `parameters` plus the instance kind / device id -> a config of class `cls`.

    KIND_GPU pins the CUDA device Triton gave this instance; KIND_CPU forces the CPU;
    KIND_MODEL leaves the `device` parameter in charge (the way to pick an Ascend NPU).
    """
    params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    config = cls.from_parameters(params)
    kind = args.get("model_instance_kind", "")
    if kind == "GPU" and config.device in ("auto", "cuda"):
        config = config.replace(device=f"cuda:{args.get('model_instance_device_id', '0')}")
    elif kind == "CPU":
        if config.device not in ("auto", "cpu"):
            raise ConfigError(f"parameter 'device' is {config.device!r} but instance_group kind is KIND_CPU")
        config = config.replace(device="cpu")
    return config


def parse_parameters(cls, params: dict[str, str]) -> dict:
    """Typed values for the dataclass `cls` from string parameters; names an unknown or bad one."""
    known = {f.name: f for f in fields(cls)}
    values: dict = {}
    for name, raw in params.items():
        if name not in known:
            raise ConfigError(f"unknown parameter {name!r}; known: {', '.join(sorted(known))}")
        values[name] = _parse(name, known[name], raw)
    return values


def _parse(name: str, f: dataclasses.Field, raw):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        article = {"int": "an integer", "float": "a number", "bool": "a boolean (true/false)"}[kind]
        raise ConfigError(f"parameter {name!r} must be {article}, got {raw!r}") from None
    return text
