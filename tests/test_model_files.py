"""Where model weights come from: the GGUF conversion cache and the errors for a bad model path."""

from __future__ import annotations

import os

import pytest

from tritonllm.models import model_files

pytestmark = pytest.mark.unit


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _gguf(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_the_same_gguf_in_two_installs_shares_one_converted_folder(tmp_path, cache):
    a = _gguf(tmp_path / "venv-a" / "m.gguf", b"GGUF weights one")
    b = _gguf(tmp_path / "venv-b" / "m.gguf", b"GGUF weights one")
    other = _gguf(tmp_path / "venv-c" / "m.gguf", b"GGUF weights two")
    folder = model_files._converted_dir_for(a)
    assert folder.parent == cache and folder.name.startswith("m-")
    assert model_files._converted_dir_for(b) == folder
    assert model_files._converted_dir_for(other) != folder


def test_the_content_key_is_remembered_per_path_and_follows_a_changed_file(tmp_path, cache):
    a = _gguf(tmp_path / "m.gguf", b"GGUF weights one")
    first = model_files._converted_dir_for(a)
    assert len(list((cache / "index").iterdir())) == 1
    assert model_files._converted_dir_for(a) == first  # from the index, no rehash
    a.write_bytes(b"GGUF weights two, longer")  # new size and mtime: a new index entry
    os.utime(a, ns=(1, 1))
    assert model_files._converted_dir_for(a) != first
    assert len(list((cache / "index").iterdir())) == 2


def test_a_bad_model_path_gets_a_clear_error(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="neither a folder with config.json nor a .gguf"):
        model_files.resolve_model_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        model_files.resolve_model_dir(str(tmp_path / "empty"))
