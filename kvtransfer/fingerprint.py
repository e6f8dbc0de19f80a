"""A model's identity for the KV handshake: its config and the content of its weights.

Two workers may exchange K/V only if they run the same weights; two fine-tunes of one base
model share every name and shape, so the fingerprint hashes the tensors' bytes. Each tensor
gets its own xxh3-128 digest (independent of how the checkpoint is sharded), read straight
from the safetensors files; the digests of a file are kept next to the converted-model cache,
keyed by the file's path, size and modification time, so they are computed once per file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
from pathlib import Path

import xxhash

from pdserve.engine.model_store import cache_dir as model_cache_dir

log = logging.getLogger(__name__)


def model_fingerprint(model_dir: str | Path, cache_dir: str | Path | None = None) -> str:
    folder = Path(model_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights to fingerprint")
    tensors: dict[str, str] = {}
    for path in files:
        tensors.update(_file_digests(path, model_cache_dir(cache_dir)))
    for name in sorted(tensors):
        digest.update(f"{name}={tensors[name]};".encode())
    return digest.hexdigest()[:16]


def tensor_digests(path: Path) -> dict[str, str]:
    """``name -> dtype/shape/xxh3-128 of the bytes`` for every tensor of a safetensors file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        base = 8 + header_len
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            view = memoryview(data)[base + start : base + end]
            try:
                out[name] = f"{info['dtype']}{info['shape']}:{xxhash.xxh3_128_hexdigest(view)}"
            finally:
                view.release()
        return out


def _file_digests(path: Path, cache_dir: Path) -> dict[str, str]:
    stat = path.stat()
    key = xxhash.xxh3_64_hexdigest(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    cached = cache_dir / "fingerprints" / f"{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    digests = tensor_digests(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(digests))
        tmp.replace(cached)
    except OSError as e:  # a read-only home is fine: the digests are just recomputed next time
        log.debug("could not cache weight digests of %s: %s", path, e)
    return digests
