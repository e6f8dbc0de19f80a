"""What each side of a KV transfer announces in the handshake, and the compatibility check."""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pdserve.engine.kv_cache import KVLayout


class HandshakeError(Exception):
    """The peers cannot exchange K/V; the message says why."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    model_fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    transports: tuple[str, ...] = ("tcp",)
    host_id: str = ""  # same value on the same machine (shared memory is possible)
    role: str = ""
    auth_token: str = ""  # cluster credential; never logged
    extra: dict = field(default_factory=dict)  # transport parameters (shm name, UCX address, ...)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def public(self) -> "PeerInfo":
        """This info without the credential (what a server sends back)."""
        return replace(self, auth_token="")

    @classmethod
    def from_json(cls, data: bytes) -> "PeerInfo":
        """Parses a peer's announcement, checking every field's type (it comes off the network)."""
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise HandshakeError(f"malformed handshake: {type(e).__name__}") from None
        if not isinstance(raw, dict):
            raise HandshakeError("malformed handshake: expected a JSON object")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise HandshakeError(f"malformed handshake: unknown fields {sorted(map(ascii, unknown))}")
        transports = raw.get("transports", ())
        if not isinstance(transports, list) or not all(isinstance(t, str) for t in transports):
            raise HandshakeError("malformed handshake: transports must be a list of strings")
        raw["transports"] = tuple(transports)
        for name, kind in _FIELD_TYPES.items():
            if name in raw and not (isinstance(raw[name], kind) and not isinstance(raw[name], bool)):
                raise HandshakeError(f"malformed handshake: {name} must be {kind.__name__}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise HandshakeError(f"malformed handshake: {e}") from None

    def check_compatible(self, other: "PeerInfo") -> None:
        """Raises HandshakeError naming the first field that differs. Block sizes may differ."""
        for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise HandshakeError(f"KV layout mismatch: {name} is {theirs!r} on the peer but {mine!r} here")


_FIELD_TYPES = {
    "model_fingerprint": str, "dtype": str, "num_layers": int, "num_kv_heads": int, "head_dim": int,
    "block_size": int, "host_id": str, "role": str, "auth_token": str, "extra": dict,
}


def local_peer_info(model_dir: str | Path, layout: KVLayout, *, role: str, transports: tuple[str, ...],
                    auth_token: str = "", extra: dict | None = None) -> PeerInfo:
    return PeerInfo(
        model_fingerprint=model_fingerprint(model_dir), dtype=str(layout.dtype).removeprefix("torch."),
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size=layout.block_size, transports=transports, host_id=host_id(), role=role,
        auth_token=auth_token, extra=extra or {},
    )


def model_fingerprint(model_dir: str | Path) -> str:
    """Identifies a model by its config and the names and sizes of its weight files."""
    folder = Path(model_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def host_id() -> str:
    """A per-machine identity (boot id + hostname) for deciding whether shared memory can work."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"
