"""Property-based fuzzing (hypothesis) of the KV-transfer wire: the frame decoder and the
handshake (``PeerInfo.from_json``, ``check_compatible``, negotiation, credentials).

Properties: a header either decodes to what was packed or raises ``ProtocolError``; any peer
JSON either parses into exactly its fields or raises ``HandshakeError``, and so do the checks
that follow. The cases labelled "was a bug" are regression tests for what fuzzing found.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import (
    CREDENTIAL, DECODE_INFO, INT64_MAX, INT64_MIN, PEER_FIELDS, UINT32_MAX, UINT64_MAX, encodings, fuzz, peer_dict,
    peer_json_objects,
)
from pdserve.kvtransfer import negotiate
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.protocol import HEADER, HEADER_SIZE, MAGIC, MAX_CONTROL_PAYLOAD, VERSION, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.server import check_auth

# =========================================================================================
# The frame decoder
# =========================================================================================

KIND_VALUES = [int(k) for k in FrameKind]
_PAYLOAD_LEN_AT = struct.calcsize("<4sBBHQIIIq")


@st.composite
def header_blobs(draw) -> bytes:
    """52-byte blobs that often get past the magic and version checks."""
    magic = draw(st.just(MAGIC) | st.binary(min_size=4, max_size=4))
    version = draw(st.just(VERSION) | st.integers(0, 255))
    kind = draw(st.sampled_from(KIND_VALUES) | st.integers(0, 255))
    blob = bytearray(magic + bytes([version, kind]) + draw(st.binary(min_size=HEADER_SIZE - 6, max_size=HEADER_SIZE - 6)))
    plen = draw(st.none() | st.sampled_from([0, 1, MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1, 2**63, UINT64_MAX]))
    if plen is not None:
        blob[_PAYLOAD_LEN_AT:_PAYLOAD_LEN_AT + 8] = plen.to_bytes(8, "little")
    return bytes(blob)


@fuzz(500)
@given(blob=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE) | header_blobs())
def test_frame_decoder_returns_a_header_or_protocol_error(blob):
    magic, version, kind, flags, tid, layer, start, end, aux, plen, csum = HEADER.unpack(blob)
    acceptable = (magic == MAGIC and version == VERSION and kind in KIND_VALUES
                  and (kind == FrameKind.DATA or plen <= MAX_CONTROL_PAYLOAD))
    try:
        h = FrameHeader.unpack(blob)
    except ProtocolError:
        assert not acceptable
        return
    assert acceptable
    assert isinstance(h.kind, FrameKind) and h.pack() == blob
    assert (h.kind, h.flags, h.transfer_id, h.layer, h.start, h.end, h.aux, h.payload_len, h.checksum) == (
        kind, flags, tid, layer, start, end, aux, plen, csum)


@st.composite
def valid_headers(draw) -> FrameHeader:
    kind = draw(st.sampled_from(FrameKind))
    u32 = st.integers(0, UINT32_MAX)
    return FrameHeader(
        kind, draw(st.integers(0, UINT64_MAX)), draw(u32), draw(u32), draw(u32), draw(st.integers(INT64_MIN, INT64_MAX)),
        draw(st.integers(0, UINT64_MAX if kind is FrameKind.DATA else MAX_CONTROL_PAYLOAD)), draw(st.integers(0, UINT64_MAX)),
        draw(st.integers(0, 2**16 - 1)),
    )


@fuzz(200)
@given(h=valid_headers())
def test_frame_header_round_trip(h):
    blob = h.pack()
    assert len(blob) == HEADER_SIZE and blob[:4] == MAGIC
    assert FrameHeader.unpack(blob) == h
    assert FrameHeader.unpack(memoryview(bytearray(blob))) == h


# =========================================================================================
# The handshake: PeerInfo.from_json, check_compatible, negotiation, credentials
# =========================================================================================

@fuzz(200)
@given(obj=peer_json_objects(), encoding=encodings())
def test_peer_info_from_any_json_object(obj, encoding):
    data = json.dumps(obj).encode(encoding)
    try:
        info = PeerInfo.from_json(data)
    except HandshakeError:
        return
    assert set(obj) <= set(PEER_FIELDS)
    for name, value in obj.items():
        got = getattr(info, name)
        assert got == (tuple(value) if name == "transports" else value)


@fuzz(300)
@given(data=st.binary(max_size=200) | st.builds(lambda b: b"{" + b, st.binary(max_size=100)))
def test_peer_info_from_random_bytes(data):
    try:
        PeerInfo.from_json(data)
    except HandshakeError:
        pass


@pytest.mark.parametrize("data", [b"0", b"null", b'"peer"', b"[]", b"true", b"[" * 100_000, b'{"a":' * 50_000],
                         ids=["number", "null", "string", "array", "true", "deep-array", "deep-object"])
def test_peer_info_from_json_non_object_is_a_handshake_error(data):
    with pytest.raises(HandshakeError):
        PeerInfo.from_json(data)


@fuzz(200)
@given(obj=peer_json_objects())
def test_check_compatible_negotiation_and_auth_raise_only_handshake_error(obj):
    try:
        remote = PeerInfo.from_json(json.dumps({**peer_dict(), **obj}).encode("utf-8", "surrogatepass"))
    except HandshakeError:
        return
    for local, other in ((DECODE_INFO, remote), (remote, DECODE_INFO)):
        try:
            local.check_compatible(other)
        except HandshakeError as e:
            assert str(e).startswith("KV layout mismatch: ")
        else:
            for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim"):
                assert getattr(local, name) == getattr(other, name)
    try:
        check_auth(DECODE_INFO, remote)
    except HandshakeError:
        assert remote.auth_token != CREDENTIAL
    else:
        assert remote.auth_token == CREDENTIAL
    try:
        assert negotiate.choose(DECODE_INFO, remote) == "tcp"
    except HandshakeError as e:
        assert "tcp" not in remote.transports and str(e).startswith("no common KV transport")


MALFORMED_HANDSHAKES = [
    pytest.param(peer_dict(transports=[1]), "was a bug: kvtransfer/negotiate.py:73-75 choose(): ', '.join(remote.transports) raises "
                 "TypeError when the peer lists a non-string transport", id="transports-int"),
    pytest.param(peer_dict(transports=[None, "shm"]), "same as transports-int", id="transports-null"),
    pytest.param(peer_dict(auth_token=5), "was a bug: kvtransfer/server.py:38 check_auth(): peer.auth_token.encode() raises "
                 "AttributeError for a non-string credential", id="auth-token-int"),
    pytest.param(peer_dict(auth_token=None), "same as auth-token-int", id="auth-token-null"),
    pytest.param(peer_dict(auth_token="\ud800"), "was a bug: kvtransfer/server.py:38 check_auth(): a JSON credential holding a lone "
                 "surrogate ('\\ud800') raises UnicodeEncodeError in .encode()", id="auth-token-surrogate"),
]


@pytest.mark.parametrize("obj, why", MALFORMED_HANDSHAKES)
def test_malformed_handshakes_raise_only_handshake_error(obj, why):
    with pytest.raises(HandshakeError):
        remote = PeerInfo.from_json(json.dumps(obj).encode())
        check_auth(DECODE_INFO, remote)
        DECODE_INFO.check_compatible(remote)
        negotiate.choose(DECODE_INFO, replace(remote, host_id="elsewhere", transports=remote.transports or ("x",)))
        raise AssertionError("accepted")
