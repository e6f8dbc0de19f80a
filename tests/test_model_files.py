"""Malformed model files (a config with a missing or mistyped field, a cut weights file, a cut
GGUF) give one ValueError naming the file and what is wrong, and the CLI one line, never a
traceback from deep inside a reader."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.gguf_reader import read_gguf
from pdserve.engine.loader import load_state_dict
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_store import DEFAULT_MODEL


def copy_of(model_dir: Path, to: Path, **config_changes) -> Path:
    """The default model's folder with its weights linked and ``config.json`` edited
    (a value of None removes the field)."""
    to.mkdir()
    for item in model_dir.iterdir():
        if item.is_file():
            (to / item.name).symlink_to(item)
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in config_changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (to / "config.json").unlink()
    (to / "config.json").write_text(json.dumps(config))
    return to


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_attention_heads": "9"}, "'num_attention_heads' must be a positive integer, got '9'"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
        ({"architectures": None, "model_type": "gpt2"}, "unsupported architecture \"model_type 'gpt2'\""),
        ({"architectures": [["x"]]}, "'architectures' must be a list of names"),
        ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a positive number, got '1e-5'"),
        ({"rope_theta": "ten thousand"}, "'rope_theta' must be a positive number"),
        ({"max_position_embeddings": "8192"}, "'max_position_embeddings' must be a positive integer"),
    ],
)
def test_a_config_with_a_missing_or_mistyped_field_names_it(model_dir, tmp_path, changes, message):
    folder = copy_of(model_dir, tmp_path / "model", **changes)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_folder(folder)
    assert str(err.value).startswith(str(folder)) and message in str(err.value)


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", ""])
def test_a_config_that_is_no_json_object_names_the_file(model_dir, tmp_path, text):
    folder = copy_of(model_dir, tmp_path / "model")
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json: (not a readable JSON file|expected a JSON object)"):
        ModelConfig.from_folder(folder)


def test_cut_or_corrupt_weights_name_the_file(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path / "model")
    weights = folder / "model.safetensors"
    whole = weights.resolve().read_bytes()
    weights.unlink()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file \(truncated"):
        load_state_dict(folder, torch.float32)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')  # no weight_map
    with pytest.raises(ValueError, match=r"index\.json: not a safetensors index"):
        load_state_dict(folder, torch.float32)


@pytest.mark.parametrize("keep", [0, 1000, 0.5])
def test_a_cut_gguf_names_the_file(tmp_path, keep):
    whole = DEFAULT_MODEL.locate().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError) as err:
        read_gguf(cut)
    assert str(err.value).startswith(f"{cut}: not a readable GGUF file (truncated or corrupt?)")


def test_the_cli_reports_a_cut_weights_file_in_one_line(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path / "model")
    weights = folder / "model.safetensors"
    data = weights.resolve().read_bytes()[:4096]
    weights.unlink()
    weights.write_bytes(data)
    shutil.rmtree(folder / "gguf-codes", ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--model", str(folder), "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"{weights}: not a readable safetensors file" in out.stderr


def test_a_gguf_type_pdserve_cannot_read_is_named_as_such_not_as_corrupt(monkeypatch):
    import gguf.quants

    def cannot(data, kind):
        raise NotImplementedError(kind)

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)
    with pytest.raises(ValueError, match=r"tensor \S+ is stored as \w+, which pdserve cannot read") as err:
        read_gguf(DEFAULT_MODEL.locate())
    assert "truncated" not in str(err.value)


@pytest.mark.parametrize("eos", ["<|endoftext|>", {"content": "<|endoftext|>", "special": True}])
def test_the_tokenizers_eos_ends_generation_too(model_dir, tmp_path, eos):
    """As vLLM: a fine-tune that sets its turn end as the tokenizer's EOS alone still stops there."""
    folder = copy_of(model_dir, tmp_path / "model")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": eos}))
    endoftext = next(
        t["id"]
        for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
        if t["content"] == "<|endoftext|>"
    )
    assert ModelConfig.from_folder(folder).eos_token_ids == (2, endoftext)  # the config's, then the tokenizer's
    assert ModelConfig.from_folder(model_dir).eos_token_ids == (2,)  # the same token: once


def test_a_models_generation_config_sets_the_sampling_defaults(model_dir, tmp_path, caplog):
    """As vLLM: temperature, top_p and top_k a request leaves unset come from the model's
    generation_config.json; what pdserve cannot apply is named in the log."""
    from pdserve.router.request import CompletionRequest, SamplingRequest
    from pdserve.router.tokenizer import RouterTokenizer
    from pdserve.router.validation import validate

    folder = copy_of(model_dir, tmp_path / "model")
    (folder / "generation_config.json").unlink()
    shipped = {"eos_token_id": 2, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (folder / "generation_config.json").write_text(json.dumps(shipped))
    with caplog.at_level("INFO", logger="pdserve.router.tokenizer"):
        tokenizer = RouterTokenizer(folder)
    assert "repetition_penalty" in caplog.text and "does not apply" in caplog.text
    unset = validate(CompletionRequest(prompt="Hi", sampling=SamplingRequest(max_tokens=2)), tokenizer)
    assert (unset.engine_sampling.temperature, unset.engine_sampling.top_p, unset.engine_sampling.top_k) == (
        0.7,
        0.8,
        20,
    )
    given = validate(CompletionRequest(prompt="Hi", sampling=SamplingRequest(max_tokens=2, temperature=0)), tokenizer)
    assert given.engine_sampling.temperature == 0  # the request's own value wins

    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"generation_config\.json: .*top_p"):
        RouterTokenizer(folder)


def test_the_router_holds_requests_to_max_model_len(model_dir):
    from pdserve.router.request import CompletionRequest
    from pdserve.router.tokenizer import RouterTokenizer
    from pdserve.router.validation import validate

    tokenizer = RouterTokenizer(model_dir, max_model_len=64)
    assert tokenizer.max_model_len == 64
    unset = validate(CompletionRequest(prompt_token_ids=(1,) * 60), tokenizer)
    assert unset.engine_sampling.max_tokens == 4  # the default fits the context it sets
    with pytest.raises(ValueError, match=r"max_model_len: 9000 must be in \[2, 8192\]"):
        RouterTokenizer(model_dir, max_model_len=9000)
