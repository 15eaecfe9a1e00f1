"""The engine: requests in, one scheduled forward per `step()`, new tokens and text out.

Offline use: `Engine(EngineConfig(...)).generate(prompts, SamplingParams(...))`, or `stream()`.
Serving use (one thread drives it): `add_request`, `abort`, `step` — see `engine_loop.py`.

With async scheduling (`async_scheduling`), `step()` launches a step and, while the device runs it,
applies the tokens of the step launched by the call before: the host's scheduling, input building
and output handling overlap the device's forward. The next step is scheduled before the tokens of
the one in flight are known: each sequence that chooses a token there holds a placeholder for it
(`PLACEHOLDER`), so that every count (tokens, outputs, positions, slots) is what it will be; the
input row of that token is filled on the device from the step in flight (`TokenFeed`). A sequence
that the token in flight ends has its row in the next step discarded, and its blocks are free
already. Outputs are those of the synchronous loop.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from tritonllm.core.config import EngineConfig, SpeculativeConfig
from tritonllm.core.outputs import CompletionOutput, RequestOutput
from tritonllm.core.parameters import ConfigError
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.core.sequence import FinishReason, Sequence
from tritonllm.core.tracing import span
from tritonllm.devices import platform
from tritonllm.engine.detokenizer import IncrementalDetokenizer
from tritonllm.guided.decoding import Guides, check_guided_decoding
from tritonllm.models.families import exact_context_limit
from tritonllm.models.loader import load_hf_config, load_tokenizer
from tritonllm.models.model_files import resolve_model_dir
from tritonllm.runner.head import StepTokens
from tritonllm.runner.model_runner import ModelRunner, StepInputs
from tritonllm.runner.step_inputs import TokenFeed
from tritonllm.runner.warmup import warm_up
from tritonllm.scheduling.block_manager import BlockManager
from tritonllm.scheduling.ngram_draft import accepted_tokens
from tritonllm.scheduling.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from tritonllm.scheduling.window_pool import WindowPoolBlockManager

logger = logging.getLogger(__name__)

# A token chosen by the step in flight, whose id the host does not have yet (async scheduling).
PLACEHOLDER = -1


@dataclass
class _StreamState:
    """Per-request output state that the scheduler does not need."""

    detok: IncrementalDetokenizer
    text: str = ""  # generated text so far (stop string excluded once found)
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    prompt_logprobs_sent: bool = False
    # With top log-probs: the text each output token decoded to (RequestOutput.new_token_texts).
    token_texts: list[str] | None = None
    token_text: str = ""  # the text the token being applied decoded to, before a stop condition cut it
    num_placeholders: int = 0  # PLACEHOLDERs at the end of its token_ids: tokens of steps in flight


@dataclass
class _Launched:
    """A step launched on the device whose tokens the host has not applied yet."""

    out: SchedulerOutput
    inputs: StepInputs
    tokens: StepTokens
    # Some sequence that chooses a token here needs it on the host before its next step is built: a
    # guide's mask, penalties and bad words are computed on the host from the tokens so far.
    next_needs_host_tokens: bool


def _reads_own_tokens_on_host(seq: Sequence) -> bool:
    p = seq.params
    return (seq.guided is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0 or bool(p.bad_words))


@dataclass
class StepTimings:
    """Where the engine's steps spend their time: seconds summed over `steps` (reset by assigning a new
    one to `Engine.step_timings`). A benchmark's breakdown; the engine adds to it on every step."""

    steps: int = 0
    schedule: float = 0.0  # the scheduler
    prepare: float = 0.0  # the inputs built on the host and copied to the device
    launch: float = 0.0  # the forward and the head issued (on the CPU: computed)
    wait: float = 0.0  # waiting for the step's [2, batch] ids and log-probs to reach the host
    apply: float = 0.0  # tokens appended, stop conditions, text, counters committed
    device: float = 0.0  # the forward and the head on the device, timed by events (runner.time_device)


class _Phases:
    """Where a start-up's time went, for its log line."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: list[tuple[str, float]] = []

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **parameters):
        """`config`, with `parameters` (config.pbtxt names, e.g. `max_num_seqs=8`) changed."""
        config = (config or EngineConfig()).with_parameters(**parameters)
        self.config = config
        started = time.perf_counter()
        phases = _Phases()
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        self.device = platform.resolve_device(config.device.device)
        self.dtype = platform.resolve_dtype(config.model.dtype, self.device)
        phases.end("device")
        self.model_dir = resolve_model_dir(config.model.path)
        self.tokenizer = load_tokenizer(self.model_dir)
        hf_config = load_hf_config(self.model_dir)
        self.max_model_len = min(config.model.max_model_len,
                                 getattr(hf_config, "max_position_embeddings", config.model.max_model_len))
        limit = exact_context_limit(hf_config)
        if limit is not None and limit[0] < self.max_model_len:  # past it our outputs would not be the model's
            logger.warning("%s: max_model_len %d -> %d", limit[1], self.max_model_len, limit[0])
            self.max_model_len = limit[0]
        self.eos_token_ids = self._eos_ids(hf_config)
        self.guides = Guides(self.tokenizer, self.eos_token_ids)
        phases.end("tokenizer and config")
        self.runner = ModelRunner(config, self.model_dir, self.device, self.dtype, self.max_model_len, self.eos_token_ids)
        phases.end("model, device backend and KV pool")
        model, cache = self.runner.model, config.cache
        if not self.runner.backend.capabilities.skips_pruned_blocks and (cache.kv_window or cache.kv_window_ratio):
            self.runner.close()
            raise ConfigError(f"kv_window pruning leaves holes in block tables that {self.runner.backend.name}'s "
                              "paged-attention kernels cannot skip; set its attention parameter to torch")
        if self.runner.num_window_blocks:  # the sliding layers' K/V in a pool of their own
            self.block_manager = WindowPoolBlockManager(self.runner.num_blocks, self.runner.num_window_blocks,
                                                        cache.block_size, model.attention_window,
                                                        cache.enable_prefix_caching)
        else:  # every layer's K/V in one pool, freed behind the window where every layer slides
            self.block_manager = BlockManager(self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                              window=model.kv_release_window)
        self.scheduler = Scheduler(self.block_manager, config.scheduler, self.max_model_len, cache,
                                   self._speculative(config), max_loras=config.lora.max_loras if config.lora.enabled else 0)
        self._seqs: dict[str, Sequence] = {}
        self._streams: dict[str, _StreamState] = {}
        self.async_scheduling = self._async_scheduling(config)
        self._in_flight: _Launched | None = None
        self.step_timings = StepTimings()
        self.num_steps = 0
        # Tokens each step fed to the model, oldest first, for vLLM's iteration_tokens histogram: the
        # metrics thread takes them (popleft) a few times a second. Bounded, so that nothing grows
        # where nobody takes them (offline use, metrics off).
        self.step_num_tokens: collections.deque[int] = collections.deque(maxlen=4096)
        phases.end("block manager and scheduler")
        if config.device.warmup:
            warm_up(self.runner, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
            phases.end("warm-up")
        self.startup_seconds = time.perf_counter() - started
        logger.info("engine ready in %.1f s on %s (%s): %s", self.startup_seconds, self.device, self.dtype, phases)

    def _speculative(self, config: EngineConfig) -> SpeculativeConfig:
        """Speculative decoding as configured where the device backend computes drafted rows as a
        one-token decode's, bit for bit; else off (drafts would change a request's tokens)."""
        if config.speculative.num_tokens and not self.runner.backend.capabilities.exact_rows:
            logger.info("speculative_tokens=%d: off here (this device backend does not compute a drafted row "
                        "exactly as a one-token decode)", config.speculative.num_tokens)
            return dataclasses.replace(config.speculative, num_tokens=0)
        return config.speculative

    def _async_scheduling(self, config: EngineConfig) -> bool:
        setting = config.scheduler.async_scheduling
        # auto: where the device computes apart from the host (the CPU's forward is the host's own time) and
        # can take the next step while one is in flight. With FlashInfer the next step's plan waits for the
        # step in flight, and its launch took the host as long as the device took the step: measured on
        # an H100, async was no faster (docs/DEVICES.md, "Async scheduling").
        if setting == "auto":
            on = self.device.type in ("cuda", "npu") and not self.runner.plans_on_host
        else:
            on = setting == "true"
        if on and config.parallel.tensor_parallel_size > 1:
            # The worker ranks build each step's input ids from the host arrays, which hold placeholders.
            logger.info("async_scheduling: off with tensor parallelism")
            return False
        logger.info("async_scheduling: %s", "on" if on else "off")
        return on

    def _eos_ids(self, hf_config) -> set[int]:
        ids: set[int] = set()
        for source in (hf_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        try:
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        except OSError:
            pass
        return ids

    # ---- requests ----------------------------------------------------------------------------
    def make_sequence(self, prompt: str | None = None, params: SamplingParams | dict | None = None,
                      prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                      apply_chat_template: bool = False, arrival_time: float | None = None) -> Sequence:
        """Validate and tokenize a request (thread-safe; does not touch the schedule)."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        if params.guided_decoding is not None:  # its form was checked with params; can it be followed?
            check_guided_decoding(params.guided_decoding)
        if params.lora_name is not None and params.lora_name not in self.lora_names:
            known = ", ".join(self.lora_names)
            raise InvalidRequestError(f"lora_name {params.lora_name!r} is not an adapter of this model"
                                      + (f" (its adapters: {known})" if known else " (it serves no LoRA adapters)"))
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("the prompt is empty: text_input must be a non-empty string")
            if apply_chat_template:
                prompt_token_ids = list(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False))
            else:
                prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_token_ids = list(prompt_token_ids)
            vocab = self.runner.model.config.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
                raise InvalidRequestError(f"input_ids must be integers in [0, {vocab})")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty (no tokens)")
        if params.truncate_prompt_tokens is not None:  # the prompt's end is kept, as vLLM does
            keep = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = prompt_token_ids[-keep:]
        vocab = self.runner.model.config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}")
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                                      f"{self.max_model_len} (prompt plus at least one generated token)")
        if any(t >= vocab for t in params.allowed_token_ids or ()):
            raise InvalidRequestError(f"allowed_token_ids must be below the vocabulary size {vocab}")
        if request_id is None:
            request_id = uuid.uuid4().hex
        seq = Sequence(request_id, prompt_token_ids, params, arrival_time)
        seq.bad_word_ids = self._bad_word_ids(params.bad_words)
        guide = self.guides.for_request(params.guided_decoding)
        seq.guided = guide.start() if guide is not None else None
        return seq

    def make_sequences(self, prompt: str | None = None, params: SamplingParams | dict | None = None,
                       request_id: str | None = None, **kwargs) -> list[Sequence]:
        """`make_sequence` for each of the request's n completions (ids "<request_id>/<index>" when n > 1).

        The prompt is tokenized once. Completions after the first wait for its prompt to be in the
        KV cache and take those blocks from the prefix cache; with a seed, completion i samples with
        seed + i so that the completions differ.
        """
        first = self.make_sequence(prompt, params, request_id=request_id, **kwargs)
        n = first.params.n
        if n == 1:
            return [first]
        base_id = first.request_id
        first.request_id = f"{base_id}/0"  # parent_id stays base_id
        cache = self.config.cache
        share_prompt = cache.enable_prefix_caching and first.num_prompt_tokens > cache.block_size
        seqs = [first]
        for index in range(1, n):
            params_i = first.params if first.params.seed is None else replace(first.params, seed=first.params.seed + index)
            seq = Sequence(f"{base_id}/{index}", first.prompt_token_ids, params_i, first.times.arrival, index=index)
            seq.parent_id = base_id
            seq.bad_word_ids = first.bad_word_ids
            seq.guided = first.guided.start() if first.guided is not None else None
            seq.prefill_after = first if share_prompt else None
            seqs.append(seq)
        return seqs

    def _bad_word_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """Each bad word as token ids, alone and after a space (as vLLM), without duplicates."""
        variants = {tuple(self.tokenizer.encode(form, add_special_tokens=False))
                    for word in words for form in (word.strip(), " " + word.strip())}
        return sorted(v for v in variants if v)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a validated sequence (call from the thread that runs `step`)."""
        if seq.request_id in self._seqs:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        limit = self.config.scheduler.max_queue_size
        if limit and self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        self._seqs[seq.request_id] = seq
        self._streams[seq.request_id] = _StreamState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens,
                                   seq.params.spaces_between_special_tokens),
            token_texts=[] if seq.params.top_logprobs is not None and seq.params.detokenize else None)
        self.scheduler.add(seq)

    def add_request(self, prompt: str | None = None, params: SamplingParams | dict | None = None, **kwargs) -> str:
        """Validate, tokenize and queue a request; returns its id (with n > 1 its completions' sequences
        are "<id>/0" ... "<id>/<n-1>"). Raises InvalidRequestError on bad input."""
        return self._add(prompt, params, **kwargs)[0].parent_id

    def _add(self, prompt, params, **kwargs) -> list[Sequence]:
        seqs = self.make_sequences(prompt, params, **kwargs)
        for seq in seqs:
            self.add_sequence(seq)
        return seqs

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now (every completion of it: a sequence id or the request's id); its blocks
        are free before the next step. The final outputs of what was stopped; empty if nothing was here."""
        seqs = [self._seqs[request_id]] if request_id in self._seqs else [
            seq for seq in self._seqs.values() if seq.parent_id == request_id]
        outputs = []
        for seq in seqs:
            if self.scheduler.abort(seq):
                state = self._streams[seq.request_id]
                # A token still on its way is dropped: the caller has seen all the output there is.
                self._drop_placeholders(seq, state)
                outputs.append(self._retire(seq, *self._new_tokens(seq, state),
                                            self._new_text(state, seq.params.stop, final=True)))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched whose tokens are not applied yet: 1 between two calls of `step` where async
        scheduling overlaps them, else 0."""
        return int(self._in_flight is not None)

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel worker died), or None while healthy."""
        return self.runner.failure

    def close(self) -> None:
        """Release what outlives the object: tensor-parallel worker processes and the process group."""
        self.runner.close()

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters a request may name (`lora_name`), in multi_lora.json's order; empty: none."""
        return self.runner.lora.names if self.runner.lora is not None else []

    def stats(self) -> dict:
        stats = {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                 "preemptions": self.scheduler.num_preemptions, "kv_blocks": self.block_manager.stats(),
                 "steps": self.num_steps,
                 # vLLM's prefix-cache counters: tokens looked up at admission, and those found cached
                 "prefix_cache_queries": self.block_manager.prefix_query_tokens,
                 "prefix_cache_hits": self.block_manager.prefix_hit_tokens,
                 "step_timings": dict(vars(self.step_timings))}  # after every step: a flat copy, not asdict's
        if self.runner.lora is not None:  # vLLM's lora_requests_info: the adapters running and waiting
            running = {seq.params.lora_name for seq in self.scheduler.running} - {None}
            waiting = {seq.params.lora_name for _, seq in self.scheduler.waiting} - {None}
            stats["lora"] = {"running": sorted(running), "waiting": sorted(waiting),
                             "max_lora": self.config.lora.max_loras}
        return stats

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward, apply new tokens; returns news for every request touched.

        With async scheduling the step launched here stays on the device, and the news returned are
        those of the step launched by the previous call, applied while this one runs."""
        timings = self.step_timings
        landing = self._in_flight
        if landing is not None and (landing.next_needs_host_tokens or self.scheduler.may_draft()):
            # The next step reads the tokens of the one in flight on the host (a guide's mask, penalties,
            # bad words; drafts): it is built once they are there, by the next call.
            self._in_flight = None
            return self._land(landing)
        started = time.perf_counter()
        with span("schedule"):
            out = self.scheduler.schedule(speculate=landing is None)
        scheduled = time.perf_counter()
        timings.schedule += scheduled - started
        if out.is_empty:
            self._in_flight = None
            return self._land(landing) if landing is not None else []
        inputs = self.runner.prepare(out.scheduled)
        if landing is not None:
            inputs.feed = self._token_feed(out.scheduled, landing)
        prepared = time.perf_counter()
        timings.prepare += prepared - scheduled
        if landing is not None and self.runner.plans_on_host:
            landing.tokens.wait()  # the kernels' plan for this step overwrites the one the step in flight reads
        launch_started = time.perf_counter()
        tokens = self.runner.execute(inputs)
        timings.launch += time.perf_counter() - launch_started
        launched = _Launched(out, inputs, tokens, any(_reads_own_tokens_on_host(item.seq) for item in inputs.sampled))
        self.num_steps += 1
        self.step_num_tokens.append(out.num_batched_tokens)
        # A step with drafts runs synchronously: how many of them are accepted decides the next step.
        stays_in_flight = self.async_scheduling and not any(item.draft for item in out.scheduled)
        if stays_in_flight:
            for item in inputs.sampled:  # one row each: steps in flight have no drafts
                self._streams[item.seq.request_id].num_placeholders += 1
                item.seq.token_ids.append(PLACEHOLDER)
        self._in_flight = launched if stays_in_flight else None
        results = self._land(landing) if landing is not None else []
        # After the tokens of the step before: the prefix cache hashes the tokens this step computed,
        # and a sequence they ended keeps none of this step's K/V.
        committing = time.perf_counter()
        self.scheduler.commit(out)
        timings.apply += time.perf_counter() - committing
        if not stays_in_flight:
            results = self._land(launched)
        elif not self.scheduler.has_work():
            # Every sequence of the step in flight has ended: none of its rows is used, and once it is
            # done the engine is idle.
            self._in_flight = None
            self._land(launched)
        return results

    def _token_feed(self, scheduled: list[ScheduledSeq], landing: _Launched) -> TokenFeed | None:
        """This step's rows whose token the step in flight chose, and where they are in its output."""
        source_rows = {id(item.seq): row for row, item in enumerate(landing.inputs.sampled)}
        rows, sources = [], []
        for item in scheduled:
            if self._streams[item.seq.request_id].num_placeholders:
                rows.append(item.first_row)  # a decode of that very token: its only row
                sources.append(source_rows[id(item.seq)])
        if not rows:
            return None
        return TokenFeed(np.asarray(rows, dtype=np.int64), np.asarray(sources, dtype=np.int64),
                         landing.tokens.packed)

    def _land(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them."""
        with span("wait"):
            launched.tokens.wait()
        with span("apply"):
            return self._apply_step(launched)

    def _apply_step(self, launched: _Launched) -> list[RequestOutput]:
        started = time.perf_counter()
        timings = self.step_timings
        tokens = launched.tokens
        token_ids, logprobs, tops = tokens.result()
        device_seconds = tokens.device_seconds()
        inputs = launched.inputs
        now = time.time()
        results = []
        row = 0
        while row < len(inputs.sampled):  # a sequence with a draft has one row per draft token more
            item = inputs.sampled[row]
            end = row + 1 + len(item.draft)
            take = accepted_tokens(item.draft, token_ids[row:end]) if item.draft else 1
            result = self._apply_tokens(item.seq, token_ids[row:row + take], logprobs[row:row + take],
                                        tops[row:row + take], now)
            if item.draft and not item.seq.is_finished:
                self.scheduler.commit_accepted(item.seq, take - 1)
            if result is not None:
                results.append(result)
            row = end
        timings.steps += 1
        timings.wait += tokens.wait_seconds
        timings.apply += time.perf_counter() - started
        if device_seconds is not None:
            timings.device += device_seconds
        return results

    def _drop_placeholders(self, seq: Sequence, state: _StreamState) -> None:
        if state.num_placeholders:
            del seq.token_ids[-state.num_placeholders:]
            state.num_placeholders = 0

    def _apply_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list[float], tops: list,
                      now: float) -> RequestOutput | None:
        """Append a step's new tokens to `seq` (one, or with a draft the accepted ones) up to the first that
        finishes it; returns its one output for the step."""
        if seq.is_finished:  # aborted while the step ran, or ended by the step before (async scheduling)
            return None
        if not seq.times.first_token:
            seq.times.first_token = now
        state = self._streams[seq.request_id]
        # Its placeholders go while the token is applied, so that the stop conditions see what the
        # synchronous loop sees; those of later steps in flight come back unless the token ends it.
        num_placeholders = state.num_placeholders
        self._drop_placeholders(seq, state)
        reason = None
        for token_id, logprob, top in zip(token_ids, logprobs, tops):
            state.token_text = ""
            reason = self._append_token(seq, state, token_id, logprob, top)
            if state.token_texts is not None:
                state.token_texts.append(state.token_text)
            if reason is not None:
                break
        p = seq.params
        prompt_logprobs = self._take_prompt_logprobs(seq, state)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            out = self._retire(seq, *self._new_tokens(seq, state), self._new_text(state, p.stop, final=True))
            out.prompt_logprobs = prompt_logprobs
            return out
        new_ids, new_lps, new_tops, new_texts = self._new_tokens(seq, state)
        out = RequestOutput(seq.request_id, new_ids, new_lps, self._new_text(state, p.stop, final=False), False, None,
                            seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens,
                            new_top_logprobs=new_tops, index=seq.index, prompt_logprobs=prompt_logprobs,
                            new_token_texts=new_texts)
        if num_placeholders > 1:
            seq.token_ids.extend([PLACEHOLDER] * (num_placeholders - 1))
            state.num_placeholders = num_placeholders - 1
        return out

    def _append_token(self, seq: Sequence, state: _StreamState, token_id: int, logprob: float,
                      top) -> FinishReason | None:
        """Append one token and say whether it ends the sequence (and why)."""
        seq.append_token(token_id, logprob, top)
        p = seq.params
        if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            if seq.num_output_tokens > p.min_tokens or not p.min_tokens:
                # Decoded where the text keeps it (vLLM's include_stop_str_in_output) or its log-probs name it.
                if p.detokenize and (p.include_stop_str_in_output or state.token_texts is not None):
                    state.token_text = state.detok.add(token_id)
                    if p.include_stop_str_in_output:
                        state.text += state.token_text
                return FinishReason.STOP
        if seq.guided is not None and token_id in self.eos_token_ids:
            return FinishReason.STOP  # a guided choice ended, ignore_eos or not
        if p.detokenize:
            state.token_text = state.detok.add(token_id)
            state.text += state.token_text
            if p.stop and seq.num_output_tokens >= p.min_tokens:
                reason = self._check_stop_strings(state, p.stop, p.include_stop_str_in_output)
                if reason is not None:
                    return reason
        if seq.guided is not None and seq.guided.is_complete(seq.output_token_ids):
            return FinishReason.STOP  # a whole choice that nothing extends
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _check_stop_strings(state: _StreamState, stops: list[str], include: bool) -> FinishReason | None:
        # Only the tail can contain a stop string that was not there before this token.
        start = max(0, len(state.text) - max(map(len, stops)) - 16)
        found = [(i, k) for k, i in enumerate(state.text.find(s, start) for s in stops) if i >= 0]
        if not found:
            return None
        at, k = min(found)  # the earliest; at the same place, the first listed
        state.text = state.text[:at + len(stops[k]) if include else at]
        return FinishReason.STOP

    @staticmethod
    def _new_tokens(seq: Sequence, state: _StreamState) -> tuple[list[int], list[float], list, list[str]]:
        start = state.num_emitted_tokens
        state.num_emitted_tokens = seq.num_output_tokens
        texts = state.token_texts[start:] if state.token_texts is not None else []
        # (not seq.output_token_ids[start:]: that copies every output token, each step)
        new_ids = seq.token_ids[seq.num_prompt_tokens + start:]
        return new_ids, seq.output_logprobs[start:], seq.output_top_logprobs[start:], texts

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence, state: _StreamState) -> list | None:
        """The prompt's scores (None for its first token, which nothing precedes), once: with the first
        output token, when the whole prompt has been computed."""
        if not seq.wants_prompt_logprobs or state.prompt_logprobs_sent:
            return None
        state.prompt_logprobs_sent = True
        return [None] + seq.prompt_logprobs

    @staticmethod
    def _new_text(state: _StreamState, stops: list[str], final: bool) -> str:
        end = len(state.text)
        if stops and not final:
            # Hold back what could be the start of a stop string until it is decided.
            end = max(state.num_emitted_chars, end - (max(map(len, stops)) - 1))
        delta = state.text[state.num_emitted_chars:end]
        state.num_emitted_chars = end
        return delta

    def _retire(self, seq: Sequence, new_ids: list[int], new_lps: list[float], new_tops: list, new_texts: list[str],
                new_text: str) -> RequestOutput:
        if logger.isEnabledFor(logging.DEBUG):
            t = seq.times
            logger.debug("request %s finished (%s): prompt=%d cached=%d output=%d preemptions=%d queue=%.3fs "
                         "ttft=%.3fs e2e=%.3fs arrival=%.6f scheduled=%.6f first_token=%.6f finished=%.6f",
                         seq.request_id, seq.finish_reason.value, seq.num_prompt_tokens, seq.num_cached_prompt_tokens,
                         seq.num_output_tokens, seq.num_preemptions, (t.scheduled or t.finished) - t.arrival,
                         (t.first_token or t.finished) - t.arrival, t.finished - t.arrival, t.arrival, t.scheduled,
                         t.first_token, t.finished)
        del self._seqs[seq.request_id]
        del self._streams[seq.request_id]
        return RequestOutput(seq.request_id, new_ids, new_lps, new_text, True, seq.finish_reason.value,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens,
                             seq.times.as_dict(), new_top_logprobs=new_tops, index=seq.index,
                             new_token_texts=new_texts)

    # ---- offline API -------------------------------------------------------------------------
    def generate(self, prompts: list[str] | str | None = None, params: SamplingParams | list | dict | None = None,
                 prompt_token_ids: list[list[int]] | None = None, apply_chat_template: bool = False) -> list[CompletionOutput]:
        """Run prompts to completion, all continuously batched together; results in input order
        (with n > 1, a prompt's n completions one after another)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        inputs = prompt_token_ids if prompt_token_ids is not None else prompts
        n = len(inputs)
        params_list = params if isinstance(params, list) else [params] * n
        ids = []
        try:
            for i in range(n):
                kwargs = {"prompt_token_ids": inputs[i]} if prompt_token_ids is not None else {}
                ids.extend(seq.request_id for seq in self._add(None if prompt_token_ids is not None else inputs[i],
                                                               params_list[i], apply_chat_template=apply_chat_template,
                                                               **kwargs))
        except InvalidRequestError:  # one bad prompt: none of the call's prompts runs
            for request_id in ids:
                self.abort(request_id)
            raise
        return self._collect(ids)

    def _collect(self, ids: list[str]) -> list[CompletionOutput]:
        prompts = {rid: list(self._seqs[rid].prompt_token_ids) for rid in ids}
        acc: dict[str, CompletionOutput] = {
            rid: CompletionOutput(rid, prompts[rid], [], [], "", None, top_logprobs=[], index=self._seqs[rid].index)
            for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                c = acc.get(out.request_id)
                if c is None:
                    continue
                c.token_ids += out.new_token_ids
                c.logprobs += out.new_logprobs
                c.top_logprobs += out.new_top_logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                c.text += out.new_text
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.num_cached_prompt_tokens = out.num_cached_prompt_tokens
                    c.times = out.times
                    pending.discard(out.request_id)
        return [acc[rid] for rid in ids]

    def stream(self, prompt: str, params: SamplingParams | dict | None = None, **kwargs) -> Iterator[RequestOutput]:
        """Yield one request's outputs step by step (other queued requests run alongside); with
        n > 1, every completion's, told apart by `index`."""
        pending = {seq.request_id for seq in self._add(prompt, params, **kwargs)}
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)

