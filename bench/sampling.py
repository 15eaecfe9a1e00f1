"""What sampling and guided decoding cost against greedy decoding, same engine, same run.

    python bench/sampling.py [--requests 64] [--max-tokens 64] [--rounds 2]

All requests arrive at once and run to max_tokens (ignore_eos) in one engine, so every mode does
the same work in the same batches; only the token choice differs. Modes: greedy, sampled
(temperature 0.8), sampled with top_p 0.95, with top_k 50, with a seed per request, and greedy
under a JSON schema guide and under a grammar of the same JSON (those stop when their JSON is
complete, so their tokens differ).
Prints output tok/s per mode and its ratio to greedy, the best of --rounds.
"""

from __future__ import annotations

import argparse
import json
import time

from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "city": {"type": "string"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
# The same person as GBNF (guided/grammar.py, llguidance) rather than a schema (our regex automaton).
PERSON_GBNF = r"""
root   ::= "{\"name\": " string ", \"age\": " [0-9]{1,3} ", \"city\": " string ", \"hobbies\": [" hobbies "]}"
hobbies ::= ( string ( ", " string ){0,2} )?
string ::= "\"" [^"\\]{0,24} "\""
"""
MODES = {
    "greedy": {},
    "sampled": {"temperature": 0.8},
    "sampled top_p=0.95": {"temperature": 0.8, "top_p": 0.95},
    "sampled top_k=50": {"temperature": 0.8, "top_k": 50},
    "sampled seeded": {"temperature": 0.8, "seed": 7},
    "greedy json schema": {"guided_decoding": {"json": PERSON}, "ignore_eos": False},
    "greedy grammar": {"guided_decoding": {"grammar": PERSON_GBNF}, "ignore_eos": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig.from_parameters(num_kv_blocks=4096, max_num_seqs=args.requests, max_num_batched_tokens=512))
    prompts = [f"Describe person number {i} as JSON with name, age, city and hobbies." for i in range(args.requests)]
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for mode, values in MODES.items():
            params = SamplingParams(**{"max_tokens": args.max_tokens, "ignore_eos": True, **values})
            started = time.perf_counter()
            outs = engine.generate(prompts, params, apply_chat_template=True)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)
            best[mode] = max(best.get(mode, 0.0), rate)
    rows = [{"mode": m, "output_tok_s": round(r, 1), "vs_greedy": round(r / best["greedy"], 2)} for m, r in best.items()]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
