"""The KV connection's handshake: what each side announces, the compatibility check, mutual
authentication by HMAC challenge-response, and the choice of transport.

    prefill -> HELLO      PeerInfo (with a fresh nonce)
    decode  -> CHALLENGE  a fresh nonce                       (only with a cluster credential)
    prefill -> AUTH       HMAC(credential, "client", decode nonce, prefill nonce, hash of HELLO)
    decode  -> HELLO_OK   PeerInfo with the chosen transport and its parameters, and a proof:
                          HMAC(credential, "server", prefill nonce, decode nonce)
            or REJECT     the reason

The credential itself never crosses the wire. A prefill worker that holds a credential
refuses a decode worker that cannot prove it holds it too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pdserve.kvtransfer import registry
from pdserve.kvtransfer.protocol import HEADER_SIZE, MAX_CONTROL_PAYLOAD, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.resharding import mapping_problem
from pdserve.kvtransfer.sockets import recv_header, recv_payload, send_frame

NONCE_BYTES = 32


class HandshakeError(Exception):
    """The peers cannot exchange K/V; the message says why."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    model_fingerprint: str
    dtype: str  # the KV cache's element type (its quantization when it has one)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    transports: tuple[str, ...] = ("tcp",)
    host_id: str = ""  # same value on the same machine (shared memory is possible)
    role: str = ""
    extra: dict = field(default_factory=dict)  # transport parameters (shm name, UCX address, ...)
    token_bytes: int = 0  # bytes of one token's K and V in one layer
    nonce: str = ""  # hex; fresh for each handshake
    proof: str = ""  # hex; the decode side's answer to the prefill side's nonce
    tp_size: int = 1  # tensor-parallel ranks the KV heads are split over (units are numbered layer * tp_size + rank)
    weights: str = ""  # how the weights are computed, "dtype/quantization": K/V of other weights differ

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

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
        for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "token_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise HandshakeError(f"KV layout mismatch: {name} is {theirs!r} on the peer but {mine!r} here")
        if self.weights != other.weights:
            raise HandshakeError(
                f"model mismatch: the weights are computed as {other.weights!r} on the peer but {self.weights!r} "
                "here (--dtype/--quantization must agree)"
            )
        prefill, decode = (self, other) if self.role == "prefill" else (other, self)
        problem = mapping_problem(self.num_kv_heads, prefill.tp_size, decode.tp_size, self.dtype)
        if problem is not None:
            raise HandshakeError(
                f"KV layouts cannot be mapped (prefill tensor parallel {prefill.tp_size}, decode "
                f"{decode.tp_size}, {self.num_kv_heads} KV heads): {problem}"
            )


_FIELD_TYPES = {
    "model_fingerprint": str,
    "dtype": str,
    "num_layers": int,
    "num_kv_heads": int,
    "head_dim": int,
    "block_size": int,
    "host_id": str,
    "role": str,
    "extra": dict,
    "token_bytes": int,
    "nonce": str,
    "proof": str,
    "tp_size": int,
    "weights": str,
}


def local_peer_info(
    fingerprint: str,
    layout,
    *,
    weights: str,
    role: str,
    transports: tuple[str, ...],
    extra: dict | None = None,
    tp_size: int = 1,
) -> PeerInfo:
    """``layout``: the engine's ``KVLayout`` (the whole model's); ``weights``: its ``weights_id``;
    ``tp_size``: how its heads are split."""
    return PeerInfo(
        model_fingerprint=fingerprint,
        dtype=layout.stored_as,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        transports=transports,
        host_id=host_id(),
        role=role,
        extra=extra or {},
        token_bytes=layout.token_bytes,
        tp_size=tp_size,
        weights=weights,
    )


def host_id() -> str:
    """An identity of the memory this process can share (boot id, hostname and which /dev/shm):
    equal for two workers exactly when same-host transports can work between them. Containers
    on the host's network share the first two, not a private /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm")
        shm_id = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        shm_id = ""
    return f"{socket.gethostname()}:{boot}:{shm_id}"


def choose(local: PeerInfo, remote: PeerInfo) -> str:
    """The best transport both offer (same-host ones only on one host); ``local`` decides."""
    same_host = local.host_id == remote.host_id and bool(local.host_id)
    for spec in registry.TRANSPORTS:
        if spec.name not in local.transports or spec.name not in remote.transports:
            continue
        if spec.same_host_only and not same_host:
            continue
        usable = getattr(spec.load(), "usable_with", None)
        if usable is None or usable(local.extra, remote.extra):
            return spec.name
    where = "on one host" if same_host else "across hosts"
    raise HandshakeError(
        f"no common KV transport {where}: this side offers {', '.join(local.transports)}, "
        f"the peer offers {', '.join(remote.transports)}"
    )


# -- the two ends ---------------------------------------------------------------------------------


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket) -> tuple[FrameHeader, bytes]:
    header = recv_header(sock, bytearray(HEADER_SIZE))
    return header, recv_payload(sock, header.payload_len, MAX_CONTROL_PAYLOAD)


def client_handshake(sock: socket.socket, local: PeerInfo, secret: bytes | None, address: str) -> PeerInfo:
    """Prefill side: announces ``local``, authenticates, returns the decode side's PeerInfo
    (its ``extra`` names the transport). Raises HandshakeError, or OSError/ProtocolError."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    hello = replace(local, nonce=nonce.hex()).to_json()
    send_frame(sock, FrameHeader(FrameKind.HELLO, payload_len=len(hello)), hello)
    header, payload = _read(sock)
    server_nonce = None
    if header.kind is FrameKind.CHALLENGE:
        if not secret:
            raise HandshakeError(f"decode worker {address} requires the cluster credential (--cluster-token)")
        server_nonce = payload
        mac = _mac(secret, b"client", server_nonce, nonce, hashlib.sha256(hello).digest())
        send_frame(sock, FrameHeader(FrameKind.AUTH, payload_len=len(mac)), mac)
        header, payload = _read(sock)
    if header.kind is FrameKind.REJECT:
        raise HandshakeError(f"decode worker {address} refused the KV handshake: {payload.decode(errors='replace')}")
    if header.kind is not FrameKind.HELLO_OK:
        raise HandshakeError(f"decode worker {address} answered the handshake with {header.kind.name}")
    remote = PeerInfo.from_json(payload)
    if secret:
        expected = _mac(secret, b"server", nonce, server_nonce or b"")
        if server_nonce is None or not hmac.compare_digest(_unhex(remote.proof), expected):
            raise HandshakeError(f"decode worker {address} could not prove the cluster credential")
    local.check_compatible(remote)
    return remote


def server_handshake(sock: socket.socket, local: PeerInfo, secret: bytes | None, reply_extra) -> tuple[PeerInfo, str]:
    """Decode side: checks the peer (credential first, then compatibility), picks the
    transport and answers HELLO_OK with ``reply_extra(transport)`` merged into our extra.
    Raises HandshakeError (the caller answers REJECT) or ProtocolError."""
    header, payload = _read(sock)
    if header.kind is not FrameKind.HELLO:
        raise ProtocolError(f"expected HELLO, got {header.kind.name}")
    remote = PeerInfo.from_json(payload)
    proof = ""
    if secret:
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        send_frame(sock, FrameHeader(FrameKind.CHALLENGE, payload_len=len(server_nonce)), server_nonce)
        auth, answer = _read(sock)
        expected = _mac(secret, b"client", server_nonce, _unhex(remote.nonce), hashlib.sha256(payload).digest())
        if auth.kind is not FrameKind.AUTH or not hmac.compare_digest(answer, expected):
            raise HandshakeError("unauthenticated peer: cluster credential missing or wrong")
        proof = _mac(secret, b"server", _unhex(remote.nonce), server_nonce).hex()
    local.check_compatible(remote)
    transport = choose(local, remote)
    reply = replace(
        local, extra={**local.extra, **reply_extra(transport), "transport": transport}, proof=proof
    ).to_json()
    send_frame(sock, FrameHeader(FrameKind.HELLO_OK, payload_len=len(reply)), reply)
    return remote, transport


def reject(sock: socket.socket, error: HandshakeError) -> None:
    reason = str(error).encode("utf-8", "backslashreplace")
    send_frame(sock, FrameHeader(FrameKind.REJECT, payload_len=len(reason)), reason)


def _unhex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""
