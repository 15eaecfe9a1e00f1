"""What one guided sequence's allowed-token mask costs per output token, on the packaged model's tokenizer.

    python bench/guided_mask_cost.py [--repeats 20]

For each guide kind (regex, json schema, choice) a fixed output is written token by token; before
each token the runner's `_guide_allows` is called for the sequence, as a decoding step calls it: the
guide takes the token added since the last step and gives the mask (or ids) of the next tokens.
`AllowedTokens.gather` then writes that into the step's mask row. Every token of the output must be
one the guide allows, else the run stops.

Reported per kind, in microseconds per token: `first` (the first sequence on a fresh engine's guides:
what the guide builds lazily as it goes is included; its median and slowest token), `warm` (later
sequences of the same request spec, the median over --repeats), the same with the mask row written
(`warm+row`); and per sequence `start` (a request's guide looked up and a sequence's parse started,
warm) and `first_start_ms` (the same on a fresh engine's guides: the tokenizer's vocabulary made
ready for guides, and the guide built).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from tritonllm.core.sampling_params import SamplingParams
from tritonllm.guided.decoding import Guides
from tritonllm.models.loader import load_tokenizer
from tritonllm.models.model_files import resolve_model_dir
from tritonllm.runner.logit_adjustments import AllowedTokens, _guide_allows

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "employed": {"type": "boolean"}},
          "required": ["name", "age", "city", "employed"]}
CHOICES = ["The Eiffel Tower", "The Louvre museum", "The Seine", "Notre-Dame de Paris", "Montmartre"]
CASES = {
    "regex": ({"regex": PHONE}, "(555) 123-4567"),
    "json": ({"json": PERSON}, '{"name": "Ada Lovelace", "age": 36, "city": "London", "employed": true}'),
    "choice": ({"choice": CHOICES}, "Notre-Dame de Paris"),
}


def walk(guides: Guides, guided: dict, output: list[int], vocab: int) -> tuple[float, list[float], list[float]]:
    """Seconds to look up the guide and start the sequence's parse, then per token: the guide's next
    tokens, and those written into a mask row, along `output`."""
    began = time.perf_counter()
    cursor = guides.for_request(guided).start()
    start_s = time.perf_counter() - began
    mask_s, row_s = [], []
    for k in range(len(output) + 1):
        started = time.perf_counter()
        allowed = _guide_allows(cursor, output[:k], None)
        computed = time.perf_counter()
        AllowedTokens.gather([(0, allowed)], vocab, torch.device("cpu"))
        row_s.append(time.perf_counter() - started)
        mask_s.append(computed - started)
        if k < len(output):
            ok = allowed[output[k]] if allowed.dtype == np.bool_ else output[k] in allowed
            if not ok:
                raise SystemExit(f"the guide does not allow token {k} of its output ({output[k]})")
    return start_s, mask_s, row_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    tokenizer = load_tokenizer(resolve_model_dir("default"))
    vocab = len(tokenizer)
    eos = {tokenizer.eos_token_id}
    for kind, (spec, text) in CASES.items():
        guided = SamplingParams(guided_decoding=spec).guided_decoding  # checked (and compiled) as on arrival
        output = tokenizer.encode(text, add_special_tokens=False)
        setup_s, first, _ = walk(Guides(tokenizer, eos), guided, output, vocab)
        guides = Guides(tokenizer, eos)
        walk(guides, guided, output, vocab)
        warm, warm_row, start = [], [], []
        for _ in range(args.repeats):
            start_s, mask_s, row_s = walk(guides, guided, output, vocab)
            start.append(start_s)
            warm.append(statistics.median(mask_s))
            warm_row.append(statistics.median(row_s))
        print(json.dumps({"kind": kind, "tokens": len(output) + 1, "vocab": vocab,
                          "first_start_ms": round(setup_s * 1e3, 1),
                          "first_us": round(statistics.median(first) * 1e6, 1),
                          "first_max_us": round(max(first) * 1e6, 1),
                          "warm_us": round(statistics.median(warm) * 1e6, 1),
                          "warm+row_us": round(statistics.median(warm_row) * 1e6, 1),
                          "start_us": round(statistics.median(start) * 1e6, 1)}))


if __name__ == "__main__":
    main()
