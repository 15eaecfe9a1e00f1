"""What the CPU backend's load timings chose is kept per CPU and taken by the next load
(backend/devices/cpu/timed_choices.py): the same choices, no timing, only the chosen screen built."""

from __future__ import annotations

import json
import logging

import pytest

from tritonllm.devices.cpu import timed_choices

pytestmark = pytest.mark.unit


@pytest.fixture
def choices_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / timed_choices.FILE_NAME
    monkeypatch.setattr(timed_choices, "_path", lambda: path)
    monkeypatch.delenv(timed_choices.RETIME_ENV, raising=False)
    return path


def _timer(value):
    calls = []

    def time_it():
        calls.append(1)
        return value
    return time_it, calls


def test_a_choice_is_timed_once_per_details_and_then_remembered(choices_file):
    time_it, calls = _timer(32)
    assert timed_choices.remembered("rows", [[576, 576], 64], time_it) == (32, False)
    assert timed_choices.remembered("rows", [[576, 576], 64], time_it) == (32, True)
    assert len(calls) == 1
    other, other_calls = _timer(8)
    assert timed_choices.remembered("rows", [[49152, 576], 64], other) == (8, False)  # other shapes: timed
    assert timed_choices.remembered("rows", [[576, 576], 64], other) == (32, True)
    assert len(other_calls) == 1
    assert len(json.loads(choices_file.read_text())) == 2


def test_retime_times_again_and_keeps_the_new_choice(choices_file, monkeypatch):
    timed_choices.keep("screen", ["head"], ["int8", 8])
    assert timed_choices.recall("screen", ["head"]) == (True, ["int8", 8])
    monkeypatch.setenv(timed_choices.RETIME_ENV, "1")
    assert timed_choices.recall("screen", ["head"]) == (False, None)
    time_it, calls = _timer(["bfloat16", 16])
    assert timed_choices.remembered("screen", ["head"], time_it) == (["bfloat16", 16], False)
    monkeypatch.delenv(timed_choices.RETIME_ENV)
    assert timed_choices.recall("screen", ["head"]) == (True, ["bfloat16", 16])


def test_another_thread_count_or_machine_times_again(choices_file, monkeypatch):
    import torch

    timed_choices.keep("rows", [1], 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert timed_choices.recall("rows", [1]) == (False, None)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(timed_choices, "_MACHINE", ["another CPU"])
    assert timed_choices.recall("rows", [1]) == (False, None)


def test_a_broken_or_unwritable_file_costs_only_the_timing(choices_file, caplog):
    choices_file.parent.mkdir(parents=True)
    choices_file.write_text("{not json")
    time_it, calls = _timer(4)
    assert timed_choices.remembered("rows", [1], time_it) == (4, False)
    assert timed_choices.remembered("rows", [1], time_it) == (4, True)  # the file was written whole again
    choices_file.unlink()
    choices_file.parent.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger=timed_choices.__name__):
            assert timed_choices.remembered("rows", [2], time_it) == (4, False)
    finally:
        choices_file.parent.chmod(0o700)
    if caplog.records:  # root ignores the directory's mode: then the write succeeded
        assert "could not keep the load's timed choices" in caplog.text
    assert len(calls) == 2


@pytest.mark.engine
def test_a_second_load_takes_the_first_loads_choices(model_dir, choices_file, caplog):
    from tritonllm.core.config import EngineConfig
    from tritonllm.devices.cpu import kernels
    from tritonllm.engine.engine import Engine

    if not kernels.load():
        pytest.skip("the CPU kernels did not build here: nothing is timed at load")
    params = dict(model=str(model_dir), num_kv_blocks=128, max_model_len=512, warmup=False)
    prompts, sampling = ["The capital of France is", "1, 2, 3, 4,"], {"max_tokens": 12}
    first = Engine(EngineConfig.from_parameters(**params))
    first_ids = [o.token_ids for o in first.generate(prompts, sampling)]
    kept = json.loads(choices_file.read_text())
    assert {json.loads(key)[1] for key in kept} >= {"exact blocks max rows"}
    with caplog.at_level(logging.INFO, logger="tritonllm.devices.cpu"):
        second = Engine(EngineConfig.from_parameters(**params))
    assert "timed on this CPU)" not in caplog.text, caplog.text  # nothing timed again
    assert "as timed on this CPU before" in caplog.text
    assert json.loads(choices_file.read_text()) == kept
    head1, head2 = first.runner.shard.backend.head, second.runner.shard.backend.head
    assert (head2.screen_kind(), head2.screen_min_rows) == (head1.screen_kind(), head1.screen_min_rows)
    assert head2.describe() == head1.describe()
    linears = [(a.packed, b.packed) for a, b in zip(first.runner.shard.model.modules(), second.runner.shard.model.modules())
               if getattr(a, "packed", None) is not None]
    assert linears and all(a.blocks_max_rows == b.blocks_max_rows for a, b in linears)
    assert [o.token_ids for o in second.generate(prompts, sampling)] == first_ids
