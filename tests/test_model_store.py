"""The once-per-machine conversion of a GGUF model into the cache: what a killed, failed or
shared conversion leaves behind (a fake converter: the real one takes minutes and 700 MB)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pdserve.engine import model_store


def fake_convert(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    weights = out / "model.safetensors"
    weights.write_bytes(b"weights")
    weights.chmod(0o600)  # as safetensors writes its files


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_a_conversion_killed_half_way_is_cleared_by_the_next(tmp_path, gguf, monkeypatch):
    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    cache = tmp_path / "cache"
    target_name = f"tiny-{'a' * 12}"
    left = cache / "models" / f".convert-{target_name}-x1y2"  # what a SIGKILLed conversion leaves
    (left / "model").mkdir(parents=True)
    (left / "model" / "model.safetensors").write_bytes(b"half")
    folder = model_store._converted(gguf, "a" * 64, cache)
    assert folder.name == target_name and (folder / "config.json").is_file()
    assert not left.exists()
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [target_name]


def test_converted_files_are_as_readable_as_the_umask_says(tmp_path, gguf, monkeypatch):
    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    umask = os.umask(0o022)
    try:
        folder = model_store._converted(gguf, "b" * 64, tmp_path / "cache")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644  # a group can share the cache


def test_a_full_disk_during_conversion_names_the_folder_and_what_to_do(tmp_path, gguf, monkeypatch):
    from safetensors import SafetensorError  # safetensors' own error type is no OSError

    def full(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(model_store, "convert_gguf", full)
    cache = tmp_path / "cache"
    with pytest.raises(
        OSError, match=r"cannot convert the model into .*cache/models: .*No space left.*PDSERVE_CACHE_DIR"
    ):
        model_store._converted(gguf, "c" * 64, cache)
    assert not [p for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]  # nothing half-written


def test_no_home_folder_asks_for_the_cache_variable(monkeypatch):
    monkeypatch.delenv(model_store.CACHE_ENV, raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "expanduser", lambda self: (_ for _ in ()).throw(RuntimeError("no home")))
    with pytest.raises(ValueError, match="set PDSERVE_CACHE_DIR"):
        model_store.cache_dir()
