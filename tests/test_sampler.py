"""The fused head's sampling: tokens drawn with the probabilities softmax(logits / T) after top-k / top-p /
min-p, never a token those exclude, and the same tokens again for the same generators."""

from __future__ import annotations

import pytest
import torch

from tritonllm.runner.sampler import SamplingBatch, choose_tokens

pytestmark = pytest.mark.unit

DRAWS = 40_000  # rows of one batch: each row is one independent draw


def _draw(logits_row: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None) -> torch.Tensor:
    logits = torch.tensor([logits_row], dtype=torch.float32).repeat(DRAWS, 1)
    batch = SamplingBatch(temperatures=torch.full((DRAWS,), temperature), top_k=torch.full((DRAWS,), top_k),
                          top_p=torch.full((DRAWS,), top_p), min_p=torch.full((DRAWS,), min_p), generators=generators)
    return choose_tokens(logits, batch)[0].long()


def _frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / len(ids)


def _assert_close(freq: torch.Tensor, expected: torch.Tensor) -> None:
    # Four standard deviations of a binomial frequency: fails by chance about once in 16,000 tokens.
    tolerance = 4 * (expected * (1 - expected) / DRAWS).sqrt() + 1e-9
    assert ((freq - expected).abs() <= tolerance).all(), (freq.tolist(), expected.tolist())


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, float("-inf")]


def test_frequencies_follow_the_softmax_at_the_temperature():
    torch.manual_seed(0)
    for temperature in (1.0, 0.5, 2.0):
        expected = torch.softmax(torch.tensor(LOGITS, dtype=torch.float64) / temperature, dim=0)
        _assert_close(_frequencies(_draw(LOGITS, temperature), len(LOGITS)), expected)


def test_top_k_top_p_and_min_p_keep_only_their_tokens_in_proportion():
    torch.manual_seed(1)
    probs = torch.softmax(torch.tensor(LOGITS, dtype=torch.float64), dim=0)
    order = probs.argsort(descending=True)
    for kwargs, kept in [({"top_k": 3}, order[:3]),
                         ({"top_p": 0.8}, order[:(probs[order].cumsum(0) - probs[order] <= 0.8).sum()]),
                         ({"min_p": 0.2}, (probs >= 0.2 * probs.max()).nonzero().flatten())]:
        expected = torch.zeros_like(probs)
        expected[kept] = probs[kept] / probs[kept].sum()
        freq = _frequencies(_draw(LOGITS, **kwargs), len(LOGITS))
        assert (freq[expected == 0] == 0).all(), (kwargs, freq.tolist())
        _assert_close(freq, expected)


def test_a_token_of_probability_zero_is_never_drawn_even_at_the_ends_of_the_row():
    torch.manual_seed(2)
    logits = [float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]
    ids = _draw(logits)
    assert set(ids.unique().tolist()) == {1, 3}


def test_the_same_generators_draw_the_same_tokens():
    def generators():
        return [torch.Generator().manual_seed(i % 97) for i in range(DRAWS)]

    a, b = _draw(LOGITS, generators=generators()), _draw(LOGITS, generators=generators())
    assert torch.equal(a, b) and len(a.unique()) > 3
    # Rows with equal seeds drew equal tokens: each row's draw is its own generator's.
    assert torch.equal(a[:97], a[97:194])


def test_a_flat_row_whose_top_p_cut_lies_past_the_first_hundreds_of_tokens():
    torch.manual_seed(3)
    logits = torch.linspace(0.0, -1.0, 2000).tolist()  # nearly flat: top_p 0.5 keeps ~870 tokens
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)
    kept = int(((probs.cumsum(0) - probs) <= 0.5).sum())
    assert kept > 256
    expected = torch.zeros_like(probs)
    expected[:kept] = probs[:kept] / probs[:kept].sum()
    freq = _frequencies(_draw(logits, top_p=0.5), len(logits))
    assert (freq[kept:] == 0).all() and (freq[:kept] > 0).sum() > 0.9 * kept
    _assert_close(freq, expected)
    freq = _frequencies(_draw(logits, top_k=1000), len(logits))
    assert (freq[1000:] == 0).all() and (freq[:1000] > 0).sum() > 900


def test_rows_with_and_without_limits_in_one_batch():
    torch.manual_seed(4)
    logits = torch.tensor([LOGITS], dtype=torch.float32).repeat(4 * 1000, 1)
    top_k = torch.tensor([0, 2, 0, 0]).repeat_interleave(1000)
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0]).repeat_interleave(1000)
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.0]).repeat_interleave(1000)  # the last rows greedy
    batch = SamplingBatch(temperatures=temperature, top_k=top_k, top_p=top_p, min_p=torch.zeros(4000))
    ids = choose_tokens(logits, batch)[0].long().view(4, 1000)
    order = torch.tensor(LOGITS).argsort(descending=True).tolist()
    assert len(ids[0].unique()) >= 5  # no limit: the long tail shows up
    assert set(ids[1].unique().tolist()) == set(order[:2])
    assert set(ids[2].unique().tolist()) <= set(order[:2])  # the first two: 42 % and 25 %
    assert set(ids[3].tolist()) == {order[0]}
