"""Engine configuration: small dataclasses grouped by concern, built from config.pbtxt parameters.

Every field is one config.pbtxt parameter. Its name there is the field's `parameter` metadata, or
the field name itself; those names never change, so every model repository keeps loading. A value
that is unknown or malformed raises `ConfigError` naming the parameter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from tritonllm.core.parameters import ConfigError, parse_value

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority", "longest_output_first")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES + ("fp8", "fp8_e4m3")  # fp8: e4m3, scale 1 (layers/fp8.py)
QUANTIZATIONS = ("none", "fp8")
CPU_GEMMS = ("avx512", "avx512_bf16", "onednn", "aten")
GREEDY_SCREENS = ("auto", "int8", "bfloat16", "true", "false")
DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")

# Parameters that no longer do anything: a repository that sets them still loads, with a warning.
RETIRED_PARAMETERS = {
    "amx_gemm": "the AMX GEMM was removed; the exact-block and packed float32 GEMMs run instead",
    "seed": "the engine has no global seed; a request's sampling parameter `seed` makes sampling repeatable",
}


def parameter(default, name: str | None = None):
    """A field whose config.pbtxt parameter is `name` (default: the field's own name)."""
    return field(default=default, metadata={"parameter": name} if name else {})


def _positive(group, *names: str) -> None:
    for f in dataclasses.fields(group):
        if f.name in names and getattr(group, f.name) <= 0:
            raise ConfigError(f"{parameter_name(f)} must be positive, got {getattr(group, f.name)!r}")


def _non_negative(group, *names: str) -> None:
    for f in dataclasses.fields(group):
        if f.name in names and getattr(group, f.name) < 0:
            raise ConfigError(f"{parameter_name(f)} must be >= 0, got {getattr(group, f.name)!r}")


def _one_of(value, choices, name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")


def _auto_or_boolean(value) -> str:
    """`auto`, or a boolean in any of config.pbtxt's spellings (or Python's), as "true" / "false"."""
    text = str(value).strip().lower()
    return {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(text, text)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which number format, for sequences of what length."""

    path: str = parameter("default", "model")  # a Hugging Face folder, a .gguf file, or the packaged default
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on accelerators
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    # fp8: the decoder's linear weights in FP8 e4m3 with per-row scales, inputs quantized per token
    # (layers/fp8.py); lossy. none: the weights in `dtype`.
    quantization: str = "none"

    def __post_init__(self) -> None:
        _positive(self, "max_model_len")
        _one_of(self.dtype, DTYPES, "dtype")
        _one_of(self.quantization, QUANTIZATIONS, "quantization")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"  # auto | cpu | cuda[:N] | npu[:N]; auto picks npu, then cuda, then cpu
    num_threads: int = 0  # torch intra-op threads on CPU (0: torch's default; per rank with tensor parallelism)
    warmup: bool = True  # run each kind of step once at load, so no request pays for first use (runner/warmup.py)

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in DEVICE_KINDS:
            raise ConfigError(f"device must be auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        _non_negative(self, "num_threads")


@dataclass(frozen=True)
class SchedulerConfig:
    """What runs together in one step, and in which order requests are served."""

    max_num_seqs: int = 64  # sequences in the running batch
    max_num_batched_tokens: int = 512  # tokens per step: decodes plus prompt chunks
    policy: str = parameter("fcfs", "scheduling_policy")
    max_queue_size: int = 0  # waiting requests beyond which new ones are refused (0: unbounded)
    # Admission holds back the KV blocks that running sequences are certain to need (outputs of
    # ignore_eos or min_tokens), so none of them is ever preempted: steadier streams, fewer at once.
    reserve_known_growth: bool = False
    # Streamed responses carry at least this many new tokens (the first and the last excepted):
    # fewer responses cost less CPU per token. A request's own `stream_interval` can raise it.
    stream_interval: int = 1
    # The host schedules and builds step N+1 while the device runs step N (engine/engine.py). auto: on
    # where the device runs apart from the host (cuda, npu), off on the CPU, whose forward is the host's.
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "stream_interval")
        _non_negative(self, "max_queue_size")
        _one_of(self.policy, SCHEDULING_POLICIES, "scheduling_policy")
        object.__setattr__(self, "async_scheduling", _auto_or_boolean(self.async_scheduling))
        _one_of(self.async_scheduling, ("auto", "true", "false"), "async_scheduling")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, pool size, element type, prefix reuse and pruning."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = parameter(0, "num_kv_blocks")  # 0: size the pool from memory
    memory_fraction: float = parameter(0.5, "kv_cache_memory_fraction")  # of the device's free memory
    max_bytes: int = parameter(2 << 30, "kv_cache_max_bytes")  # CPU: a cap, so one model cannot take all RAM
    dtype: str = parameter("auto", "kv_cache_dtype")  # auto: the model's dtype; fp8 (lossy): e4m3
    enable_prefix_caching: bool = True
    # Models that mix sliding and full layers: the sliding layers' K/V in a pool of their own that
    # frees what falls behind the window (scheduling/window_pool.py).
    window_pool: bool = True
    num_window_blocks: int = parameter(0, "num_window_kv_blocks")  # 0: room for max_num_seqs windows
    # Recent-window KV pruning (lossy, off by default): keep the sink tokens and the last kv_window
    # tokens (or kv_window_ratio of the prompt).
    kv_window: int = 0
    kv_window_ratio: float = 0.0
    kv_sink_tokens: int = 4

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        _non_negative(self, "num_blocks", "num_window_blocks", "kv_window", "kv_sink_tokens")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 <= self.kv_window_ratio < 1.0:
            raise ConfigError(f"kv_window_ratio must be in [0, 1), got {self.kv_window_ratio}")
        if self.kv_window and self.kv_window < 2 * self.block_size:
            raise ConfigError(f"kv_window must be at least 2 * block_size ({2 * self.block_size})")
        _one_of(self.dtype, KV_CACHE_DTYPES, "kv_cache_dtype")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of greedy requests with drafts from the sequence's own n-grams
    (scheduling/ngram_draft.py). Only where drafted rows give a one-token decode's exact results."""

    num_tokens: int = parameter(4, "speculative_tokens")  # draft tokens per step (0: off)
    max_batch: int = parameter(1, "speculative_max_batch")  # every sequence drafts in steps of up to this many
    # In larger steps, a sequence drafts its j-th token while rate^j >= this, rate being how often its
    # drafts were right (1: never).
    min_acceptance: float = parameter(0.8, "speculative_min_acceptance")

    def __post_init__(self) -> None:
        _non_negative(self, "num_tokens", "max_batch")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ConfigError(f"speculative_min_acceptance must be in [0, 1], got {self.min_acceptance}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks the model is split across, one process each

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel_size")


@dataclass(frozen=True)
class CpuOptions:
    """The CPU backend's fast paths (devices/cpu/); each falls back cleanly where it cannot run."""

    gemm: str = parameter("avx512", "cpu_gemm")  # avx512 | avx512_bf16 (lossy) | onednn | aten
    # Weights that are exactly quantized blocks (a GGUF Q4_1 / Q8_0 origin) or bfloat16 values are also
    # kept in that form for steps of few rows: the same results from fewer bytes.
    exact_blocks: bool = parameter(True, "exact_block_weights")
    kernels: bool = parameter(True, "cpu_kernels")  # our C++ kernels: attention, fused layer ops, greedy head
    # Greedy ids through an 8-bit or bfloat16 LM head and a proven error bound. auto: the screen timed fastest
    # at load, where it beats the float32 head; int8 / bfloat16: that screen, always; true: the first of them
    # this CPU runs, always; false: never.
    greedy_screen: str = "auto"

    def __post_init__(self) -> None:
        _one_of(self.gemm, CPU_GEMMS, "cpu_gemm")
        # It was a boolean: True / False from Python callers, and config.pbtxt's spellings of one, still work.
        screen = str(self.greedy_screen).strip().lower()
        screen = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(screen, screen)
        object.__setattr__(self, "greedy_screen", screen)
        _one_of(self.greedy_screen, GREEDY_SCREENS, "greedy_screen")


@dataclass(frozen=True)
class CudaOptions:
    """The CUDA backend (devices/cuda/)."""

    # auto: FlashInfer's paged attention where it is installed (`pip install .[cuda]`), else the torch
    # reference; flashinfer: the same, and the load fails without it; torch: the reference.
    attention: str = parameter("auto", "cuda_attention")
    # Pure-decode steps replay CUDA graphs captured at load, one per batch-size bucket, which removes the
    # per-kernel launch cost that dominates a small model's decode step.
    graphs: bool = parameter(True, "cuda_graphs")
    graph_max_batch: int = parameter(0, "cuda_graph_max_batch")  # the largest bucket (0: max_num_seqs)

    def __post_init__(self) -> None:
        _one_of(self.attention, ("auto", "flashinfer", "torch"), "cuda_attention")
        _non_negative(self, "graph_max_batch")


@dataclass(frozen=True)
class NpuOptions:
    """The Ascend backend (devices/npu/)."""

    # auto / torch_npu: torch_npu's fused paged attention (its KV write and fused infer attention score);
    # torch: the torch reference.
    attention: str = parameter("auto", "npu_attention")

    def __post_init__(self) -> None:
        _one_of(self.attention, ("auto", "torch_npu", "torch"), "npu_attention")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA: the adapters named in the model's `multi_lora.json` (read by serving/instance_config.py),
    served beside the base model in the same batches. These limits apply where that file is present."""

    max_loras: int = 4  # adapters with rows in one step (each takes a slot of weights on the device)
    max_lora_rank: int = 16  # the highest rank an adapter may have; a higher one fails the load
    max_cpu_loras: int = 0  # adapters kept loaded in host memory (0: every declared one; else >= max_loras)
    # name -> adapter folder (PEFT's format), in multi_lora.json's order; not a config.pbtxt parameter.
    adapters: tuple = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        _positive(self, "max_loras", "max_lora_rank")
        _non_negative(self, "max_cpu_loras")
        if 0 < self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be 0 (every adapter) or at least "
                              f"max_loras ({self.max_loras})")

    @property
    def enabled(self) -> bool:
        return bool(self.adapters)


@dataclass(frozen=True)
class ServingConfig:
    """How the served model reports on itself."""

    enable_metrics: bool = True  # Triton /metrics families
    log_level: str = "info"  # debug adds one line per finished request with its timestamps
    # Threads sending responses to tritonserver, each send a round trip (serving/response_lanes.py).
    response_threads: int = 4
    # A stream's responses after its first built when its sender thread reaches them, carrying every
    # token that came meanwhile: fewer, fuller responses once the sends lag behind the steps.
    response_coalescing: bool = False

    def __post_init__(self) -> None:
        _non_negative(self, "response_threads")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, one group per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cpu: CpuOptions = field(default_factory=CpuOptions)
    cuda: CudaOptions = field(default_factory=CudaOptions)
    npu: NpuOptions = field(default_factory=NpuOptions)
    lora: LoraConfig = field(default_factory=LoraConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    @classmethod
    def from_parameters(cls, params: Mapping[str, object] | None = None, **more) -> "EngineConfig":
        """Build from parameters by their config.pbtxt names: strings as config.pbtxt holds them, or
        typed values. Unknown names are an error; retired ones are ignored with a warning."""
        return cls().with_parameters(**{**(params or {}), **more})

    def with_parameters(self, **params) -> "EngineConfig":
        """A copy with these parameters (config.pbtxt names) changed."""
        where = parameter_fields(type(self))
        changes: dict[str, dict[str, object]] = {}
        for name, raw in params.items():
            if name in RETIRED_PARAMETERS:
                logger.warning("parameter %r is ignored: %s", name, RETIRED_PARAMETERS[name])
                continue
            if name not in where:
                raise ConfigError(f"unknown parameter {name!r}; known: {', '.join(sorted(where))}")
            group, f = where[name]
            changes.setdefault(group, {})[f.name] = parse_value(name, f.type, raw)
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **values)
                                            for group, values in changes.items()})

    def parameters(self) -> dict[str, object]:
        """Every parameter's value by its config.pbtxt name."""
        return {name: getattr(getattr(self, group), f.name) for name, (group, f) in parameter_fields(type(self)).items()}


def parameter_name(f: dataclasses.Field) -> str:
    return f.metadata.get("parameter", f.name)


def parameter_fields(config_class=EngineConfig) -> dict[str, tuple[str, dataclasses.Field]]:
    """config.pbtxt name -> (group attribute, field) for every parameter of `config_class`."""
    found = {}
    for group in dataclasses.fields(config_class):
        for f in dataclasses.fields(group.default_factory):
            if not f.metadata.get("internal"):  # set by the caller, not by config.pbtxt (LoraConfig.adapters)
                found[parameter_name(f)] = (group.name, f)
    return found
