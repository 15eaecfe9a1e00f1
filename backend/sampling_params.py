"""Per-request generation parameters, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


# The parameters that are numbers with a fraction: an integer given for one is taken as a float.
FLOAT_PARAMETERS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class InvalidRequestError(ValueError):
    """The caller sent something unusable; the message says what. Other requests are unaffected."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0  # 0: greedy (the fused argmax head)
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    # Penalties on tokens already seen, as vLLM's: repetition_penalty (1 = off) divides a seen token's
    # positive logit and multiplies a negative one (prompt and output tokens, as transformers'
    # repetition_penalty); presence_penalty and frequency_penalty (0 = off) subtract from the logit
    # of each output token once, and once per occurrence (OpenAI's definitions).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    priority: int = 0  # lower runs first under scheduling_policy=priority
    skip_special_tokens: bool = True
    logprobs: bool = True  # each chosen token's log-prob (False: NaN; greedy rows may then use the screened head)

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

        check_int("max_tokens", 1)
        check_int("min_tokens", 0)
        check_int("top_k", 0)
        check_int("priority", -(2**31))
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name, lo, hi in (("temperature", 0.0, 100.0), ("top_p", 1e-6, 1.0), ("repetition_penalty", 1e-6, 100.0),
                             ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise InvalidRequestError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error that names them."""
        if not isinstance(values, dict):
            raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        for name in FLOAT_PARAMETERS:
            if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
                values[name] = float(values[name])
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - defensive
            raise InvalidRequestError(str(exc)) from None
