"""Turn one Triton request into engine arguments, or a clear INVALID_ARG message.

Accepts the request format of Triton's vLLM backend: `text_input`, `stream`, `sampling_parameters`
(JSON), `exclude_input_in_output`, `return_*` flags, plus `input_ids` and `apply_chat_template`.
Request parameters with sampling-parameter names work too (the HTTP generate endpoint sends them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from tritonllm.core.sampling_params import (BOOL_PARAMETERS, FLOAT_PARAMETERS, INT_PARAMETERS, InvalidRequestError,
                                            SamplingParams)
from tritonllm.core.error_kinds import KIND_PARAMETER
from tritonllm.serving.model_io import GENERATE_FLAGS, GENERATE_INPUTS

MAX_TEXT_BYTES = 1 << 20  # bounded request size: a prompt beyond 1 MiB is refused outright

_FLAGS = GENERATE_FLAGS
# A request parameter named like an input is never a sampling parameter (the flags among them count as
# flags): the HTTP generate endpoint passes a key as a parameter where the config declares no such input.
# Nor is the one asking for errors' kinds in their messages (error_kinds.py).
_NON_SAMPLING_PARAMETERS = {spec.name for spec in GENERATE_INPUTS} | {KIND_PARAMETER}
# Request parameters are scalars: these come as their JSON text, a list or an object.
_JSON_TEXT_PARAMETERS = {"stop": "[", "stop_token_ids": "[", "bad_words": "[", "allowed_token_ids": "[",
                         "logit_bias": "{", "guided_decoding": "{", "structured_outputs": "{"}


@dataclass
class ParsedRequest:
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    apply_chat_template: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False


def _scalar(array: np.ndarray, name: str):
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one value, got {flat.size}")
    return flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        if len(value) > MAX_TEXT_BYTES:
            raise InvalidRequestError(f"{name} is larger than {MAX_TEXT_BYTES} bytes")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")


def _bool(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (bytes, str)):
        text = value.decode() if isinstance(value, bytes) else value
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
    raise InvalidRequestError(f"{name} must be a boolean, got {value!r}")


def parse_request(inputs: dict[str, np.ndarray], parameters_json: str | None,
                  lora_names: tuple[str, ...] | list[str] = ()) -> ParsedRequest:
    """inputs: tensor name -> numpy array (absent optional inputs left out); `lora_names`: the model's
    LoRA adapters, which a request may name with `lora_name` (none: LoRA is not enabled)."""
    sampling: dict = {}
    flags: dict[str, bool] = {}
    if parameters_json:
        try:
            request_params = json.loads(parameters_json)
        except (json.JSONDecodeError, RecursionError):
            request_params = {}
        for key, value in request_params.items():
            if key in _FLAGS:
                flags[key] = _bool(value, key)
            elif key not in _NON_SAMPLING_PARAMETERS:
                opener = _JSON_TEXT_PARAMETERS.get(key)
                if opener and isinstance(value, str) and value.startswith(opener):
                    try:
                        value = json.loads(value)
                    except (json.JSONDecodeError, RecursionError):  # left as text: its check names the field
                        pass
                sampling[key] = value

    if "sampling_parameters" in inputs:
        raw = _text(_scalar(inputs["sampling_parameters"], "sampling_parameters"), "sampling_parameters")
        if raw.strip():
            try:
                from_json = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
            except RecursionError:
                raise InvalidRequestError("sampling_parameters is nested too deeply to read") from None
            if not isinstance(from_json, dict):
                raise InvalidRequestError("sampling_parameters must be a JSON object")
            # Beside the tensor, the vLLM backend reads no request parameter: one that is not a sampling
            # parameter (a client's own tag) is left alone rather than refused.
            known = SamplingParams.json_names()
            sampling = {k: v for k, v in sampling.items() if k in known} | from_json
    # vLLM-backend clients send numbers as strings sometimes ("max_tokens": "32").
    for key in INT_PARAMETERS:
        if isinstance(sampling.get(key), str) and sampling[key].lstrip("-").isdigit():
            sampling[key] = int(sampling[key])
    for key in BOOL_PARAMETERS:  # and booleans as "true" / "false"
        if isinstance(sampling.get(key), str):
            sampling[key] = _bool(sampling[key], key)
    for key in FLOAT_PARAMETERS:
        if isinstance(sampling.get(key), str):
            try:
                sampling[key] = float(sampling[key])
            except ValueError:
                pass
    if not lora_names and sampling.pop("lora_name", None) is not None:
        # The vLLM backend's words, which its clients match (its multi-LoRA CI test compares them whole).
        raise InvalidRequestError("LoRA feature is not enabled.")
    if sampling.get("lora_name") is not None and sampling["lora_name"] not in lora_names:
        raise InvalidRequestError(f"LoRA {sampling['lora_name']} is not supported, we currently support "
                                  f"{list(lora_names)}")
    params = SamplingParams.from_dict(sampling)

    for name in _FLAGS:
        if name in inputs:
            flags[name] = _bool(_scalar(inputs[name], name), name)

    if flags.get("stream") and flags.get("exclude_input_in_output") is False:
        # As the vLLM backend: a stream sends only new text, so asking for the prompt in it is an error
        # (left out, exclude_input_in_output defaults to true when streaming). Its exact text: its clients
        # and CI tests compare the message whole.
        raise InvalidRequestError("Error generating stream: When streaming, `exclude_input_in_output` = False is not "
                                  "allowed.")
    prompt = token_ids = None
    has_ids = "input_ids" in inputs and np.asarray(inputs["input_ids"]).size > 0
    if has_ids and "text_input" in inputs:
        raise InvalidRequestError("give the prompt as text_input or as input_ids, not both")
    if has_ids and flags.get("apply_chat_template"):
        raise InvalidRequestError("apply_chat_template takes a text_input (the user's message); input_ids are a "
                                  "prompt's tokens already, a chat template applied by the caller")
    if has_ids:
        ids = np.asarray(inputs["input_ids"]).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise InvalidRequestError("input_ids must be integers")
        token_ids = [int(t) for t in ids]
    elif "text_input" in inputs:
        prompt = _text(_scalar(inputs["text_input"], "text_input"), "text_input")
        if not prompt:
            raise InvalidRequestError("text_input is empty")
    else:
        raise InvalidRequestError("the request has no text_input (and no input_ids)")
    # Log-probs are computed for the requests that return them: the others' greedy ids can come
    # from the cheaper screened head (devices/cpu/greedy_screen.py).
    params.logprobs = flags.get("return_logprobs", False) or flags.get("return_cumulative_logprob", False)
    if not flags.get("return_logprobs", False):
        params.top_logprobs = None  # returned with return_logprobs only: not worth computing otherwise
    return ParsedRequest(prompt=prompt, prompt_token_ids=token_ids, params=params, **flags)
