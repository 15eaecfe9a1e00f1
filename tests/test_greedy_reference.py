"""The engine tests' transformers reference (greedy_reference.py) is transformers' greedy `generate`: a
right candidate is taken as it is, with generate's log-probs, and any wrong one is replaced by generate's
output."""

from __future__ import annotations

import pytest
import torch
import transformers

from greedy_reference import transformers_greedy
from tiny_models import tiny_config_args, write_tiny_model

pytestmark = pytest.mark.engine

PROMPT = "Once upon a time, in a land far away, there"


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    return write_tiny_model(transformers.LlamaConfig(**tiny_config_args(tokenizer)), tokenizer,
                            tmp_path_factory.mktemp("tiny"))


def _generate(model, ids, max_new, min_new=0, eos=None):
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0)
    new = out.sequences[0, len(ids):].tolist()
    return new, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new)]


@pytest.mark.parametrize("min_new", [0, 12])
def test_generates_output_is_taken_with_its_log_probs(tiny, tokenizer, min_new):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    want, want_lps = _generate(tiny, ids, 12, min_new)
    got, lps = transformers_greedy(tiny, ids, want, 12, min_new_tokens=min_new)
    assert got == want
    assert lps == pytest.approx(want_lps, abs=1e-3)  # one pass against cached steps: float32 roundings apart


def test_a_stop_at_eos_is_checked_like_any_other_token(tiny, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    want, _ = _generate(tiny, ids, 12)
    eos = [want[4]]  # generate then stops at that token's first place, EOS included
    short, _ = _generate(tiny, ids, 12, eos=eos)
    assert short == want[:want.index(want[4]) + 1]
    assert transformers_greedy(tiny, ids, short, 12, eos=eos)[0] == short
    # The candidate that runs on past that EOS is not transformers' output.
    assert transformers_greedy(tiny, ids, want, 12, eos=eos)[0] == short


def test_any_wrong_candidate_is_replaced_by_generates_output(tiny, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    want, _ = _generate(tiny, ids, 12)
    other = (want[7] + 1) % len(tokenizer)
    wrong = [want[:7] + [other] + want[8:], want[:11], want + [want[0]], [], want[:7] + [other]]
    for candidate in wrong:
        assert transformers_greedy(tiny, ids, candidate, 12)[0] == want, candidate


def test_logits_processors_apply_at_every_position_as_in_generate(tiny, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    plain, _ = _generate(tiny, ids, 12)
    banned = plain[2]

    def ban(input_ids, scores):  # sees the sequence so far, as generate's processors do
        scores = scores.clone()
        scores[0, banned] = float("-inf")
        if input_ids.shape[1] > len(ids):
            scores[0, int(input_ids[0, -1])] -= 1.0
        return scores

    out = tiny.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, logits_processor=[ban],
                        pad_token_id=0)
    want = out[0, len(ids):].tolist()
    assert banned not in want and want != plain
    assert transformers_greedy(tiny, ids, want, 12, processors=[ban])[0] == want
    assert transformers_greedy(tiny, ids, plain, 12, processors=[ban])[0] == want


def test_without_eos_ids_nothing_stops_the_output_early(tiny, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    full, _ = transformers_greedy(tiny, ids, [], 40, eos=[])  # generate's own output
    assert len(full) == 40
    assert transformers_greedy(tiny, ids, full, 40, eos=[])[0] == full  # the check accepts it as it is
