"""The sliding layers' own KV pool (window_pool.py): for models that mix sliding and full layers, the
sliding layers' K/V behind the window are freed as a sequence grows, while outputs stay transformers'
and cached prefixes are still reused."""

from __future__ import annotations

import pytest
import transformers

from greedy_reference import transformers_greedy
from tiny_models import tiny_config_args, write_tiny_model
from tritonllm.scheduling.block_manager import KVCopy, chain_hash
from tritonllm.core.config import EngineConfig
from tritonllm.engine.engine import Engine
from tritonllm.core.sampling_params import SamplingParams
from tritonllm.core.sequence import Sequence
from tritonllm.scheduling.window_pool import WindowPoolBlockManager, window_pool_blocks_per_sequence

pytestmark = pytest.mark.unit

BS = 4
WINDOW = 32  # the tiny models' sliding window, in tokens (blocks of 16 in the engine)
PROMPT = ("The capital of France is a city that many people visit every year, and its museums hold paintings "
          "from every century; the river that crosses it")


def seq(tokens, rid: str) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def evict(pool, block_id: int) -> None:
    """Drop a free block's cached prefix, as handing it out again would."""
    pool._forget(pool.blocks[block_id])
    pool._num_cached_free -= 1


def admit(bm: WindowPoolBlockManager, s: Sequence) -> int:
    """Admit a whole prompt, run it (as far as the block tables go) and free the window's tail; the
    cached tokens it started from."""
    match = bm.match_prefix(s)
    assert bm.can_allocate(match, s.num_tokens)
    bm.allocate(s, match, s.num_tokens)
    cached = s.num_computed_tokens
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    bm.release_behind_window(s)
    bm.check_invariants()
    return cached


def test_a_prefix_whose_blocks_behind_the_window_were_evicted_is_still_reused():
    # Window of 8 tokens, blocks of 4: a step starting at position 24 reads blocks 4 and 5 only.
    bm = WindowPoolBlockManager(num_blocks=32, num_window_blocks=8, block_size=BS, window=8)
    a = seq(range(100, 124), "a")
    admit(bm, a)
    assert a.window_block_table[:4] == [-1] * 4 and a.block_table[:4] == [0, 1, 2, 3]
    a_blocks, a_window_blocks = list(a.block_table), list(a.window_block_table)
    bm.free(a)
    c = seq(range(500, 524), "c")  # another prompt takes the window pool's free blocks, then A's oldest
    admit(bm, c)
    bm.free(c)
    assert chain_hash(None, tuple(range(100, 104))) not in bm.window._hash_to_block  # A's block 0: gone

    b = seq(list(range(100, 124)) + [7, 8, 9, 10], "b")
    match = bm.match_prefix(b)
    assert match.num_tokens == 24 and match.main.blocks == a_blocks[:6]
    assert match.window.blocks == [-1] * 4 + a_window_blocks[4:6]
    assert bm.allocate(b, match, b.num_tokens) == []
    assert b.num_computed_tokens == 24 and b.window_block_table[:6] == [-1] * 4 + a_window_blocks[4:6]
    assert len(b.block_table) == len(b.window_block_table) == 7
    bm.check_invariants()


def test_the_match_is_the_prefix_both_pools_hold_and_a_partial_block_both_hold():
    bm = WindowPoolBlockManager(num_blocks=32, num_window_blocks=16, block_size=BS, window=8)
    a = seq(range(100, 122), "a")  # 5 whole blocks and 2 tokens of a sixth
    admit(bm, a)
    a_blocks, a_window_blocks = list(a.block_table), list(a.window_block_table)
    bm.free(a)
    # 4 whole blocks and 3 leading tokens of the fifth, in both pools: one copy in each.
    b = seq(list(range(100, 119)) + [1, 2, 3], "b")
    match = bm.match_prefix(b)
    assert a_blocks == [0, 1, 2, 3, 4, 5] and a_window_blocks == [-1, -1, -1, 3, 4, 5]
    # Block 2 of the window pool was freed behind a's window but is still cached: a step from position 19
    # reads it again, so it is taken; blocks 0 and 1 are behind that window too.
    assert match.num_tokens == 19 and match.window.blocks == [-1, -1, 2, 3]
    copies = bm.allocate(b, match, b.num_tokens)
    assert copies == [KVCopy(a_blocks[4], b.block_table[4], 3),
                      KVCopy(a_window_blocks[4], b.window_block_table[4], 3, window=True)]
    bm.free(b)
    # The window pool loses block 4: neither pool's match takes its leading tokens then.
    evict(bm.window, a_window_blocks[4])
    match = bm.match_prefix(b)
    assert match.num_tokens == 16 and match.main.partial_block is None and match.window.partial_block is None
    assert match.main.blocks == a_blocks[:4]
    bm.check_invariants()


def test_a_sequence_holds_at_most_its_window_in_the_window_pool():
    assert window_pool_blocks_per_sequence(32, 64, 256, 16) == 8  # 96 tokens: 6 blocks, and one at each end
    assert window_pool_blocks_per_sequence(4096, 512, 2048, 16) == 128  # never more than max_model_len's
    bm = WindowPoolBlockManager(num_blocks=64, num_window_blocks=64, block_size=BS, window=8)
    s = seq(range(10), "s")
    bm.allocate(s, bm.match_prefix(s), 10)
    peak = 0
    for length in range(11, 80):  # one decode step at a time
        s.num_computed_tokens = length - 1
        bm.release_behind_window(s)
        assert bm.can_append(s, length)
        bm.append_slots(s, length)
        s.token_ids.append(0)
        peak = max(peak, bm.window.num_used_blocks)
        assert bm.num_used_blocks == -(-length // BS)  # the full layers' pool keeps every block
    assert peak <= window_pool_blocks_per_sequence(8, 1, 1024, BS)
    bm.free(s)
    assert bm.window.num_used_blocks == bm.num_used_blocks == 0
    bm.check_invariants()


# ---- the engine, on tiny models that mix sliding and full layers -------------------------------------------

MIXED = {
    "gemma3": lambda c: transformers.Gemma3TextConfig(**c, head_dim=32, sliding_window=WINDOW,
                                                      layer_types=["sliding_attention", "full_attention"]),
    "gemma2": lambda c: transformers.Gemma2Config(**c, head_dim=32, sliding_window=WINDOW),
}


def _reference(model, ids: list[int], max_tokens: int, candidate: list[int]) -> list[int]:
    """transformers' greedy output of `max_tokens` tokens, EOS banned (greedy_reference.py checks `candidate`)."""
    return transformers_greedy(model, ids, candidate, max_tokens, min_new_tokens=max_tokens)[0]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, int]:
    """Step requests to their end: their outputs and the most blocks in use at once in each pool."""
    rids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    seqs = [engine._seqs[rid] for rid in rids]
    peak_main = peak_window = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()["kv_blocks"]
        peak_main, peak_window = max(peak_main, stats["used"]), max(peak_window, stats["window_pool"]["used"])
    engine.block_manager.check_invariants()
    return [s.output_token_ids for s in seqs], peak_main, peak_window


@pytest.fixture(scope="module")
def gemma3(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-window")
    return folder, write_tiny_model(MIXED["gemma3"](tiny_config_args(tokenizer)), tokenizer, folder)


@pytest.mark.parametrize("family", MIXED)
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_past_the_window_the_sliding_layers_hold_a_windows_worth_of_blocks(family, cpu_kernels, tokenizer, tmp_path):
    model = write_tiny_model(MIXED[family](tiny_config_args(tokenizer)), tokenizer, tmp_path)
    engine = Engine(EngineConfig.from_parameters(model=str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=64, cpu_kernels=cpu_kernels, warmup=False))
    assert engine.runner.num_window_blocks == 4 * 8  # max_num_seqs sequences of (32 + 64) / 16 + 2 blocks
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    outs, peak_main, peak_window = _run(engine, [ids], 120)
    assert outs[0] == _reference(model, ids, 120, outs[0])
    assert peak_main == -(-(len(ids) + 119) // 16)  # the full layers keep every position
    # The sliding layers: the window before the newest token and the prompt's first 64-token chunk.
    assert peak_window <= max(-(-(WINDOW + 1) // 16) + 1, 64 // 16 + 1) < peak_main


def test_a_prefix_reused_past_the_window_gives_the_models_outputs(gemma3, tokenizer):
    # The sliding layers' cached blocks behind the prompt's window are dropped: the prompt asked again
    # still reuses every cached token (the full layer's blocks, and the sliding layer's inside the
    # window), and the output is the model's.
    folder, model = gemma3
    engine = Engine(EngineConfig.from_parameters(model=str(folder), num_kv_blocks=64, max_model_len=256, max_num_seqs=1,
                                 max_num_batched_tokens=64, warmup=False))
    first = tokenizer.encode(" ".join([PROMPT] * 3), add_special_tokens=False)
    assert len(first) > 2 * WINDOW
    (out_first,), _, _ = _run(engine, [first], 24)
    window_pool, parent = engine.block_manager.window, None
    for i in range((len(first) - WINDOW) // 16 - 1):  # blocks wholly behind the window of the prompt's end
        parent = chain_hash(parent, tuple(first[i * 16:(i + 1) * 16]))
        evict(window_pool, window_pool._hash_to_block[parent])
    assert engine.block_manager.main._hash_to_block.get(parent) is not None
    hits = engine.block_manager.prefix_hit_tokens
    (again,), _, _ = _run(engine, [first], 24)
    assert engine.block_manager.prefix_hit_tokens - hits == len(first) - 1  # every prompt token but the last
    assert again == out_first == _reference(model, first, 24, out_first)


def test_preempted_sequences_recompute_the_models_outputs(gemma3, tokenizer):
    # Four sequences that need 9 blocks each of a 24-block pool: preempted and recomputed as blocks run out.
    folder, model = gemma3
    engine = Engine(EngineConfig.from_parameters(model=str(folder), num_kv_blocks=24, max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=64, warmup=False))
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPT.split(", ")[:2] + PROMPT.split("; ")]
    outs, _, _ = _run(engine, prompts, 120)
    assert engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        assert out == _reference(model, ids, 120, out)


def test_the_memory_the_window_pool_saves_goes_to_the_full_layers(gemma3):
    folder, _ = gemma3
    config = EngineConfig.from_parameters(model=str(folder), kv_cache_max_bytes=8 << 20, max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=64, warmup=False)
    one_pool = Engine(config.with_parameters(window_pool=False)).runner.kv_plan
    two_pools = Engine(config).runner.kv_plan
    assert one_pool.num_window_blocks == 0 and two_pools.num_window_blocks == 4 * 8
    assert two_pools.kv_bytes_per_token == two_pools.window_kv_bytes_per_token == one_pool.kv_bytes_per_token // 2
    bytes_used = lambda r: r.block_size * (r.num_blocks * r.kv_bytes_per_token + r.num_window_blocks * r.window_kv_bytes_per_token)
    assert bytes_used(two_pools) <= bytes_used(one_pool) + two_pools.block_size * two_pools.kv_bytes_per_token
    # The sliding layer's blocks beyond max_num_seqs windows went to the full layer's pool.
    assert two_pools.num_blocks == 2 * one_pool.num_blocks - two_pools.num_window_blocks
    assert two_pools.max_concurrency == pytest.approx(one_pool.max_concurrency * two_pools.num_blocks / one_pool.num_blocks)


def test_the_window_pool_size_can_be_set_and_must_hold_one_sequences_window(gemma3):
    folder, _ = gemma3
    config = EngineConfig.from_parameters(model=str(folder), kv_cache_max_bytes=8 << 20, max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=64, warmup=False)
    default = Engine(config).runner
    smaller = Engine(config.with_parameters(num_window_kv_blocks=12)).runner
    assert smaller.num_window_blocks == 12
    assert smaller.num_blocks == default.num_blocks + default.num_window_blocks - 12  # one layer each
    with pytest.raises(RuntimeError, match="num_window_kv_blocks=7 cannot hold one sequence's window: at least 8"):
        Engine(config.with_parameters(num_window_kv_blocks=7))
