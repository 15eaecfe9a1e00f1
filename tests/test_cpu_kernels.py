"""Our C++ CPU kernels against the torch paths they replace, and the engine with them on and off."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tritonllm.devices.cpu import kernels as cpu_kernels
from tritonllm.layers.attention import _decode_group, _Group
from tritonllm.layers.kv_layout import write_kv
from tritonllm.layers.rotary import RotaryEmbedding, apply_rotary

# Where a compiler exists the kernels must build: a broken build must not hide behind the fallback.
pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")]


@pytest.fixture(autouse=True)
def built():
    assert cpu_kernels.load(), cpu_kernels.error()


def test_a_lock_file_left_by_a_killed_load_does_not_stop_the_next_load():
    """A process killed while loading the kernels leaves torch's lock file behind (it is an empty
    file, removed by its creator); the next load must go on, not wait for it forever."""
    stale = cpu_kernels._build_directory() / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-m", "tritonllm.devices.cpu.kernels", "--this-cpu"], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading the kernels waited on {stale}")
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and "ready" in done.stdout, done.stdout + done.stderr



def test_each_checkout_keeps_its_own_build(monkeypatch, tmp_path):
    """torch rebuilds an extension whose source paths changed: two checkouts sharing one build
    folder would recompile each other's kernels at every server start."""
    here = cpu_kernels._build_directory()
    assert here == cpu_kernels._build_directory() and here.is_dir()
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [tmp_path / "csrc" / s.name for s in cpu_kernels._SOURCES])
    other = cpu_kernels._build_directory()
    try:
        assert other != here and other.parent == here.parent
    finally:
        other.rmdir()

def _case(batch: int, kv_heads: int, per_kv: int, max_blocks: int, seed: int, head_dim: int = 64, block_size: int = 16,
          window: int | None = None):
    """One decode per sequence: (q, k_cache, v_cache, block_table, row_seq, row_end, row_start, mask). The
    last sequence's second block is given back (-1); `mask` [batch, width]: what each row sees, for the
    torch reference."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * max_blocks + 8
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    width = max_blocks * block_size
    lengths = torch.randint(1, width + 1, (batch,), generator=gen).sort().values
    if max_blocks > 2:
        lengths[-1] = max(int(lengths[-1]), 2 * block_size + 1)
        table[-1, 1] = -1  # a block pruned from the window (kv_window)
    row_seq, row_end = torch.arange(batch, dtype=torch.int32), lengths.to(torch.int32)
    row_start = (row_end - window).clamp(min=0) if window else torch.zeros_like(row_end)
    pos = torch.arange(width)[None, :]
    mask = (pos < row_end[:, None]) & (pos >= row_start[:, None]) & (table >= 0).repeat_interleave(block_size, dim=1)
    q = torch.randn(batch, kv_heads * per_kv, head_dim, generator=gen)
    return q, k_cache, v_cache, table, row_seq, row_end, row_start, mask


def _reference(q, k_cache, v_cache, table, mask, scale):
    """The torch reference's decode attention (layers/attention.py) over the same keys."""
    group = _Group(rows=slice(0, q.shape[0]), tables=table.long().clamp(min=0), mask=mask[:, None, None, :])
    return _decode_group(q, k_cache, v_cache, group, scale)


# head_dim 64 / 128 with block size 16 / 32 take the vector path; head_dim 48 and block size 8 do not
# divide into AVX-512 registers and take the scalar one. The vector path scores a KV head's query
# heads in groups of up to 4 that divide per_kv: 1, 2, 3 and 4 heads at once, 6 as two groups of 3,
# 5 one at a time.
SHAPES = [(1, 1, 1, 1, 64, 16), (5, 3, 3, 4, 64, 16), (64, 3, 3, 20, 64, 16), (7, 2, 4, 9, 64, 16),
          (6, 2, 4, 5, 128, 16), (4, 3, 3, 3, 64, 32), (5, 3, 3, 4, 48, 16), (5, 3, 3, 6, 64, 8),
          (3, 2, 2, 4, 64, 16), (3, 1, 6, 4, 64, 16), (3, 1, 5, 4, 64, 16)]


@pytest.mark.parametrize("batch,kv_heads,per_kv,max_blocks,head_dim,block_size", SHAPES)
def test_kernel_equals_torch_path(batch, kv_heads, per_kv, max_blocks, head_dim, block_size):
    q, k_cache, v_cache, table, row_seq, row_end, row_start, mask = _case(
        batch, kv_heads, per_kv, max_blocks, seed=batch, head_dim=head_dim, block_size=block_size)
    scale = q.shape[-1] ** -0.5
    expected = _reference(q, k_cache, v_cache, table, mask, scale)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# A sliding layer's rows see their last `window` positions: a window of 7 or 37 starts mid-block, one of
# 16 at a block's first key where the position allows; the blocks wholly behind it are not visited.
@pytest.mark.parametrize("window", [7, 16, 37])
@pytest.mark.parametrize("batch,kv_heads,per_kv,max_blocks,head_dim,block_size", [
    (64, 3, 3, 20, 64, 16), (7, 2, 4, 9, 64, 16), (4, 3, 3, 3, 64, 32), (5, 3, 3, 4, 48, 16), (5, 3, 3, 6, 64, 8)])
def test_kernel_equals_torch_path_in_a_sliding_window(window, batch, kv_heads, per_kv, max_blocks, head_dim,
                                                      block_size):
    q, k_cache, v_cache, table, row_seq, row_end, row_start, mask = _case(
        batch, kv_heads, per_kv, max_blocks, seed=batch + window, head_dim=head_dim, block_size=block_size,
        window=window)
    scale = head_dim ** -0.5
    expected = _reference(q, k_cache, v_cache, table, mask, scale)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_result_does_not_depend_on_the_thread_count():
    # The threads claim (row, KV head) items as they go (csrc/claimed_chunks.h); each item is
    # computed whole by one thread, so the result is the same whoever takes it.
    q, k_cache, v_cache, *rows, _ = _case(48, 3, 3, 12, seed=11)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(cpu_kernels.paged_decode_attention(q, k_cache, v_cache, *rows, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_row_result_does_not_depend_on_the_other_rows_or_their_order():
    """Rows are claimed longest first whatever order they come in (a step's rows need not be sorted);
    each row's result is the same alone, among others, or with the rows shuffled."""
    q, k_cache, v_cache, table, row_seq, row_end, row_start, _ = _case(24, 3, 3, 12, seed=5, window=40)
    whole = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, 0.125)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    shuffled = cpu_kernels.paged_decode_attention(q[perm], k_cache, v_cache, table, row_seq[perm], row_end[perm],
                                                  row_start[perm], 0.125)
    assert torch.equal(shuffled, whole[perm])
    for r in (0, 23):
        one = cpu_kernels.paged_decode_attention(q[r:r + 1], k_cache, v_cache, table, row_seq[r:r + 1],
                                                 row_end[r:r + 1], row_start[r:r + 1], 0.125)
        assert torch.equal(one, whole[r:r + 1])


# A 16-bit pool (kv_cache_dtype): the kernel widens each row as it loads it, the torch path converts
# the gathered blocks; both then do float32 arithmetic on the same values.
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads,per_kv,max_blocks,head_dim,block_size,window", [
    (64, 3, 3, 20, 64, 16, None), (6, 2, 4, 5, 128, 16, None), (4, 3, 3, 3, 64, 32, 37), (5, 3, 3, 4, 48, 16, 7)])
def test_kernel_equals_torch_path_on_a_16_bit_pool(kv_dtype, batch, kv_heads, per_kv, max_blocks, head_dim,
                                                   block_size, window):
    q, k_cache, v_cache, table, row_seq, row_end, row_start, mask = _case(
        batch, kv_heads, per_kv, max_blocks, seed=batch, head_dim=head_dim, block_size=block_size, window=window)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    scale = head_dim ** -0.5
    expected = _reference(q, k_cache, v_cache, table, mask, scale)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (48, 16)])
def test_kernel_never_reads_rows_outside_what_each_row_sees(head_dim, block_size, window):
    # Slots past a sequence's length, behind its window, or in blocks it gave back (-1) may hold anything
    # (the pool is not cleared): NaN there must not reach the output.
    q, k_cache, v_cache, table, row_seq, row_end, row_start, mask = _case(
        6, 3, 3, 5, seed=3, head_dim=head_dim, block_size=block_size, window=window)
    scale = head_dim ** -0.5
    expected = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, scale)
    listed = set(table[table >= 0].tolist())
    for block in range(k_cache.shape[1]):
        if block not in listed:  # among them the block the last sequence gave back
            k_cache[:, block] = v_cache[:, block] = float("nan")
    for b in range(table.shape[0]):
        for pos in (~mask[b]).nonzero().flatten().tolist():
            block, offset = int(table[b, pos // block_size]), pos % block_size
            if block >= 0:
                k_cache[:, block, offset] = v_cache[:, block, offset] = float("nan")
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end, row_start, scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_kernel_rejects_bad_block_ids_and_rows():
    q, k_cache, v_cache, table, row_seq, row_end, row_start, _ = _case(2, 1, 1, 2, seed=0)
    for bad in (k_cache.shape[1], -2):  # one past the pool; below -1 (the one negative id: a given-back block)
        bad_table = table.clone()
        bad_table[0, 0] = bad
        with pytest.raises(RuntimeError, match="block id out of range"):
            cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bad_table, row_seq, row_end, row_start, 0.125)
    with pytest.raises(RuntimeError, match="row_seq out of range"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq + 1, row_end, row_start, 0.125)
    with pytest.raises(RuntimeError, match="outside the table"):  # keys past the table's width
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, row_seq, row_end + 2 * 16, row_start, 0.125)


@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_add_rms_norm_equals_torch(tokens):
    gen = torch.Generator().manual_seed(tokens)
    residual, x = torch.randn(tokens, 576, generator=gen), torch.randn(tokens, 576, generator=gen) * 3
    weight = torch.rand(576, generator=gen) + 0.5
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (576,), weight, 1e-5)
    got = cpu_kernels.add_rms_norm_(residual, x, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # updated in place
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_silu_mul_equals_torch_including_extreme_gates():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 1536, generator=gen) * 5
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # exp over/underflow territory
    gate, up = gate_up.split(1536, dim=-1)
    got = cpu_kernels.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 9, 3), (64, 9, 3), (37, 8, 2)])
def test_rope_write_kv_equals_rotary_and_write_kv(tokens, heads, kv_heads, kv_dtype):
    gen = torch.Generator().manual_seed(tokens)
    head_dim, num_blocks, block_size = 64, 40, 16
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    rotary = RotaryEmbedding(type("Cfg", (), {"rope_theta": 100000.0})(), head_dim, 2048)
    cos, sin = rotary.lookup(torch.randint(0, 2048, (tokens,), generator=gen), torch.float32)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    k_ref = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    v_ref = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    write_kv(k_ref, v_ref, qk[:, heads:], qkv[:, heads + kv_heads:], slots)
    q = cpu_kernels.rope_write_kv(qkv, cos, sin, k_got, v_got, slots, heads, kv_heads)
    torch.testing.assert_close(q, qk[:, :heads], rtol=1e-5, atol=1e-5)
    # Rotated K may differ from torch's in the last float32 bit, which can move a 16-bit rounding by
    # one step; V is stored as it came, rounded the same way as torch's .to().
    k_tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[kv_dtype]
    torch.testing.assert_close(k_got, k_ref, rtol=k_tol, atol=k_tol)
    torch.testing.assert_close(v_got, v_ref, rtol=0, atol=0)


def test_rope_write_kv_rejects_bad_slots_and_dtypes():
    qkv = torch.randn(2, 3, 8)
    cos, sin = torch.ones(2, 1, 8), torch.zeros(2, 1, 8)
    k_cache, v_cache = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 8]), 1, 1)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([-1, 0]), 1, 1)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.rope_write_kv(qkv.double(), cos, sin, k_cache, v_cache, torch.tensor([0, 1]), 1, 1)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16 pool"):
        cpu_kernels.rope_write_kv(qkv, cos, sin, k_cache.double(), v_cache.double(), torch.tensor([0, 1]), 1, 1)
    assert not k_cache.any() and not v_cache.any()  # nothing written by a rejected call


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 49152), (64, 1000)])
def test_greedy_head_equals_torch_path(rows, vocab):
    from tritonllm.devices.cpu.head import CpuGreedyHead
    from tritonllm.runner.sampler import choose_tokens, unpack_tokens
    from tritonllm.runner.sampling_batch import SamplingBatch

    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=gen) * 8
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie: the lower index wins
    fused = CpuGreedyHead(fused=True).argmax_logprob
    ids, logprobs = unpack_tokens(choose_tokens(logits.clone(), SamplingBatch(), fused).numpy())
    ref_ids, ref_logprobs = unpack_tokens(choose_tokens(logits.clone(), SamplingBatch()).numpy())
    assert ids == ref_ids and ids[0] == vocab // 2
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)
    # A step where no row wants its log-prob: the same ids, the log-probs' pass skipped (NaN).
    only_ids, no_logprobs = cpu_kernels.greedy_head(logits.clone(), logprobs=False)
    assert only_ids.tolist() == ref_ids and torch.isnan(no_logprobs).all()


def test_greedy_head_finds_the_first_of_equal_maxima_anywhere_in_a_row():
    """The argmax pass keeps each vector lane's first maximum: ties across lanes and in the scalar tail
    go to the lowest index, as torch's argmax, whatever the row's length."""
    for vocab in (1, 15, 16, 17, 33, 1000):
        for first, second in [(0, vocab - 1), (vocab // 2, vocab - 1), (vocab - 2, vocab - 1), (3, 19), (17, 18)]:
            if not 0 <= first < second < vocab:
                continue
            logits = torch.linspace(-3, 2, vocab).flip(0).unsqueeze(0).contiguous()
            logits[0, first] = logits[0, second] = 9.0
            ids, logprobs = cpu_kernels.greedy_head(logits)
            assert ids.tolist() == [first] == [int(torch.argmax(logits[0]))]
            assert logprobs.item() == pytest.approx(torch.log_softmax(logits[0], 0)[first].item(), abs=1e-5)
        one = torch.full((1, vocab), -1.0)
        one[0, vocab - 1] = 0.5  # the last value, in the tail or the last vector
        assert cpu_kernels.greedy_head(one, logprobs=False)[0].tolist() == [vocab - 1]


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("decode_lengths,prompts", [
    ([], [(0, 37)]),  # one prompt alone
    ([], [(16, 90), (0, 5), (32, 17)]),  # prompt chunks after cached prefixes
    ([3, 40, 41, 200], [(48, 70), (0, 2)]),  # decodes and prompt chunks in one step
])
def test_prompt_chunks_through_the_kernel_equal_the_sdpa_path(decode_lengths, prompts, window):
    """Each prompt token goes through the decode kernel as a query row of its own, every row of the step
    in one call, reading its sequence's table up to its position (in a sliding layer, from its
    position + 1 - window: a window of 24 starts mid-block)."""
    from tritonllm.devices.cpu.paged_attention import kernel_attention
    from tritonllm.layers.attention import paged_attention
    from tritonllm.core.sampling_params import SamplingParams
    from tritonllm.scheduling.scheduler import ScheduledSeq
    from tritonllm.core.sequence import Sequence
    from tritonllm.runner.step_inputs import build_host_step, to_device

    block_size, kv_heads, heads, head_dim, num_blocks = 16, 3, 9, 64, 128
    gen = torch.Generator().manual_seed(7)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    scheduled = []
    for i, (computed, new) in enumerate([(n, 1) for n in decode_lengths] + prompts):
        seq = Sequence(f"s{i}", list(range(computed + new)), SamplingParams())
        seq.num_computed_tokens = computed
        seq.block_table = [free.pop() for _ in range(-(-(computed + new) // block_size))]
        scheduled.append(ScheduledSeq(seq, new))
    for item in scheduled:
        if item.num_new_tokens > 1 and item.seq.num_computed_tokens >= 2 * block_size:
            item.seq.block_table[1] = -1  # a cached block pruned from the window (kv_window)
        if window is not None:  # blocks behind every one of its rows' windows are given back
            behind = (item.seq.num_computed_tokens + 1 - window) // block_size
            item.seq.block_table[:max(behind, 0)] = [-1] * max(behind, 0)
    host, _ = build_host_step(scheduled, block_size)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    q = torch.randn(len(host.input_ids), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    meta = to_device(host, torch.device("cpu")).meta
    expected = paged_attention(q, k_cache, v_cache, meta.seqs, scale, window=window)
    got = kernel_attention(q, k_cache, v_cache, meta.seqs, scale, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.engine
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_engine_tokens_equal_with_and_without_kernel(kv_cache_dtype):
    from tritonllm.core.config import EngineConfig
    from tritonllm.engine.engine import Engine

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
               "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 24, "temperature": 0.0}
    outputs = {}
    for on in (True, False):
        engine = Engine(EngineConfig.from_parameters(device="cpu", num_threads=2, cpu_kernels=on, num_kv_blocks=256, warmup=False,
                                     kv_cache_dtype=kv_cache_dtype))
        assert engine.runner.backend.ops.kernels is on
        outputs[on] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs[True] == outputs[False]
