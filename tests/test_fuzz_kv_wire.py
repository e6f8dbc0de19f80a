"""Property-based fuzzing (hypothesis) of the KV-transfer wire: the frame decoder and the
handshake (``PeerInfo.from_json``, ``check_compatible``, negotiation, and the HMAC
challenge-response that proves the cluster credential).

Properties: a header either decodes to what was packed or raises ``ProtocolError``; any peer
JSON either parses into exactly its fields or raises ``HandshakeError``, and so do the checks
that follow; a handshake between the real client and server ends in HandshakeError unless
both hold the same credential (or neither holds one) and their layouts match, and the
credential never crosses the wire. The cases labelled "was a bug" are regression tests for
what fuzzing found.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import replace

import pytest
from fuzzing import (
    CREDENTIAL,
    DECODE_INFO,
    INT64_MAX,
    INT64_MIN,
    NONCE,
    PEER_FIELDS,
    UINT32_MAX,
    UINT64_MAX,
    WRONG_CREDENTIAL,
    auth_answer,
    encodings,
    fuzz,
    peer_dict,
    peer_json_objects,
    server_proof,
)
from hypothesis import event, given
from hypothesis import strategies as st

from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, choose, client_handshake, reject, server_handshake
from pdserve.kvtransfer.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_PAYLOAD,
    VERSION,
    FrameHeader,
    FrameKind,
    ProtocolError,
)
from pdserve.kvtransfer.sockets import recv_header, recv_payload, send_frame

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
    blob = bytearray(
        magic + bytes([version, kind]) + draw(st.binary(min_size=HEADER_SIZE - 6, max_size=HEADER_SIZE - 6))
    )
    plen = draw(st.none() | st.sampled_from([0, 1, MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1, 2**63, UINT64_MAX]))
    if plen is not None:
        blob[_PAYLOAD_LEN_AT : _PAYLOAD_LEN_AT + 8] = plen.to_bytes(8, "little")
    return bytes(blob)


@fuzz(500)
@given(blob=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE) | header_blobs())
def test_frame_decoder_returns_a_header_or_protocol_error(blob):
    magic, version, kind, more_layers, tid, layer, start, end, aux, plen, csum = HEADER.unpack(blob)
    acceptable = (
        magic == MAGIC
        and version == VERSION
        and kind in KIND_VALUES
        and (kind == FrameKind.DATA or plen <= MAX_CONTROL_PAYLOAD)
    )
    try:
        h = FrameHeader.unpack(blob)
    except ProtocolError:
        assert not acceptable
        return
    assert acceptable
    assert isinstance(h.kind, FrameKind) and h.pack() == blob
    assert (h.kind, h.num_layers, h.transfer_id, h.layer, h.start, h.end, h.aux, h.payload_len, h.checksum) == (
        kind,
        more_layers + 1,
        tid,
        layer,
        start,
        end,
        aux,
        plen,
        csum,
    )


@st.composite
def valid_headers(draw) -> FrameHeader:
    kind = draw(st.sampled_from(FrameKind))
    u32 = st.integers(0, UINT32_MAX)
    return FrameHeader(
        kind,
        draw(st.integers(0, UINT64_MAX)),
        draw(u32),
        draw(u32),
        draw(u32),
        draw(st.integers(INT64_MIN, INT64_MAX)),
        draw(st.integers(0, UINT64_MAX if kind is FrameKind.DATA else MAX_CONTROL_PAYLOAD)),
        draw(st.integers(0, UINT64_MAX)),
        draw(st.integers(1, 2**16)),  # num_layers: one to 65536 (the wire holds one less)
    )


@fuzz(200)
@given(h=valid_headers())
def test_frame_header_round_trip(h):
    blob = h.pack()
    assert len(blob) == HEADER_SIZE and blob[:4] == MAGIC
    assert FrameHeader.unpack(blob) == h
    assert FrameHeader.unpack(memoryview(bytearray(blob))) == h


# =========================================================================================
# The handshake: PeerInfo.from_json, check_compatible, negotiation, the HMAC challenge-response
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


@pytest.mark.parametrize(
    "data",
    [b"0", b"null", b'"peer"', b"[]", b"true", b"[" * 100_000, b'{"a":' * 50_000],
    ids=["number", "null", "string", "array", "true", "deep-array", "deep-object"],
)
def test_peer_info_from_json_non_object_is_a_handshake_error(data):
    with pytest.raises(HandshakeError):
        PeerInfo.from_json(data)


class Recorded:
    """A socket that keeps every byte it sends and receives (what crossed the wire)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wire = bytearray()

    def sendmsg(self, buffers) -> int:
        sent = self.sock.sendmsg(buffers)
        self.wire += b"".join(bytes(b) for b in buffers)[:sent]
        return sent

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        got = self.sock.recv_into(buffer, nbytes, flags)
        self.wire += bytes(memoryview(buffer).cast("B")[:got])
        return got


def handshake_pair(local: PeerInfo, client_secret: bytes | None, server_secret: bytes | None):
    """The real prefill end (announcing ``local``) against the real decode end (``DECODE_INFO``) on
    a socket pair, the decode end answering a refusal with REJECT as the KV receiver does.
    Returns (the client's result or exception, the server's, every byte that crossed)."""
    client_sock, server_sock = socket.socketpair()
    for sock in (client_sock, server_sock):
        sock.settimeout(5.0)
    recorded = Recorded(server_sock)
    result: dict[str, object] = {}

    def serve() -> None:
        try:
            result["server"] = server_handshake(recorded, DECODE_INFO, server_secret, lambda transport: {})
        except HandshakeError as e:
            result["server"] = e
            reject(recorded, e)
        except (OSError, ProtocolError) as e:  # the client gave up (it closed the connection)
            result["server"] = e

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        try:
            result["client"] = client_handshake(client_sock, local, client_secret, "fuzz-decode")
        except (HandshakeError, OSError, ProtocolError) as e:
            result["client"] = e
    finally:
        client_sock.close()
        thread.join(10)
        server_sock.close()
    assert not thread.is_alive(), "the decode end of the handshake hangs"
    return result["client"], result["server"], bytes(recorded.wire)


SECRETS = st.sampled_from([CREDENTIAL, WRONG_CREDENTIAL, None])


@fuzz(200)
@given(obj=peer_json_objects(), client_secret=SECRETS, server_secret=SECRETS)
def test_check_compatible_negotiation_and_auth_raise_only_handshake_error(obj, client_secret, server_secret):
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
            for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "token_bytes"):
                assert getattr(local, name) == getattr(other, name)
    try:
        assert choose(DECODE_INFO, remote) == "tcp"
    except HandshakeError as e:
        assert "tcp" not in remote.transports and str(e).startswith("no common KV transport")

    # The whole handshake, the real ends on both sides: each fails with HandshakeError only
    # (the decode end also sees the connection close when the prefill end gives up first), it
    # succeeds exactly when both hold the same credential (or neither does) and the layouts
    # and transports match, and the credential never crosses the wire.
    client, server, wire = handshake_pair(remote, client_secret, server_secret)
    event(f"client={type(client).__name__} server={type(server).__name__}")
    assert isinstance(client, (PeerInfo, HandshakeError)), repr(client)
    assert isinstance(server, (tuple, HandshakeError, ConnectionError)), repr(server)
    compatible = "tcp" in remote.transports and all(
        getattr(remote, n) == getattr(DECODE_INFO, n)
        for n in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "token_bytes")
    )
    assert isinstance(client, PeerInfo) == (client_secret == server_secret and compatible), (client, server)
    if server_secret is not None and client_secret != server_secret and client_secret is not None:
        assert isinstance(server, HandshakeError) and "unauthenticated" in str(server)
    if isinstance(client, PeerInfo):
        assert isinstance(server, tuple) and server[1] == "tcp" and client.extra["transport"] == "tcp"
    for secret in (CREDENTIAL, WRONG_CREDENTIAL):
        assert secret not in wire and secret.hex().encode() not in wire


MALFORMED_HANDSHAKES = [
    pytest.param(
        peer_dict(transports=[1]),
        "was a bug: kvtransfer/negotiate.py:73-75 choose(): ', '.join(remote.transports) raises "
        "TypeError when the peer lists a non-string transport",
        id="transports-int",
    ),
    pytest.param(peer_dict(transports=[None, "shm"]), "same as transports-int", id="transports-null"),
    pytest.param(
        peer_dict(nonce=5),
        "the credential's old cases (protocol 1 sent it in HELLO as auth_token, and "
        "check_auth() crashed on a non-string one); now the nonce the HMAC is computed over",
        id="nonce-int",
    ),
    pytest.param(peer_dict(nonce=None), "same as nonce-int", id="nonce-null"),
    pytest.param(peer_dict(proof=5), "same as nonce-int, for the proof a decode worker answers with", id="proof-int"),
    pytest.param(
        peer_dict(auth_token=CREDENTIAL.decode()),
        "protocol 1's credential in HELLO: refused, not read",
        id="credential-in-hello",
    ),
]


@pytest.mark.parametrize("obj, why", MALFORMED_HANDSHAKES)
def test_malformed_handshakes_raise_only_handshake_error(obj, why):
    with pytest.raises(HandshakeError):
        remote = PeerInfo.from_json(json.dumps(obj).encode())
        DECODE_INFO.check_compatible(remote)
        choose(DECODE_INFO, replace(remote, host_id="elsewhere", transports=remote.transports or ("x",)))
        raise AssertionError("accepted")


def scripted_prefill(hello: bytes, answer) -> tuple[object, bytes]:
    """Runs the real decode end of the handshake against a scripted prefill end that sends
    ``hello`` and answers a CHALLENGE with ``answer(challenge)`` (None: no AUTH at all, the
    connection closes). Returns (the decode end's result or exception, the prefill end's replies)."""
    client_sock, server_sock = socket.socketpair()
    for sock in (client_sock, server_sock):
        sock.settimeout(5.0)
    result: dict[str, object] = {}

    def serve() -> None:
        try:
            result["server"] = server_handshake(server_sock, DECODE_INFO, CREDENTIAL, lambda transport: {})
        except HandshakeError as e:
            result["server"] = e
            reject(server_sock, e)
        except (OSError, ProtocolError) as e:
            result["server"] = e

    thread = threading.Thread(target=serve)
    thread.start()
    replies = bytearray()
    try:
        send_frame(client_sock, FrameHeader(FrameKind.HELLO, payload_len=len(hello)), hello)
        header = recv_header(client_sock, bytearray(HEADER_SIZE))
        payload = recv_payload(client_sock, header.payload_len)
        replies += header.pack() + payload
        if header.kind is FrameKind.CHALLENGE:
            mac = answer(payload)
            if mac is not None:
                send_frame(client_sock, FrameHeader(FrameKind.AUTH, payload_len=len(mac)), mac)
                header = recv_header(client_sock, bytearray(HEADER_SIZE))
                replies += header.pack() + recv_payload(client_sock, header.payload_len)
    finally:
        client_sock.close()
        thread.join(10)
        server_sock.close()
    assert not thread.is_alive(), "the decode end of the handshake hangs"
    return result["server"], bytes(replies)


def reply_kinds(replies: bytes) -> list[FrameKind]:
    kinds, pos = [], 0
    while pos < len(replies):
        h = FrameHeader.unpack(replies[pos : pos + HEADER_SIZE])
        kinds.append(h.kind)
        pos += HEADER_SIZE + h.payload_len
    return kinds


HELLO = json.dumps(peer_dict()).encode()
OTHER_HELLO = json.dumps(peer_dict(role="another prefill worker")).encode()


@pytest.mark.parametrize(
    "answer, accepted",
    [
        pytest.param(lambda c: auth_answer(c, HELLO), True, id="right-credential"),
        pytest.param(lambda c: auth_answer(c, HELLO, WRONG_CREDENTIAL), False, id="wrong-credential"),
        pytest.param(lambda c: auth_answer(c, OTHER_HELLO), False, id="answer-for-another-hello"),
        pytest.param(lambda c: auth_answer(bytes(32), HELLO), False, id="answer-to-another-challenge"),
        pytest.param(lambda c: CREDENTIAL, False, id="the-credential-itself"),
        pytest.param(lambda c: b"", False, id="empty-answer"),
        pytest.param(lambda c: None, False, id="no-answer"),
    ],
)
def test_the_decode_end_accepts_only_a_proof_of_the_credential(answer, accepted):
    server, replies = scripted_prefill(HELLO, answer)
    if accepted:
        assert isinstance(server, tuple) and reply_kinds(replies) == [FrameKind.CHALLENGE, FrameKind.HELLO_OK]
        challenge = replies[HEADER_SIZE : HEADER_SIZE + 32]
        ok = PeerInfo.from_json(replies[2 * HEADER_SIZE + 32 :])
        assert (
            ok.proof == server_proof(NONCE, challenge) and ok.extra["transport"] == "tcp"
        )  # the decode end proves it too
    elif isinstance(server, HandshakeError):
        assert "unauthenticated" in str(server) and reply_kinds(replies) == [FrameKind.CHALLENGE, FrameKind.REJECT]
    else:  # no AUTH: the prefill end closed the connection
        assert isinstance(server, ConnectionError) and reply_kinds(replies) == [FrameKind.CHALLENGE]
    assert CREDENTIAL not in replies


@pytest.mark.parametrize(
    "nonce",
    ["\ud800", "zz", "", "00", "é" * 40, "ab" * 1000],
    ids=["surrogate", "not-hex", "empty", "short", "non-ascii", "long"],
)
@pytest.mark.parametrize("credential", [CREDENTIAL, WRONG_CREDENTIAL], ids=["right", "wrong"])
def test_odd_nonces_are_read_without_crashing_and_still_need_the_credential(nonce, credential):
    """A nonce that is not hex counts as empty: only the prefill end's own check of the decode
    end's proof is weakened by it, and the decode end still demands the credential."""
    hello = json.dumps(peer_dict(nonce=nonce)).encode()
    server, replies = scripted_prefill(hello, lambda c: auth_answer(c, hello, credential))
    assert isinstance(server, tuple) == (credential == CREDENTIAL), server
    assert isinstance(server, (tuple, HandshakeError))


@pytest.mark.parametrize(
    "proof", ["", "\ud800", "zz", "00" * 32, 5, None], ids=["empty", "surrogate", "not-hex", "wrong", "int", "null"]
)
def test_the_prefill_end_refuses_a_decode_end_that_cannot_prove_the_credential(proof):
    """A fake decode worker challenges, ignores the answer and sends HELLO_OK with ``proof``."""
    client_sock, server_sock = socket.socketpair()
    for sock in (client_sock, server_sock):
        sock.settimeout(5.0)

    def fake_decode() -> None:
        header = recv_header(server_sock, bytearray(HEADER_SIZE))
        recv_payload(server_sock, header.payload_len)
        send_frame(server_sock, FrameHeader(FrameKind.CHALLENGE, payload_len=32), bytes(32))
        header = recv_header(server_sock, bytearray(HEADER_SIZE))
        recv_payload(server_sock, header.payload_len)
        ok = json.dumps({**peer_dict(role="decode", nonce=""), "proof": proof, "extra": {"transport": "tcp"}}).encode()
        send_frame(server_sock, FrameHeader(FrameKind.HELLO_OK, payload_len=len(ok)), ok)

    thread = threading.Thread(target=fake_decode)
    thread.start()
    try:
        with pytest.raises(HandshakeError):
            client_handshake(
                client_sock, PeerInfo(**{**peer_dict(), "transports": ("tcp",)}), CREDENTIAL, "fake-decode"
            )
    finally:
        client_sock.close()
        thread.join(10)
        server_sock.close()
