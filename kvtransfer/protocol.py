"""The KV-transfer wire format: fixed-size frame headers, then raw K/V bytes.

Every frame starts with a 52-byte little-endian header. A unit is tokens ``[start, end)`` of
``num_layers`` consecutive layers from ``layer`` of one transfer: layer after layer, each
token-major, each token ``token_bytes`` bytes exactly as both caches store them (so block
sizes may differ between the two sides); its frame carries the checksum of those bytes. A
DATA frame brings the bytes along (TCP); WRITTEN says they were written into the receiver's
memory already (shared memory, CUDA IPC); UCX_DATA says they follow as one UCX tagged message.

Handshake: HELLO (PeerInfo as JSON); with a cluster credential, CHALLENGE (a nonce) and AUTH
(an HMAC proving the credential); then HELLO_OK or REJECT.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"PDKV"
# 7: RENEW names where the writer will write (placement_digest); 6: DONE's checksum covers its
# tokens; 5: HELD; 4: units of several layers; 3: chunked XXH64 checksums; 2: HMAC
# challenge-response, token_bytes in the layout check, RENEW
VERSION = 7
HEADER = struct.Struct("<4sBBHQIIIqQQ")
HEADER_SIZE = HEADER.size
# Handshake and control payloads are small; K/V payloads are bounded by the grant they target.
MAX_CONTROL_PAYLOAD = 64 * 1024
# A unit of one layer carries at most that layer; one of several layers at most this (receivers
# refuse more before they allocate anything for it).
MAX_SPAN_BYTES = 16 << 20


class FrameKind(enum.IntEnum):
    HELLO = 1  # prefill -> decode: PeerInfo as JSON
    HELLO_OK = 2  # decode -> prefill: PeerInfo as JSON
    REJECT = 3  # decode -> prefill: reason (utf-8); the connection closes
    DATA = 4  # prefill -> decode: K/V of tokens [start, end) of layers [layer, layer + num_layers)
    # prefill -> decode: all layers sent; aux = first generated token; payload = the other
    # choices' (n > 1), int64 LE; checksum: of both (see done_frame)
    DONE = 5
    ACK = 6  # decode -> prefill: aux = AckStatus; payload = message
    WRITTEN = 7  # prefill -> decode: a one-sided write of a unit landed (shm, CUDA IPC)
    UCX_DATA = 8  # prefill -> decode: a unit's bytes follow over UCX; aux = the message's tag
    CHALLENGE = 9  # decode -> prefill: payload = a nonce to authenticate with
    AUTH = 10  # prefill -> decode: payload = HMAC of the nonces under the cluster credential
    # prefill -> decode: the transfer is still wanted (queued or computing): extend its lease;
    # checksum = placement_digest of the blocks the writer was told to fill
    RENEW = 11
    # decode -> prefill, answering RENEW on one-sided transports (shm, CUDA IPC): aux = a Holding
    HELD = 12


class Holding(enum.IntEnum):
    """HELD's answer: may a one-sided writer write into the transfer's blocks?"""

    GONE = 0  # the grant ended (its lease, or a cancel): write nothing
    HELD = 1  # the grant is live and its blocks are held
    MISPLACED = 2  # the writer names other blocks than the grant's (placement_digest): write nothing


class AckStatus(enum.IntEnum):
    OK = 0
    CHECKSUM_MISMATCH = 1
    INCOMPLETE = 2
    UNKNOWN_TRANSFER = 3
    PROTOCOL_ERROR = 4


class ProtocolError(Exception):
    """The peer broke the protocol; the connection cannot continue."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    transfer_id: int = 0
    layer: int = 0
    start: int = 0
    end: int = 0
    aux: int = 0
    payload_len: int = 0
    checksum: int = 0
    num_layers: int = 1  # the unit's layers (on the wire: one less, so 0 is one layer)

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            VERSION,
            int(self.kind),
            self.num_layers - 1,
            self.transfer_id,
            self.layer,
            self.start,
            self.end,
            self.aux,
            self.payload_len,
            self.checksum,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> "FrameHeader":
        magic, version, kind, more_layers, transfer_id, layer, start, end, aux, payload_len, checksum = HEADER.unpack(
            data
        )
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}")
        if version != VERSION:
            raise ProtocolError(f"unsupported protocol version {version}")
        try:
            kind = FrameKind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None
        if kind not in (FrameKind.DATA,) and payload_len > MAX_CONTROL_PAYLOAD:
            raise ProtocolError(f"{kind.name} frame of {payload_len} bytes exceeds {MAX_CONTROL_PAYLOAD}")
        return cls(FrameKind(kind), transfer_id, layer, start, end, aux, payload_len, checksum, more_layers + 1)


def done_frame(
    transfer_id: int, first_token_id: int, more_token_ids: tuple[int, ...] = ()
) -> tuple[FrameHeader, bytes]:
    """DONE and its payload. The decode side continues the answer from these tokens, so they
    are checked like the K/V: a flipped bit would otherwise go on from a wrong token."""
    payload = struct.pack(f"<{len(more_token_ids)}q", *more_token_ids)
    header = FrameHeader(
        FrameKind.DONE,
        transfer_id,
        aux=first_token_id,
        payload_len=len(payload),
        checksum=_tokens_checksum(first_token_id, payload),
    )
    return header, payload


def done_tokens(header: FrameHeader, payload: bytes) -> tuple[int, tuple[int, ...], bool]:
    """A DONE frame's first token, the other choices' and whether its checksum holds."""
    if len(payload) % 8:
        raise ProtocolError(f"DONE payload of {len(payload)} bytes is not a list of int64 token ids")
    more = struct.unpack(f"<{len(payload) // 8}q", payload)
    return header.aux, more, header.checksum == _tokens_checksum(header.aux, payload)


def _tokens_checksum(first_token_id: int, payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<q", first_token_id) + payload)


def placement_digest(block_ids: list[int], block_size: int, num_tokens: int, skip_tokens: int) -> int:
    """Where a transfer's tokens go (its blocks, and the leading tokens it leaves alone: shared
    prefix blocks that other requests read): a one-sided writer names it in RENEW and the decode
    side answers ``Holding.HELD`` only if it is its grant's, so blocks named by a stale or mangled
    target (another request's) are never written."""
    where = struct.pack(f"<qqq{len(block_ids)}q", block_size, num_tokens, skip_tokens, *block_ids)
    return xxhash.xxh64_intdigest(where)
