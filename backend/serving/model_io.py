"""The inputs and outputs of our Triton models, defined once.

Triton learns them from here: each model's `auto_complete_config` (Triton calls it while loading a
model, before `initialize`) adds what the model's config.pbtxt leaves out, so a config.pbtxt only
sets the backend, the instance group and the parameters. The code that reads requests takes the
input names from here too. What Triton ends up serving: `GET /v2/models/<name>/config`, or
tritonclient's `get_model_config`.

A config.pbtxt may still list tensors itself (repositories written before): Triton's vLLM backend
does the same as we do, keeping what a config.pbtxt lists as it is and adding only what is missing.
Dims leave out the batch dimension: both models take `max_batch_size: 0` because their engines
batch across requests themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton's TYPE_* name, as config.pbtxt writes it
    dims: tuple[int, ...]  # -1: any length
    optional: bool = False  # inputs only: a request may leave it out

    def input_config(self) -> dict:
        """As `ModelConfig.add_input` takes it."""
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims), "optional": self.optional}

    def output_config(self) -> dict:
        """As `ModelConfig.add_output` takes it (which refuses an `optional` key)."""
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}


# The generate model (serving/generate_model.py): the request format of Triton's vLLM backend, so
# its clients work unchanged, plus `input_ids`, `apply_chat_template`, `output_ids` and the log-probs
# outputs. Everything is optional: a request needs `text_input` or `input_ids`, which the request
# parser checks with a clearer message than Triton's.
GENERATE_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=True),  # the prompt
    TensorSpec("input_ids", "TYPE_INT32", (-1,), optional=True),  # or the prompt as token ids
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),  # a response per step, not one at the end
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),  # a JSON object
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("apply_chat_template", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_logprobs", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_cumulative_logprob", "TYPE_BOOL", (1,), optional=True),
)
# [-1]: one value per completion (n of them), or per new token for the token-level outputs.
GENERATE_OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("output_ids", "TYPE_INT32", (-1,)),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1,)),
    TensorSpec("logprobs", "TYPE_STRING", (-1,)),  # JSON: each token's top log-probs
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),
    TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,)),
    TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,)),
    TensorSpec("prompt_logprobs", "TYPE_STRING", (1,)),  # JSON
)
# The boolean inputs are flags: a request may send them as request parameters too (request_parsing.py).
GENERATE_FLAGS = tuple(spec.name for spec in GENERATE_INPUTS if spec.data_type == "TYPE_BOOL")

# The embedding model (serving/embedding_model.py).
EMBEDDING_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (-1,), optional=True),  # one or many texts
    TensorSpec("normalize", "TYPE_BOOL", (1,), optional=True),  # default: the `normalize` parameter
)


def embedding_outputs(dim: int = -1) -> tuple[TensorSpec, ...]:
    """[texts, dim]: dim is the model's hidden size, -1 where it is not known before the model loads."""
    return (TensorSpec("embedding", "TYPE_FP32", (-1, dim)),)


def complete_config(auto_complete_model_config, inputs, outputs, decoupled: bool | None = None):
    """Add to Triton's model config what config.pbtxt leaves out; return it (what auto_complete_config returns).

    What config.pbtxt sets is kept: its tensors, and its transaction policy. `decoupled`, when given,
    is the policy a config.pbtxt that names none gets. max_batch_size is 0 (our engines batch across
    requests); a config.pbtxt that asks for Triton's batching is refused here, since the batch
    dimension would change every tensor's shape from the one our clients send.
    """
    config = auto_complete_model_config.as_dict()
    if config.get("max_batch_size", 0) > 0:
        raise ValueError(f"model '{config.get('name')}': max_batch_size {config['max_batch_size']} asks for "
                         "Triton's batching, but the engine batches across requests itself: "
                         "set max_batch_size: 0 in config.pbtxt, or leave it out")
    auto_complete_model_config.set_max_batch_size(0)
    listed_inputs = {tensor["name"] for tensor in config.get("input", [])}
    listed_outputs = {tensor["name"] for tensor in config.get("output", [])}
    for spec in inputs:
        if spec.name not in listed_inputs:
            auto_complete_model_config.add_input(spec.input_config())
    for spec in outputs:
        if spec.name not in listed_outputs:
            auto_complete_model_config.add_output(spec.output_config())
    # Triton leaves model_transaction_policy out of the config it passes unless config.pbtxt sets it,
    # so an explicit `decoupled: false` is seen here and kept (initialize then says what is wrong).
    if decoupled is not None and "decoupled" not in config.get("model_transaction_policy", {}):
        auto_complete_model_config.set_model_transaction_policy({"decoupled": decoupled})
    return auto_complete_model_config


def missing_inputs_error(model_config: dict, inputs) -> str | None:
    """Why a loaded config cannot take requests: it declares none of our inputs. None when it does.

    That happens when config.pbtxt lists no tensors and tritonserver runs without auto-complete
    (`--disable-auto-complete-config`, or the older `--strict-model-config=true`): Triton then loads
    the model as it is and refuses every request's tensors as unexpected.
    """
    declared = {tensor["name"] for tensor in model_config.get("input", [])}
    if declared & {spec.name for spec in inputs}:
        return None
    return ("config.pbtxt lists no inputs and Triton did not add them: tritonserver runs without "
            "auto-complete (--disable-auto-complete-config or --strict-model-config=true). Start it without "
            "that flag, or list the inputs and outputs in config.pbtxt (tritonllm.serving.model_io defines them)")
