"""The kind of an error inside its message (core/error_kinds.py): asked for, written, read back."""

from __future__ import annotations

import numpy as np
import pytest

from tritonllm.core.error_kinds import KINDS, asks_for_kind, split_kind, with_kind
from tritonllm.serving.request_parsing import parse_request

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("parameters,asks", [
    ('{"error_kind_in_message": true}', True),
    ('{"max_tokens": 4, "error_kind_in_message": true}', True),
    ('{"error_kind_in_message": false}', False),
    ('{"error_kind_in_message": "true"}', False),  # a request parameter of Triton's bool kind, nothing else
    ('{"max_tokens": 4}', False),
    ("", False),
    (None, False),
    ('["error_kind_in_message"]', False),
    ("{not json error_kind_in_message", False),
])
def test_a_request_asks_for_the_kind_with_a_bool_parameter(parameters, asks):
    assert asks_for_kind(parameters) is asks


def test_a_kind_written_into_a_message_reads_back_and_nothing_else_does():
    for kind in KINDS:
        assert split_kind(with_kind(kind, "max_tokens must be an integer, got 'x'")) == (
            kind, "max_tokens must be an integer, got 'x'")
    assert split_kind(with_kind("internal", "[invalid_argument] inner")) == ("internal", "[invalid_argument] inner")
    for message in ["Request for unknown model: 'x' is not found", "[cancelled] Request was cancelled",
                    "[invalid_argument]no space", "invalid_argument: x", "", "["]:
        assert split_kind(message) == (None, message)


def test_the_parameter_is_not_taken_for_a_sampling_parameter():
    parsed = parse_request({"text_input": np.array([b"hi"], dtype=object)},
                           '{"error_kind_in_message": true, "max_tokens": 3}')
    assert parsed.params.max_tokens == 3
