"""Per-request generation parameters, validated once when the request arrives."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from tritonllm.core.errors import InvalidRequestError  # re-exported: callers import it from here
from tritonllm.core.guided_request import parse_guided_request


# The parameters that are integers: a whole-number float given for one (4.0) is taken as that integer,
# as vLLM's backend takes it (int(value)); a fraction is refused rather than cut.
INT_PARAMETERS = ("max_tokens", "min_tokens", "top_k", "seed", "priority", "logprobs", "prompt_logprobs", "n",
                  "best_of", "truncate_prompt_tokens", "stream_interval")
# The parameters that are numbers with a fraction: an integer given for one is taken as a float.
FLOAT_PARAMETERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# The parameters that are booleans (`logprobs` aside: as vLLM's JSON parameter it is a count).
BOOL_PARAMETERS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
                   "include_stop_str_in_output")
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, 100 all but forces it
MAX_N = 64  # completions per request: each is a sequence of the running batch (max_num_seqs is 64 by default)


@dataclass
class SamplingParams:
    # Completions of the one prompt (vLLM's `n`): the prompt's K/V computed once and shared, each
    # completion sampled on its own (with a seed, completion i uses seed + i). `best_of`, accepted for
    # vLLM clients, must be None or n: this server returns every completion it generates.
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = 16  # None (vLLM's): as many as fit in max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text (vLLM's)
    temperature: float = 0.0  # 0: greedy (the fused argmax head)
    top_k: int = 0  # 0 (or vLLM's -1): off
    top_p: float = 1.0
    min_p: float = 0.0  # sampling keeps tokens at least min_p x the most likely one's probability (0 = off)
    # Penalties on tokens already seen, as vLLM's: repetition_penalty (1 = off) divides a seen token's
    # positive logit and multiplies a negative one (prompt and output tokens, as transformers'
    # repetition_penalty); presence_penalty and frequency_penalty (0 = off) subtract from the logit
    # of each output token once, and once per occurrence (OpenAI's definitions).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI's)
    allowed_token_ids: list[int] | None = None  # when set, only these can be chosen (vLLM's)
    bad_words: list[str] = field(default_factory=list)  # never generated (vLLM's: a word's last token is
    # banned where the output so far ends with the rest of it, the word with and without a leading space)
    seed: int | None = None  # -1, as vLLM reads it: none
    priority: int = 0  # lower runs first under scheduling_policy=priority
    skip_special_tokens: bool = True
    # vLLM's: with skip_special_tokens false, a tokenizer whose decode can space special tokens apart
    # does so; fast tokenizers (every one transformers 5 loads) write them as they are, as vLLM's own
    # fast detokenizer does.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False (vLLM's): token ids only, every text_output empty; no stop strings
    # vLLM's: a streamed response per this many new tokens (the first and the last at once), so a
    # client that reads text in chunks pays for fewer responses. None: one per step.
    stream_interval: int | None = None
    logprobs: bool = True  # each chosen token's log-prob (False: NaN; greedy rows may then use the screened head)
    # Also the log-probs of the N most likely tokens (and the chosen one's rank) at each output token:
    # vLLM's `logprobs: N` in JSON. None: off.
    top_logprobs: int | None = None
    # vLLM's `prompt_logprobs: N`: each prompt token's log-prob and rank, and the N most likely tokens
    # at its place (runner/prompt_logprobs.py). None: off.
    prompt_logprobs: int | None = None
    # Constrained output (vLLM's guided_decoding, also sent as structured_outputs): {"choice": [strings]},
    # {"regex": pattern}, {"json": schema} or {"json_object": true} (guided/decoding.py). None: free.
    # Plain data here, its form checked (core/guided_request.py); whether it can be followed is checked by
    # guided.decoding.check_guided_decoding, which the engine runs before it queues the request.
    guided_decoding: dict | None = None
    # Keep only the prompt's last k tokens (vLLM's; -1: the last max_model_len - 1). None: whole prompt.
    truncate_prompt_tokens: int | None = None
    # The LoRA adapter that serves this request (vLLM's `lora_name`: a name in the model's multi_lora.json,
    # checked by the engine). None: the base model.
    lora_name: str | None = None
    # vLLM's free-form arguments for custom sampling plugins: accepted (a JSON object) and unused, as
    # vLLM's own samplers leave them.
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def check_int(name: str, minimum: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
            if value < minimum:
                raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")

        if self.max_tokens is not None:
            check_int("max_tokens", 1)
        check_int("n", 1)
        if self.n > MAX_N:
            raise InvalidRequestError(f"n must be at most {MAX_N}, got {self.n}")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of must equal n ({self.n}) when given: every completion generated is "
                                      f"returned, got best_of={self.best_of!r}")
        self.guided_decoding = parse_guided_request(self.guided_decoding)  # its form; the engine checks the rest
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be a positive integer or -1, got {k!r}")
        check_int("min_tokens", 0)
        check_int("top_k", -1)
        if self.top_k == -1:
            self.top_k = 0
        check_int("priority", -(2**31))
        if self.stream_interval is not None:
            check_int("stream_interval", 1)
        n = self.top_logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs (top_logprobs: how many top log-probs) must be an integer in "
                                      f"[0, {MAX_TOP_LOGPROBS}], got {n!r}")
        n = self.prompt_logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in (*BOOL_PARAMETERS, "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need the output's text: they cannot be used with detokenize false")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name, lo, hi in (("temperature", 0.0, 100.0), ("top_p", 1e-6, 1.0), ("min_p", 0.0, 1.0),
                             ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise InvalidRequestError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        r = self.repetition_penalty  # vLLM's range: any finite number above 0
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
            raise InvalidRequestError(f"repetition_penalty must be a finite number above 0, got {r!r}")
        if not isinstance(self.logit_bias, dict) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            and isinstance(v, (int, float)) and not isinstance(v, bool) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
            for t, v in self.logit_bias.items()
        ):
            raise InvalidRequestError("logit_bias must map token ids (non-negative integers) to numbers in "
                                      f"[{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {self.logit_bias!r}")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids
        )):
            raise InvalidRequestError(f"allowed_token_ids must be a list of non-negative integers, got {self.allowed_token_ids!r}")
        if self.allowed_token_ids == []:  # as vLLM: no token could be chosen
            raise InvalidRequestError("allowed_token_ids must not be empty: it would allow no token")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.seed == -1:
            self.seed = None
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidRequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidRequestError(f"extra_args must be a JSON object, got {self.extra_args!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a logit_bias changes some logits before the choice (runner/logit_adjustments.py)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_words)
                or self.guided_decoding is not None)

    @classmethod
    def json_names(cls) -> frozenset[str]:
        """The keys of vLLM's JSON sampling parameters this server reads (`from_dict`)."""
        return frozenset(f.name for f in fields(cls)) - _NOT_JSON | {"structured_outputs"}

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error that names them."""
        if not isinstance(values, dict):
            raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        known = cls.json_names()
        # None stands for "the default", as vLLM reads it (clients send every key); for max_tokens that
        # is no limit but max_model_len.
        unlimited = "max_tokens" in values and values["max_tokens"] is None
        values = {k: v for k, v in values.items() if v is not None}
        if unlimited:
            values["max_tokens"] = None
        guide_name = "guided_decoding"
        if "structured_outputs" in values:  # the vLLM backend's newer name for guided_decoding
            if "guided_decoding" not in values:
                guide_name = "structured_outputs"  # errors name the field the client sent
            values.setdefault("guided_decoding", values["structured_outputs"])
            del values["structured_outputs"]
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        for name in FLOAT_PARAMETERS:
            if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
                values[name] = float(values[name])
        for name in INT_PARAMETERS:
            if isinstance(values.get(name), float) and values[name].is_integer():
                values[name] = int(values[name])
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: true is 1 (and false 0)
            if isinstance(values.get(name), bool):
                values[name] = int(values[name])
        if "logprobs" in values:
            values["top_logprobs"] = values.pop("logprobs")  # vLLM's `logprobs`: how many top log-probs
        if isinstance(values.get("logit_bias"), dict):  # JSON object keys are strings: "1234" -> 1234
            values["logit_bias"] = {_token_id(t): v for t, v in values["logit_bias"].items()}
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - defensive
            raise InvalidRequestError(str(exc)) from None
        except InvalidRequestError as exc:
            if guide_name == "guided_decoding" or not str(exc).startswith("guided_decoding"):
                raise
            raise InvalidRequestError(guide_name + str(exc)[len("guided_decoding"):]) from None


# Fields set by the server, not by a request's JSON: `logprobs` there is vLLM's count, top_logprobs here.
_NOT_JSON = frozenset({"top_logprobs"})


def _token_id(key) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
