"""Our C++ paged decode attention against the torch path it replaces, and the engine with it on and off."""

from __future__ import annotations

import shutil

import pytest
import torch

from tritonllm import cpu_kernels
from tritonllm.layers.attention import AttentionGroup, _decode_group

# Where a compiler exists the kernels must build: a broken build must not hide behind the fallback.
pytestmark = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")


@pytest.fixture(autouse=True)
def built():
    assert cpu_kernels.load(), cpu_kernels.error()


def _case(batch: int, kv_heads: int, per_kv: int, max_blocks: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    head_dim, block_size, num_blocks = 64, 16, batch * max_blocks + 8
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].view(batch, max_blocks)
    width = max_blocks * block_size
    lengths = torch.randint(1, width + 1, (batch,), generator=gen).sort().values
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if max_blocks > 2:
        mask[-1, block_size:2 * block_size] = False  # a block pruned from the window
    q = torch.randn(batch, kv_heads * per_kv, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, mask


@pytest.mark.parametrize("batch,kv_heads,per_kv,max_blocks", [(1, 1, 1, 1), (5, 3, 3, 4), (64, 3, 3, 20), (7, 2, 4, 9)])
def test_kernel_equals_torch_path(batch, kv_heads, per_kv, max_blocks):
    q, k_cache, v_cache, tables, mask = _case(batch, kv_heads, per_kv, max_blocks, seed=batch)
    scale = q.shape[-1] ** -0.5
    group = AttentionGroup(block_tables=tables, mask=mask[:, None, None, :], query_index=None, output_index=None,
                           token_offset=0, num_tokens=batch)
    expected = _decode_group(q, k_cache, v_cache, group, scale)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, mask, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_block_ids():
    q, k_cache, v_cache, tables, mask = _case(2, 1, 1, 2, seed=0)
    tables[0, 0] = k_cache.shape[1]  # one past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, mask, 0.125)


def test_engine_tokens_equal_with_and_without_kernel():
    from tritonllm.config import EngineConfig
    from tritonllm.engine import Engine

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
               "Once upon a time, in a small village by the mountains, there lived"]
    params = {"max_tokens": 24, "temperature": 0.0}
    outputs = {}
    for on in (True, False):
        engine = Engine(EngineConfig(device="cpu", num_threads=2, cpu_kernels=on, num_kv_blocks=256, warmup=False))
        assert engine.runner.decode_kernel is on
        outputs[on] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs[True] == outputs[False]
