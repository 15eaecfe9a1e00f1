"""Workload scenarios (YAML) and the deterministic request lists they describe.

A scenario file looks like::

    name: smoke
    num_requests: 8
    interval_s: 0.05          # fixed interval between sends; or `rate: 4.0` (Poisson, requests/s)
    seed: 0
    prompt_len: {dist: uniform, min: 8, max: 24}     # in words
    output_len: {dist: uniform, min: 8, max: 16}     # in tokens (max_tokens with ignore_eos)
    chat_template: true
    ignore_eos: true          # default true: every request produces exactly output_len tokens
    max_concurrency: 1        # optional: requests in flight at most (1: one stream at a time)
    temperature: 0.0          # default greedy

Lengths: `prompt_len` counts words of English text (about 1.1 tokens per word for SmolLM2's
tokenizer, more once the chat template is applied); `output_len` counts tokens exactly.
Distributions: `{dist: fixed, value: N}` (or a bare integer), `{dist: uniform, min: A, max: B}`
(integers, inclusive), `{dist: choice, values: [...], weights: [...]}` (weights optional),
`{dist: normal, mean: M, std: S, min: A, max: B}` (rounded, clipped).
Prompts are built from the fixed sentence list below with `random.Random(seed)`: the same scenario
and seed always give the same prompts, lengths and send times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

# Varied English sentences and questions; prompts are cut from a shuffled stream of them.
SENTENCES = (
    "What is the capital of France?",
    "Explain how a rainbow forms after a summer storm.",
    "Write a short poem about the sea at night.",
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Why do cats purr when they are content?",
    "Describe the water cycle in simple terms for a child.",
    "List three ways to save energy at home.",
    "The train was late, so we walked along the river and watched the boats.",
    "How does a computer store numbers in memory?",
    "Give me a recipe for a simple tomato soup.",
    "In the morning the market fills with the smell of fresh bread and coffee.",
    "What are the main differences between a planet and a star?",
    "Summarize the plot of a mystery story in two sentences.",
    "Mountains covered in snow reflected the pink light of the setting sun.",
    "Can you suggest a name for a small bakery by the harbour?",
    "Translate the phrase good morning into Spanish and German.",
    "Our team meets on Tuesdays to plan the next release of the software.",
    "Why is the sky blue during the day and red at sunset?",
    "Tell me a fun fact about octopuses.",
    "She opened the letter slowly, afraid of what it might say.",
    "What should I pack for a three day hiking trip?",
    "Explain the difference between weather and climate.",
    "The library was quiet except for the soft turning of pages.",
    "How do bees make honey from flowers?",
    "Write a friendly email inviting a colleague to lunch.",
    "Children ran through the park chasing bubbles in the warm afternoon.",
    "What is a good way to start learning to play the guitar?",
    "Describe a busy city street on a rainy evening.",
    "Which fruits are rich in vitamin C?",
    "The scientist checked the results twice before sharing them with anyone.",
    "How far away is the Moon from the Earth?",
    "Give three tips for writing clear instructions.",
    "A gentle wind carried the scent of pine trees across the valley.",
    "What does a good night of sleep do for the brain?",
    "Explain what a recipe and a computer program have in common.",
    "The chess players sat in silence, each thinking many moves ahead.",
    "Why do leaves change colour in autumn?",
    "Suggest a simple exercise routine for someone who sits all day.",
    "Farmers gathered the harvest before the first frost arrived.",
    "What is the tallest animal in the world and why is it so tall?",
)

Dist = dict[str, Any]


def _check_dist(spec: Any, what: str) -> Dist:
    if isinstance(spec, bool):
        raise ValueError(f"{what}: expected an integer or a distribution, got {spec!r}")
    if isinstance(spec, int):
        spec = {"dist": "fixed", "value": spec}
    if not isinstance(spec, dict) or "dist" not in spec:
        raise ValueError(f"{what}: expected an integer or {{dist: ..., ...}}, got {spec!r}")
    kind = spec["dist"]
    need = {"fixed": ("value",), "uniform": ("min", "max"), "choice": ("values",), "normal": ("mean", "std")}
    if kind not in need:
        raise ValueError(f"{what}: unknown dist {kind!r} (fixed, uniform, choice, normal)")
    missing = [k for k in need[kind] if k not in spec]
    if missing:
        raise ValueError(f"{what}: dist {kind} needs {', '.join(missing)}")
    if kind == "uniform" and int(spec["min"]) > int(spec["max"]):
        raise ValueError(f"{what}: min > max")
    if kind == "choice" and not spec["values"]:
        raise ValueError(f"{what}: choice needs at least one value")
    values = _support(spec)
    if min(values) < 1:
        raise ValueError(f"{what}: lengths must be >= 1")
    return dict(spec)


def _support(spec: Dist) -> list[int]:
    kind = spec["dist"]
    if kind == "fixed":
        return [int(spec["value"])]
    if kind == "uniform":
        return [int(spec["min"]), int(spec["max"])]
    if kind == "choice":
        return [int(v) for v in spec["values"]]
    return [int(spec.get("min", 1)), int(spec.get("max", max(1, round(spec["mean"] + 4 * spec["std"]))))]


def sample(spec: Dist, rng: random.Random) -> int:
    """Draw one integer length from a distribution spec."""
    kind = spec["dist"]
    if kind == "fixed":
        return int(spec["value"])
    if kind == "uniform":
        return rng.randint(int(spec["min"]), int(spec["max"]))
    if kind == "choice":
        return int(rng.choices(spec["values"], weights=spec.get("weights"))[0])
    lo, hi = _support(spec)
    return int(min(max(round(rng.gauss(float(spec["mean"]), float(spec["std"]))), lo), hi))


def make_prompt(num_words: int, rng: random.Random) -> str:
    """About `num_words` words of text cut from the sentence list, starting at a random sentence."""
    order = list(range(len(SENTENCES)))
    rng.shuffle(order)
    words: list[str] = []
    i = 0
    while len(words) < num_words:
        words.extend(SENTENCES[order[i % len(order)]].split())
        i += 1
    return " ".join(words[:num_words])


@dataclass
class Scenario:
    name: str
    num_requests: int
    prompt_len: Dist
    output_len: Dist
    interval_s: Optional[float] = None
    rate: Optional[float] = None
    seed: int = 0
    chat_template: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    description: str = ""
    source: Optional[str] = None
    max_concurrency: Optional[int] = None  # requests in flight at most (1: one stream); None: the sender's limit

    @property
    def arrival(self) -> str:
        return "poisson" if self.rate is not None else "fixed"

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "num_requests", "interval_s", "rate", "seed",
                                            "prompt_len", "output_len", "chat_template", "ignore_eos",
                                            "temperature", "source", "max_concurrency")}
        d["arrival"] = self.arrival
        return d


_KEYS = {"name", "description", "num_requests", "interval_s", "rate", "seed", "prompt_len",
         "output_len", "chat_template", "ignore_eos", "temperature", "max_concurrency"}


def scenario_from_dict(data: dict, source: Optional[str] = None) -> Scenario:
    if not isinstance(data, dict):
        raise ValueError("a scenario must be a YAML mapping")
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"unknown scenario keys: {', '.join(sorted(unknown))}")
    for key in ("num_requests", "prompt_len", "output_len"):
        if key not in data:
            raise ValueError(f"scenario needs `{key}`")
    if data.get("interval_s") is not None and data.get("rate") is not None:
        raise ValueError("give either `interval_s` or `rate`, not both")
    num = int(data["num_requests"])
    if num < 1:
        raise ValueError("num_requests must be >= 1")
    interval = data.get("interval_s")
    rate = data.get("rate")
    if interval is None and rate is None:
        interval = 0.0
    if interval is not None and float(interval) < 0:
        raise ValueError("interval_s must be >= 0")
    if rate is not None and float(rate) <= 0:
        raise ValueError("rate must be > 0")
    limit = data.get("max_concurrency")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError("max_concurrency must be an integer >= 1")
    return Scenario(
        name=str(data.get("name") or (Path(source).stem if source else "scenario")),
        description=str(data.get("description", "")),
        num_requests=num,
        interval_s=None if interval is None else float(interval),
        rate=None if rate is None else float(rate),
        seed=int(data.get("seed", 0)),
        prompt_len=_check_dist(data["prompt_len"], "prompt_len"),
        output_len=_check_dist(data["output_len"], "output_len"),
        chat_template=bool(data.get("chat_template", True)),
        ignore_eos=bool(data.get("ignore_eos", True)),
        temperature=float(data.get("temperature", 0.0)),
        source=source,
        max_concurrency=limit,
    )


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file (ValueError / OSError with a clear message)."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    try:
        return scenario_from_dict(data, source=str(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass
class RequestSpec:
    """One request of a replay: what to send and when (seconds after the start)."""

    index: int
    prompt: str
    prompt_words: int
    max_tokens: int
    send_offset_s: float

    def to_dict(self) -> dict:
        return {"index": self.index, "prompt_words": self.prompt_words, "max_tokens": self.max_tokens,
                "send_offset_s": self.send_offset_s}


def send_offsets(n: int, interval_s: Optional[float] = None, rate: Optional[float] = None,
                 seed: int = 0) -> list[float]:
    """Send times: fixed `interval_s` apart, or Poisson arrivals at `rate` per second."""
    if rate is not None:
        rng = random.Random(f"arrivals-{seed}")
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += -math.log(1.0 - rng.random()) / rate
        return out
    step = interval_s or 0.0
    return [i * step for i in range(n)]


def build_requests(scenario: Scenario, num_requests: Optional[int] = None,
                   interval_s: Optional[float] = None, rate: Optional[float] = None) -> list[RequestSpec]:
    """The scenario's requests; `num_requests`, `interval_s` or `rate` override the file.

    Prompts and lengths depend only on the seed and the request index, so changing the arrival
    pattern or the count keeps the common prefix of the request list identical.
    """
    n = num_requests or scenario.num_requests
    if interval_s is None and rate is None:
        interval_s, rate = scenario.interval_s, scenario.rate
    offsets = send_offsets(n, interval_s=interval_s, rate=rate, seed=scenario.seed)
    rng = random.Random(f"requests-{scenario.seed}")
    specs = []
    for i in range(n):
        words = sample(scenario.prompt_len, rng)
        max_tokens = sample(scenario.output_len, rng)
        specs.append(RequestSpec(i, make_prompt(words, rng), words, max_tokens, offsets[i]))
    return specs


class RequestSampler:
    """Endless requests drawn from a scenario's distributions (for closed-loop load, e.g. Locust).

    Each sampler has its own deterministic stream: `stream_id` (e.g. the user number) is mixed
    into the scenario's seed. Send times are not part of it: the caller paces requests.
    """

    def __init__(self, scenario: Scenario, stream_id: int | str = 0):
        self.scenario = scenario
        self._rng = random.Random(f"sampler-{scenario.seed}-{stream_id}")
        self._count = 0

    def next(self) -> RequestSpec:
        words = sample(self.scenario.prompt_len, self._rng)
        max_tokens = sample(self.scenario.output_len, self._rng)
        spec = RequestSpec(self._count, make_prompt(words, self._rng), words, max_tokens, 0.0)
        self._count += 1
        return spec
