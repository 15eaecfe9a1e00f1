"""The transformers baselines, in this process, float32, on our safetensors folder.

- `hf_serial`: `generate` one request at a time, the seed's baseline server (SEEDS.md 000). It is
  fed the replay: request i starts when it has arrived and request i-1 is done (FIFO, one worker).
  Service times are measured back to back and laid on that timeline; with `sample` < n only some
  requests are run and the others' service time is extrapolated from them (prefill time plus
  output length x time per output token), and the result says so.
- `hf_static`: static batches of `batch_size`, prompts sorted by length, left padding. It gets every
  prompt at t=0 (sorting needs them all; this can only favour it). A batch generates its longest
  output length for every row (that is static batching); each request counts its own tokens, and
  is answered when its batch returns.
Exact lengths as our server's `ignore_eos`: EOS may be generated and does not end a sequence.
Token ids include the chat template, as our server applies it; tokenizing and decoding are timed.
Outputs come back as tritonllm_client GenerationResults, so the same statistics code summarises them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import BaseStreamer

from prompt_tokens import chat_token_ids, prompt_token_ids
from tritonllm_client.stream import GenerationResult
from tritonllm_client.workload import RequestSpec


class _TokenClock(BaseStreamer):
    """Records when `generate` produces each step's tokens (put() gets the prompt first, then each step)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@dataclass
class Service:
    """One request served alone: seconds from its start to each event."""

    index: int
    ttft_s: float
    token_offsets_s: list[float]
    total_s: float
    text: str
    measured: bool = True


class HFBaseline:
    """A loaded transformers model and tokenizer, run with exact output lengths."""

    def __init__(self, model_dir: Path, threads: int, chat_template: bool = True):
        torch.set_num_threads(threads)
        self.chat_template = chat_template
        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - started
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    @torch.inference_mode()
    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_tokens: int, clock: _TokenClock):
        # `ignore_eos` as our server (and vLLM) mean it: EOS may be chosen but does not stop the
        # sequence. With no eos_token_id, generate neither stops at EOS nor bans it (min_new_tokens
        # would ban it and so change the text), and every row gets exactly num_tokens.
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_tokens,
                                   eos_token_id=None, do_sample=False, temperature=None, top_p=None,
                                   top_k=None, pad_token_id=self.pad_id, streamer=clock)

    def warm_up(self) -> None:
        ids = torch.tensor([chat_token_ids(self.tokenizer, "Hello!")])
        self._generate(ids, torch.ones_like(ids), 4, _TokenClock())

    def serve_one(self, spec: RequestSpec) -> Service:
        """Tokenize, generate exactly spec.max_tokens tokens, detokenize; timed from the start."""
        start = time.perf_counter()
        ids = torch.tensor([prompt_token_ids(self.tokenizer, spec.prompt, self.chat_template)])
        clock = _TokenClock()
        out = self._generate(ids, torch.ones_like(ids), spec.max_tokens, clock)
        text = self.tokenizer.decode(out[0, ids.shape[1]:ids.shape[1] + spec.max_tokens], skip_special_tokens=True)
        end = time.perf_counter()
        offsets = [t - start for t in clock.times]
        return Service(spec.index, offsets[0], offsets, end - start, text)

    def run_serial(self, specs: list[RequestSpec], sample: Optional[int] = None,
                   progress: bool = True) -> tuple[list[GenerationResult], dict]:
        """FIFO one-at-a-time replay; run `sample` evenly spread requests (all if None) and extrapolate."""
        n = len(specs)
        k = n if not sample or sample >= n else sample
        picked = sorted({round(j * n / k) for j in range(k)})
        measured: dict[int, Service] = {}
        for j, i in enumerate(picked):
            measured[i] = self.serve_one(specs[i])
            if progress:
                s = measured[i]
                print(f"  hf_serial {j + 1}/{len(picked)}: request {i}, {specs[i].max_tokens} tokens in "
                      f"{s.total_s:.1f} s", flush=True)
        # Extrapolation model: fixed part (tokenize + prefill + first token + decode) plus a
        # per-output-token decode time, both averaged over the measured requests.
        first = sum(s.ttft_s for s in measured.values()) / len(measured)
        per_token = sum((s.token_offsets_s[-1] - s.ttft_s) / max(len(s.token_offsets_s) - 1, 1)
                        for s in measured.values()) / len(measured)
        tail = sum(s.total_s - s.token_offsets_s[-1] for s in measured.values()) / len(measured)
        results, cursor = [], 0.0
        for pos, spec in enumerate(specs):
            s = measured.get(pos)
            if s is None:
                offsets = [first + per_token * t for t in range(spec.max_tokens)]
                s = Service(spec.index, first, offsets, offsets[-1] + tail, "", measured=False)
            begin = max(spec.send_offset_s, cursor)
            cursor = begin + s.total_s
            results.append(_result(spec, spec.send_offset_s, [begin + t for t in s.token_offsets_s], cursor,
                                   s.text if s.measured else None))
        info = {"measured_requests": len(measured), "extrapolated": len(measured) < n,
                "sample_indices": picked, "fit": {"first_token_s": first, "per_token_s": per_token},
                "load_s": self.load_s}
        return results, info

    def run_static(self, specs: list[RequestSpec], batch_size: int = 32,
                   progress: bool = True) -> tuple[list[GenerationResult], dict]:
        """Static batches over prompts sorted by length; every prompt is there at t=0."""
        results: list[Optional[GenerationResult]] = [None] * len(specs)
        start = time.perf_counter()
        ids = [prompt_token_ids(self.tokenizer, s.prompt, self.chat_template) for s in specs]
        order = sorted(range(len(specs)), key=lambda i: len(ids[i]))
        num_batches = -(-len(order) // batch_size)
        for b in range(num_batches):
            rows = order[b * batch_size:(b + 1) * batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = torch.tensor([[self.pad_id] * (width - len(ids[i])) + ids[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in rows])
            num_tokens = max(specs[i].max_tokens for i in rows)
            clock = _TokenClock()
            out = self._generate(input_ids, mask, num_tokens, clock)
            texts = [self.tokenizer.decode(out[r, width:width + specs[i].max_tokens], skip_special_tokens=True)
                     for r, i in enumerate(rows)]
            end = time.perf_counter()
            for i, text in zip(rows, texts):
                times = [t - start for t in clock.times[:specs[i].max_tokens]]
                results[i] = _result(specs[i], 0.0, times, end - start, text)
            if progress:
                print(f"  hf_static batch {b + 1}/{num_batches}: {len(rows)} requests x {num_tokens} tokens, "
                      f"{end - start:.1f} s so far", flush=True)
        return results, {"batch_size": batch_size, "num_batches": num_batches, "load_s": self.load_s}  # type: ignore[return-value]


# Timelines start at TIME_BASE, not 0: GenerationResult treats a send_time of 0 as "never sent".
TIME_BASE = 1.0


def _result(spec: RequestSpec, send: float, token_times: list[float], end: float, text: Optional[str]) -> GenerationResult:
    """A GenerationResult from seconds since the run's start (pass t0=TIME_BASE to bench.py's `_record`)."""
    b = TIME_BASE
    res = GenerationResult(request_id=f"hf-{spec.index}", send_time=b + send, first_token_time=b + token_times[0],
                           end_time=b + end, token_times=[(b + t, 1) for t in token_times],
                           reported_output_tokens=len(token_times), finish_reason="length")
    res.text = text or ""
    return res
