"""guided_decoding {"choice": [...]}: the output is one of the strings, each written with the tokens the
tokenizer writes it with alone (byte-level pieces of a character included), as transformers constrained
the same way."""

from __future__ import annotations

import pytest
import torch

from grpc_stream import StreamClient, make_inputs
from tritonllm.core.sampling_params import InvalidRequestError, SamplingParams
from tritonllm.guided.decoding import Guides

pytestmark = pytest.mark.unit

CHOICES = ["The Eiffel Tower", "The Louvre museum", "The Seine", "Notre-Dame de Paris", "The"]
# The packaged model's tokenizer writes each of these emoji as three byte-level pieces, not one token.
EMOJI_CHOICES = ["👍 yes", "👎 no", "🤷 not sure"]
PROMPT = "Name the most famous sight of Paris in a few words."


def _reference_allowed(choices: list[list[int]], eos: int, prompt_len: int):
    """transformers' prefix_allowed_tokens_fn for the same constraint, written out on its own."""
    def allowed(_batch: int, input_ids) -> list[int]:
        out = input_ids[prompt_len:].tolist()
        nxt = {c[len(out)] for c in choices if len(c) > len(out) and c[:len(out)] == out}
        if out in choices or not nxt:
            nxt.add(eos)
        return sorted(nxt)
    return allowed


def test_allowed_tokens_are_the_next_tokens_of_the_choices_as_written_alone(tokenizer):
    eos = tokenizer.eos_token_id
    guide = Guides(tokenizer, {eos}).for_request(
        SamplingParams(guided_decoding={"choice": CHOICES + EMOJI_CHOICES}).guided_decoding)
    choices = [tokenizer.encode(c, add_special_tokens=False) for c in CHOICES + EMOJI_CHOICES]
    reference = _reference_allowed(choices, eos, 0)
    for choice in choices:
        cursor = guide.start()
        for k in range(len(choice) + 1):
            head = choice[:k]
            assert cursor.allowed_tokens(head).tolist() == reference(0, torch.tensor(head, dtype=torch.long)), head
            extended = any(len(c) > k and c[:k] == head for c in choices)
            assert cursor.is_complete(head) == (head in choices and not extended), head


def test_a_choice_written_in_byte_level_pieces(engine, tokenizer):
    params = SamplingParams(max_tokens=12, guided_decoding={"choice": EMOJI_CHOICES})
    [out] = engine.generate(["Is Paris in France? Answer with an emoji and a word."], params, apply_chat_template=True)
    assert out.text in EMOJI_CHOICES and out.finish_reason == "stop", out.text
    assert out.token_ids == tokenizer.encode(out.text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in out.token_ids)  # a piece of a character


def test_greedy_choice_equals_transformers_with_the_same_constraint(engine, hf_model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=16, guided_decoding={"choice": CHOICES})
    [out] = engine.generate(prompt_token_ids=[ids], params=params)
    assert out.text in CHOICES and out.finish_reason == "stop"
    choices = [tokenizer.encode(c, add_special_tokens=False) for c in CHOICES]
    eos = tokenizer.eos_token_id
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos, prefix_allowed_tokens_fn=_reference_allowed(choices, eos, len(ids)))
    ref_ids = ref[0, len(ids):].tolist()
    assert out.token_ids == [t for t in ref_ids if t != eos] or out.token_ids == ref_ids


def test_sampled_choices_are_always_whole_choices(engine):
    params = SamplingParams(n=8, max_tokens=16, temperature=1.5, seed=4, guided_decoding={"choice": CHOICES})
    outs = engine.generate([PROMPT], params, apply_chat_template=True)
    assert all(o.text in CHOICES for o in outs), [o.text for o in outs]
    # "The" alone is a whole choice that others extend: it may end there (with end of sequence) or go on.
    assert len({o.text for o in outs}) > 1


def test_structured_outputs_is_the_same_parameter_as_json_text(engine):
    a = engine.generate(["Is the sky blue? Answer:"], SamplingParams.from_dict(
        {"max_tokens": 4, "structured_outputs": '{"choice": [" yes", " no"]}'}))[0]
    b = engine.generate(["Is the sky blue? Answer:"], SamplingParams(max_tokens=4,
                                                                     guided_decoding={"choice": [" yes", " no"]}))[0]
    assert a.text == b.text and a.text in (" yes", " no")


@pytest.mark.parametrize("guided, message", [
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"choice": "a"}, "non-empty list"),
])
def test_malformed_choices_are_clear_errors(guided, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(guided_decoding=guided)


@pytest.mark.server
def test_guided_choice_through_tritonserver(triton_server):
    client = StreamClient(triton_server.grpc_url)
    try:
        sampling = {"n": 3, "max_tokens": 16, "temperature": 1.0, "seed": 9, "guided_decoding": {"choice": CHOICES}}
        client.send("g", make_inputs(PROMPT, stream=False, chat=True, exclude_input=True, sampling=sampling))
        got = client.wait(["g"])
        client.send("bad", make_inputs(PROMPT, sampling={"guided_decoding": {"ebnf": "root ::= x"}}))
        got.update(client.wait(["bad"]))
    finally:
        client.close()
    assert got["g"].error is None
    [arrays] = got["g"].arrays
    assert all(t.decode() in CHOICES for t in arrays["text_output"]) and len(arrays["text_output"]) == 3
    assert got["bad"].error is not None and "['ebnf'] is not supported" in got["bad"].error
