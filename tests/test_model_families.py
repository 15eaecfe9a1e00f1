"""The Llama-family architectures the engine loads besides the default model (Llama with scaled rotary
frequencies, Qwen2, Mistral, Qwen3, Phi-3, Phi-4-mini's partial rotary, Granite, Gemma, Gemma 2,
Gemma 3, OLMo 2 and 3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE): small random models written by transformers itself, whose greedy outputs
through the engine must equal transformers' generate on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from greedy_reference import transformers_greedy
from tiny_models import tiny_config_args, write_tiny_model
from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is a city that", "def fibonacci(n):", "Once upon a time, in a land far away, there"]
MAX_TOKENS = 24


FAMILIES = {
    "llama3-rope": lambda c: transformers.LlamaConfig(**c, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2-qkv-bias": lambda c: transformers.Qwen2Config(**c),
    "mistral": lambda c: transformers.MistralConfig(**c, sliding_window=None),
    # Qwen3: per-head query/key norms, a head_dim that is not hidden / heads, a tied LM head.
    "qwen3": lambda c: transformers.Qwen3Config(**{**c, "tie_word_embeddings": True}, head_dim=32),
    # Phi-3: Q, K, V and gate, up fused in the checkpoint itself.
    "phi3": lambda c: transformers.Phi3Config(**c, sliding_window=None),
    # Phi-4-mini: a partial rotary embedding (12 of each head's 16 dimensions turn), a tied LM head.
    "phi4-partial-rotary": lambda c: transformers.Phi3Config(**{**c, "tie_word_embeddings": True}, sliding_window=None,
                                                             partial_rotary_factor=0.75),
    # Granite: scaled embeddings, attention, residual branches and logits (IBM's multipliers).
    "granite": lambda c: transformers.GraniteConfig(**{**c, "tie_word_embeddings": True}, embedding_multiplier=6.0,
                                                    attention_multiplier=0.09, residual_multiplier=0.4,
                                                    logits_scaling=3.0),
    # Gemma: GELU (tanh) gate, embeddings scaled by sqrt(hidden), norms multiplying by 1 + weight.
    "gemma": lambda c: transformers.GemmaConfig(**{**c, "tie_word_embeddings": True}, head_dim=32),
    # Gemma 2 besides: attention scores and logits soft-capped (caps low enough to bite on these
    # weights), each attention and MLP output normed, query_pre_attn_scalar, sliding layers (window
    # past max_model_len here).
    "gemma2": lambda c: transformers.Gemma2Config(**{k: v for k, v in c.items() if k != "tie_word_embeddings"},
                                                  head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                                  final_logit_softcapping=4.0, sliding_window=4096),
    # Gemma 3: Gemma 2's layer without the caps, per-head query/key norms (1 + weight), and the
    # sliding layers rotating by frequencies of their own (theta 10,000 against 1,000,000).
    "gemma3": lambda c: transformers.Gemma3TextConfig(**{k: v for k, v in c.items() if k != "tie_word_embeddings"},
                                                      head_dim=32, query_pre_attn_scalar=24, sliding_window=4096,
                                                      layer_types=["sliding_attention", "full_attention"]),
    # OLMo 2: no norms before the attention and MLP, norms of their outputs instead, and RMSNorms over
    # the whole query and key projections.
    "olmo2": lambda c: transformers.Olmo2Config(**c),
    # Mixtures of experts. Mixtral: 2 of 4 experts per token, their weights renormalized.
    "mixtral": lambda c: transformers.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # Qwen2-MoE: weights not renormalized, a sigmoid-gated shared expert, the first layer dense (mlp_only_layers).
    "qwen2_moe": lambda c: transformers.Qwen2MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                       shared_expert_intermediate_size=96, norm_topk_prob=False,
                                                       mlp_only_layers=[0]),
    # Qwen3-MoE: Qwen3's head norms, renormalized weights.
    "qwen3_moe": lambda c: transformers.Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                       norm_topk_prob=True, head_dim=32),
    # OLMoE: OLMo's projection norms with Llama's pre-norm layer, 3 of 8 experts, not renormalized.
    "olmoe": lambda c: transformers.OlmoeConfig(**c, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
}


def _reference(model, ids: list[int], max_tokens: int, candidate: list[int]) -> list[int]:
    """transformers' greedy output of `max_tokens` tokens, EOS banned (greedy_reference.py checks `candidate`)."""
    return transformers_greedy(model, ids, candidate, max_tokens, min_new_tokens=max_tokens)[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_greedy_outputs_equal_transformers(family, cpu_kernels, tokenizer, tmp_path):
    model = write_tiny_model(FAMILIES[family](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 cpu_kernels=cpu_kernels))
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for ids, out in zip(prompts, outs):  # batched together, each against its own generate
        assert out.token_ids == _reference(model, ids, MAX_TOKENS, out.token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_logprobs_equal_transformers(family, tokenizer, tmp_path):
    # What greedy ids cannot show: a scale of the logits (Granite's logits_scaling), an activation a
    # little off (GELU's tanh form against erf).
    model = write_tiny_model(FAMILIES[family](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4))
    ids = tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        logits = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=2e-4)


SLIDING = {
    # Every layer attends to its last 32 positions.
    "mistral": lambda c: transformers.MistralConfig(**c, sliding_window=32),
    # Every other layer does (layer_types), and Gemma 2's capped scores take the torch attention path.
    "gemma2": lambda c: transformers.Gemma2Config(**c, head_dim=32, sliding_window=32),
    # Gemma 3's sliding layers, with their own rotary frequencies.
    "gemma3": lambda c: transformers.Gemma3TextConfig(**c, head_dim=32, sliding_window=32,
                                                      layer_types=["sliding_attention", "full_attention"]),
    # OLMo 3: OLMo 2's layer, every other layer sliding (three of four in its checkpoints), rotary frequencies
    # keyed by layer type.
    "olmo3": lambda c: transformers.Olmo3Config(**c, sliding_window=32,
                                                layer_types=["sliding_attention", "full_attention"]),
    # The layers from max_window_layers on do.
    "qwen2": lambda c: transformers.Qwen2Config(**c, use_sliding_window=True, sliding_window=32, max_window_layers=1),
}


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_sliding_window_layers_equal_transformers_past_the_window(family, cpu_kernels, tokenizer, tmp_path):
    model = write_tiny_model(SLIDING[family](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=64, cpu_kernels=cpu_kernels))
    assert engine.max_model_len == 256
    # Outputs running 40 tokens past the window, and a prompt longer than it in two chunks of the
    # 64-token step budget, beside the others.
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in (PROMPTS[0], " ".join(PROMPTS * 4))]
    assert len(prompts[1]) > 64
    outs = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=48, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _reference(model, ids, 48, out.token_ids)


def _peak_used_blocks(engine, prompt_ids: list[int], max_tokens: int):
    """Step one request to its end; its output and the most KV blocks in use at once."""
    rid = engine.add_request(prompt_token_ids=prompt_ids, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seq, peak = engine._seqs[rid], 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    engine.block_manager.check_invariants()
    return seq.output_token_ids, peak


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_blocks_behind_a_window_every_layer_slides_are_freed_exactly(cpu_kernels, tokenizer, tmp_path):
    # Mistral's every layer attends to its last 32 positions: a 120-token output holds ~3 blocks of 16,
    # not 9, and stays transformers' own; a second request for the same prompt reuses its cached blocks.
    model = write_tiny_model(SLIDING["mistral"](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 cpu_kernels=cpu_kernels, warmup=False))
    assert engine.runner.model.kv_release_window == 32 and engine.config.cache.block_size == 16
    ids = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    assert 16 < len(ids) < 32
    tokens, peak = _peak_used_blocks(engine, ids, 120)
    assert tokens == _reference(model, ids, 120, tokens)
    assert peak <= 32 // 16 + 2
    hits = engine.block_manager.prefix_hit_tokens
    again, _ = _peak_used_blocks(engine, ids, 40)
    assert engine.block_manager.prefix_hit_tokens - hits >= 16 and again == tokens[:40]


def test_blocks_stay_where_some_layer_attends_to_the_whole_sequence(tokenizer, tmp_path):
    # Gemma 2's full-attention layers read every position: nothing behind the window is freed.
    write_tiny_model(SLIDING["gemma2"](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 warmup=False))
    assert engine.runner.model.attention_window == 32 and engine.runner.model.kv_release_window is None
    _, peak = _peak_used_blocks(engine, tokenizer.encode(PROMPTS[0], add_special_tokens=False), 120)
    assert peak >= (len(tokenizer.encode(PROMPTS[0], add_special_tokens=False)) + 119) // 16


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["phi3", "phi4-mini"])
def test_longrope_caps_max_model_len_where_its_frequencies_change(partial, tokenizer, tmp_path):
    # longrope: the short frequencies up to the original context, the long ones past it; Phi-4-mini's
    # over the 12 of 16 dimensions that turn.
    pairs = int(16 * partial) // 2
    config = transformers.Phi3Config(**tiny_config_args(tokenizer), sliding_window=None, original_max_position_embeddings=32,
                                     rope_scaling={"rope_type": "longrope", "partial_rotary_factor": partial,
                                                   "short_factor": [1.0 + i / 8 for i in range(pairs)],
                                                   "long_factor": [4.0 + i for i in range(pairs)]})
    model = write_tiny_model(config, tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4))
    assert engine.max_model_len == 32
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    [out] = engine.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=64, ignore_eos=True))
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 32
    assert out.token_ids == _reference(model, ids, 32 - len(ids), out.token_ids)
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        engine.generate(prompt_token_ids=[list(range(100, 132))], params=SamplingParams(max_tokens=4))


@pytest.mark.parametrize("config, message", [
    (lambda c: transformers.GPT2Config(vocab_size=c["vocab_size"], n_embd=64, n_layer=1, n_head=2),
     "model_type 'gpt2' is not supported"),
    # transformers' Llama turns every dimension whatever the config says: refused rather than guessed.
    (lambda c: transformers.LlamaConfig(**c, partial_rotary_factor=0.5),
     r"partial rotary embedding \(partial_rotary_factor=0.5\) is not supported for model_type 'llama'"),
    (lambda c: transformers.LlamaConfig(**c, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    # A part the layers do not compute: its weights are in the checkpoint and would go unread.
    (lambda c: transformers.LlamaConfig(**c, mlp_bias=True), r"6 checkpoint weights are not used .*mlp\.down_proj\.bias"),
])
def test_what_the_engine_cannot_compute_is_refused_by_name(config, message, tokenizer, tmp_path):
    write_tiny_model(config(tiny_config_args(tokenizer)), tokenizer, tmp_path)
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256))


@pytest.mark.parametrize("family", ["qwen3", "phi3", "phi4-partial-rotary", "granite", "gemma2", "gemma3", "olmo2",
                                    "qwen2_moe", "olmoe", "mistral-sliding", "gemma3-sliding"])
def test_two_tensor_parallel_ranks_split_these_weights_correctly(family, tokenizer, tmp_path):
    # Each rank reads its own query/key/value heads and MLP columns: from the fused Phi-3 tensors by
    # offset, Qwen3's head norms whole, and Granite's residual multiplier folded into each rank's rows.
    # The workers' sliding masks too, and (gemma3-sliding) their sliding layer's own KV pool.
    config = SLIDING[family.removesuffix("-sliding")] if family.endswith("-sliding") else FAMILIES[family]
    model = write_tiny_model(config(tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 tensor_parallel_size=2))
    try:
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
        outs = engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=40, ignore_eos=True))
    finally:
        engine.close()
    for ids, out in zip(prompts, outs):
        assert out.token_ids == _reference(model, ids, 40, out.token_ids)
