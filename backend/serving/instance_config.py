"""config.pbtxt parameters and the instance Triton gives this model -> the engine's config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tritonllm.core.multi_lora import read_multi_lora
from tritonllm.core.parameters import ConfigError


def config_from_triton(config_class, args: dict, model_config: dict):
    """`config_class.from_parameters` of config.pbtxt's `parameters`, the device set by the instance kind.

    KIND_GPU pins the CUDA device Triton gave this instance; KIND_CPU forces the CPU; KIND_MODEL leaves
    the `device` parameter in charge (the way to pick an Ascend NPU).
    """
    params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    device = params.get("device", "auto").strip()
    kind = args.get("model_instance_kind", "")
    if kind == "GPU" and device in ("auto", "cuda"):
        params["device"] = f"cuda:{args.get('model_instance_device_id', '0')}"
    elif kind == "CPU":
        if device not in ("auto", "cpu"):
            raise ConfigError(f"parameter 'device' is {device!r} but instance_group kind is KIND_CPU")
        params["device"] = "cpu"
    config = config_class.from_parameters(params)
    adapters = read_multi_lora(Path(args["model_repository"])) if args.get("model_repository") else ()
    if adapters:
        config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, adapters=adapters))
    return config
