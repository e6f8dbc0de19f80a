"""Property-based fuzzing (hypothesis) of a live decode side: a real ``GrantLedger`` and
``KVReceiver`` on loopback, demanding the cluster credential, fed random byte streams over
real sockets.

Properties, whatever arrives: nothing crashes or hangs, the handshake is judged by the real
checks (the HMAC proof of the credential first: no peer gets in without it), answers are well
formed and never carry the credential, no grant completes from garbage, nothing is written
outside granted blocks, every grant reports once and every reserved block is freed exactly
once, and the receiver still serves a real transfer afterwards. And the positive half: a
correct transfer completes byte for byte whatever refusable frames come between its units,
each of them refused and counted. The cases labelled "was a bug" are regression tests for
what fuzzing found.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from fuzzing import (
    BLOCK,
    CREDENTIAL,
    DECODE_INFO,
    DIM,
    HEADS,
    INT64_MAX,
    INT64_MIN,
    LAYERS,
    MAX_PAYLOAD,
    NUM_BLOCKS,
    TOKEN_BYTES,
    UINT32_MAX,
    UINT64_MAX,
    WRONG_CREDENTIAL,
    auth_answer,
    encodings,
    fuzz,
    hello_nonce,
    peer_dict,
    peer_json_objects,
    server_proof,
)
from hypothesis import event, example, given, note
from hypothesis import strategies as st

from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.kv_connector import TransferOutcome
from pdserve.kvtransfer.grants import Grant, GrantLedger, GrantState
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, choose
from pdserve.kvtransfer.integrity import checksum
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_PAYLOAD,
    VERSION,
    AckStatus,
    FrameHeader,
    FrameKind,
    done_frame,
)
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVConnection

KIND_VALUES = [int(k) for k in FrameKind]


class DecodeSide:
    """A decode worker's KV side (grant ledger and receiver, with the cluster credential) over a
    32-block cache, and a block ledger that catches double frees and frees of blocks that were
    never reserved. Each grant's report frees its blocks (there is no engine here to move a
    completed grant's blocks into its running batch) and is recorded: it must come once."""

    def __init__(self) -> None:
        layout = KVLayout(LAYERS, HEADS, DIM, BLOCK, torch.float32)
        self.tensor = torch.zeros(layout.shape(NUM_BLOCKS))
        self.cache = KVCacheView(list(self.tensor.unbind(0)), BLOCK, TOKEN_BYTES)
        self.lock = threading.Lock()
        self.free = set(range(NUM_BLOCKS))
        self.reserved: set[int] = set()
        self.ledger_errors: list[str] = []
        self.reports: dict[int, list[TransferOutcome]] = {}  # transfer id -> what its grant reported
        self.ledger = GrantLedger(LAYERS, TOKEN_BYTES, lease_s=30.0, quarantine_s=0.01)
        self.receiver = KVReceiver(self.ledger, self.cache, DECODE_INFO, "127.0.0.1", 0, secret=CREDENTIAL)
        self.receiver.start()
        self.address = ("127.0.0.1", self.receiver.port)
        # A prefill side for the "still serving" check: 16-token blocks (re-blocking), random K/V.
        gen = torch.Generator().manual_seed(0)
        self.src = KVCacheView(
            list(torch.randn(LAYERS, 4, 16, 2, HEADS, DIM, generator=gen).unbind(0)), 16, TOKEN_BYTES
        )

    def _free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            for b in block_ids:
                if b not in self.reserved:
                    self.ledger_errors.append(f"block {b} freed but not reserved (double free?)")
                self.reserved.discard(b)
                self.free.add(b)

    def grant(self, num_tokens: int, rng: random.Random, lease_s: float | None = None) -> Grant:
        with self.lock:
            blocks = rng.sample(sorted(self.free), -(-num_tokens // BLOCK))
            self.free -= set(blocks)
            self.reserved |= set(blocks)
        transfer_id: list[int] = []  # known once ``grant`` returns, before anyone can end the grant

        def report(outcome: TransferOutcome) -> None:
            with self.lock:
                self.reports.setdefault(transfer_id[0], []).append(outcome)
            self._free_blocks(blocks)

        transfer_id.append(self.ledger.grant(blocks, num_tokens, 0, report, lease_s=lease_s))
        return self.ledger.lookup(transfer_id[0])

    def report_of(self, grant: Grant, timeout: float = 10.0) -> TransferOutcome:
        """The grant's one report (waits for it: a failure's comes after the quarantine)."""
        deadline = time.monotonic() + timeout
        while grant.transfer_id not in self.reports and time.monotonic() < deadline:
            time.sleep(0.002)
        got = self.reports.get(grant.transfer_id, [])
        assert len(got) == 1, f"transfer {grant.transfer_key} reported {len(got)} times: {got}"
        return got[0]

    def settle(self, grants) -> None:
        """Ends every grant (failed, expired or complete: each reports once and frees its
        blocks) and waits until every reserved block is back."""
        self.ledger.reap_expired()
        for g in grants:
            self.ledger.fail(g, "fuzz example over")
        deadline = time.monotonic() + 30  # generous: a loaded machine may be slow to run the quarantine timers
        while (self.ledger.num_active or self.reserved) and time.monotonic() < deadline:
            time.sleep(0.005)

    def still_serving(self, rng: random.Random) -> None:
        """A fresh, authenticated handshake and a full transfer into a fresh grant succeed."""
        n = rng.randint(1, 64)
        grant = self.grant(n, rng)
        src_blocks = rng.sample(range(4), -(-n // 16))
        info = PeerInfo(**{**peer_dict(), "transports": ("tcp",)})
        conn = KVConnection(f"127.0.0.1:{self.receiver.port}", info, self.src, secret=CREDENTIAL, connect_timeout=5.0)
        try:
            out = conn.open(grant.transfer_id, grant.block_ids, BLOCK, n)
            cut = rng.randint(1, n)
            for start, end in ((0, cut), (cut, n)):
                for layer in range(LAYERS):
                    if start < end:
                        out.send_layer(layer, src_blocks, start, end)
            acked: list[TransferOutcome] = []
            done = threading.Event()
            out.finish(11, lambda outcome: (acked.append(outcome), done.set()))
            assert done.wait(10) and acked[0].ok, acked
            result = self.report_of(grant)
            assert result.ok and result.first_token_id == 11 and result.transport == "tcp"
            for layer in range(LAYERS):
                got = self.cache.read(layer, self.cache.slots(grant.block_ids, 0, n)).data.tobytes()
                assert got == self.src.read(layer, self.src.slots(src_blocks, 0, n)).data.tobytes()
        finally:
            conn.close()

    def close(self) -> None:
        self.receiver.stop()


@pytest.fixture(scope="module")
def decode_side():
    side = DecodeSide()
    yield side
    side.close()


class ThreadCrashes:
    """Records exceptions that escape any thread (a dead server thread) while active."""

    def __init__(self) -> None:
        self.crashes: list[str] = []

    def __enter__(self) -> "ThreadCrashes":
        self._previous = threading.excepthook
        threading.excepthook = lambda args: self.crashes.append(
            f"{args.thread.name if args.thread else '?'}: "
            + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        )
        return self

    def __exit__(self, *exc) -> None:
        threading.excepthook = self._previous


def kv_conn_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kv-conn")


def wait_conn_threads(limit: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while kv_conn_threads() > limit:
        assert time.monotonic() < deadline, "a KV server connection thread hangs"
        time.sleep(0.002)


def read_frame(sock: socket.socket) -> tuple[FrameHeader, bytes]:
    """One whole frame from the decode side (during the handshake)."""
    raw = sock.recv(HEADER_SIZE, socket.MSG_WAITALL)
    assert len(raw) == HEADER_SIZE, f"the decode side closed the connection mid-handshake ({len(raw)} bytes)"
    header = FrameHeader.unpack(raw)
    payload = sock.recv(header.payload_len, socket.MSG_WAITALL) if header.payload_len else b""
    return header, payload


def send_auth(sock: socket.socket, mac: bytes) -> None:
    sock.sendall(FrameHeader(FrameKind.AUTH, payload_len=len(mac)).pack() + mac)


def handshake(sock: socket.socket, hello: bytes | None = None) -> bytes:
    """A proper prefill side's handshake (HELLO, the right AUTH); returns what the decode side sent."""
    hello = hello or json.dumps(peer_dict()).encode()
    sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
    header, challenge = read_frame(sock)
    assert header.kind is FrameKind.CHALLENGE, header
    send_auth(sock, auth_answer(challenge, hello))
    ok, info = read_frame(sock)
    assert ok.kind is FrameKind.HELLO_OK, f"the decode side refused a valid handshake: {ok.kind.name} {info!r}"
    return header.pack() + challenge + ok.pack() + info


# -- what the fuzz client sends -----------------------------------------------------------


@dataclass(frozen=True)
class FrameSpec:
    """One frame to send; ``tid`` is ("grant", i) for a real transfer id, else a raw id."""

    kind: int
    tid: tuple | int
    layer: int
    start: int
    end: int
    plen: tuple  # ("natural", delta) or ("raw", n)
    send: tuple  # ("full",), ("short", k) or ("extra", bytes)
    checksum: str | int  # "correct", "wrong" or a raw value
    aux: int = 0
    flags: int = 0  # the header's u16 after the kind: a unit's layer count minus one
    magic: bytes = MAGIC
    version: int = VERSION
    seed: int = 0


@st.composite
def frame_specs(draw, sizes: tuple[int, int]) -> FrameSpec:
    """Mostly well-formed DATA/DONE frames for the real grants (landing, refused, corrupted),
    the rest anything at all."""
    shape = draw(st.sampled_from(["data"] * 8 + ["done"] * 3 + ["anything"]), label="shape")
    if shape == "data":
        g = draw(st.sampled_from([0, 0, 1]))
        start = draw(
            st.sampled_from([None] * 4 + [LAYERS]).flatmap(
                lambda x: st.integers(0, sizes[g] - 1) if x is None else st.integers(0, 48)
            )
        )
        end = draw(
            st.sampled_from([True] * 4 + [False]).flatmap(
                lambda inside: (
                    st.integers(start + 1, max(start + 1, sizes[g])) if inside else st.integers(start, start + 16)
                )
            )
        )
        return FrameSpec(
            FrameKind.DATA,
            ("grant", g),
            draw(st.sampled_from(list(range(LAYERS)) * 3 + [LAYERS])),
            start,
            end,
            ("natural", draw(st.sampled_from([0] * 8 + [-1, 1, -TOKEN_BYTES, TOKEN_BYTES]))),
            draw(st.sampled_from([("full",)] * 8 + [("short", 1), ("short", 100)])),
            draw(st.sampled_from(["correct"] * 3 + ["wrong"])),
            flags=draw(st.sampled_from([0] * 6 + [1, 2])),  # one layer, or a unit of two or three
            seed=draw(st.integers(0, 255)),
        )
    if shape == "done":
        return FrameSpec(
            FrameKind.DONE,
            draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)),
            0,
            0,
            0,
            ("raw", draw(st.just(0) | st.integers(0, 64) | st.just(MAX_CONTROL_PAYLOAD))),
            ("full",),
            draw(st.sampled_from(["correct"] * 3 + ["wrong"])),
            aux=draw(st.integers(INT64_MIN, INT64_MAX)),
        )
    small = st.integers(0, 20)
    start = draw(small | st.integers(0, UINT32_MAX))
    return FrameSpec(
        kind=draw(st.sampled_from(KIND_VALUES) | st.integers(0, 255)),
        tid=draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)),
        layer=draw(st.integers(0, LAYERS) | st.integers(0, UINT32_MAX)),
        start=start,
        end=draw(
            small | st.integers(start, min(start + 64, UINT32_MAX)) | st.just(UINT32_MAX) | st.integers(0, UINT32_MAX)
        ),
        plen=draw(
            st.tuples(st.just("natural"), st.just(0) | st.integers(-TOKEN_BYTES, TOKEN_BYTES))
            | st.tuples(
                st.just("raw"),
                st.integers(0, 300)
                | st.sampled_from(
                    [MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1, MAX_PAYLOAD, MAX_PAYLOAD + 1, UINT64_MAX]
                ),
            )
        ),
        send=draw(
            st.just(("full",))
            | st.tuples(st.just("short"), st.integers(1, 100))
            | st.tuples(st.just("extra"), st.binary(min_size=1, max_size=60))
        ),
        checksum=draw(st.just("correct") | st.integers(0, UINT64_MAX)),
        aux=draw(st.integers(INT64_MIN, INT64_MAX)),
        flags=draw(st.just(0) | st.integers(0, 2**16 - 1)),
        magic=draw(st.sampled_from([MAGIC] * 4 + [b"PDKW", b"\x00" * 4])),
        version=draw(st.sampled_from([VERSION] * 4 + [0, 2, 255])),
        seed=draw(st.integers(0, 255)),
    )


def full_transfer(g: int, num_tokens: int, split: int) -> list[FrameSpec]:
    """A correct transfer of grant ``g`` (two chunks per layer) and its DONE."""
    bounds = sorted({0, min(split, num_tokens), num_tokens})
    units = [
        FrameSpec(FrameKind.DATA, ("grant", g), layer, a, b, ("natural", 0), ("full",), "correct", seed=layer)
        for layer in range(LAYERS)
        for a, b in zip(bounds, bounds[1:])
    ]
    return units + [FrameSpec(FrameKind.DONE, ("grant", g), 0, 0, 0, ("raw", 0), ("full",), "correct", aux=5)]


SEND_CAP = 40_000  # never send more than this for one frame's payload (the server needs EOF instead)


def render(spec: FrameSpec, grant_ids: list[int]) -> bytes:
    tid = grant_ids[spec.tid[1]] if isinstance(spec.tid, tuple) else spec.tid
    layers = spec.flags + 1 if spec.kind == FrameKind.DATA else 1  # the header's field: layers - 1
    natural = max(0, spec.end - spec.start) * TOKEN_BYTES * layers
    plen = natural + spec.plen[1] if spec.plen[0] == "natural" else spec.plen[1]
    plen = min(max(plen, 0), UINT64_MAX)
    body = random.Random(spec.seed).randbytes(min(plen, SEND_CAP))
    right = checksum(body)
    if spec.kind == FrameKind.DONE and len(body) % 8 == 0:  # a checksum of its tokens
        right = done_frame(tid, spec.aux, struct.unpack(f"<{len(body) // 8}q", body))[0].checksum
    csum = {"correct": right, "wrong": right ^ 1}.get(spec.checksum, spec.checksum)
    if spec.send[0] == "short":
        body = body[: max(0, len(body) - spec.send[1])]
    elif spec.send[0] == "extra":
        body += spec.send[1]
    return (
        HEADER.pack(
            spec.magic, spec.version, spec.kind, spec.flags, tid, spec.layer, spec.start, spec.end, spec.aux, plen, csum
        )
        + body
    )


@st.composite
def hello_payloads(draw) -> bytes:
    """HELLO payloads from garbage to almost valid (none of the known-bug classes)."""
    how = draw(st.sampled_from(["valid", "object", "object", "bytes"]))
    if how == "valid":
        return json.dumps(peer_dict()).encode()
    if how == "object":
        return json.dumps(draw(peer_json_objects())).encode(draw(encodings()))
    return draw(st.binary(max_size=120))


@dataclass(frozen=True)
class Session:
    mode: str  # "valid": proper handshake first; "hello": a HELLO with a fuzzed payload; "raw": frames straight away
    hello: bytes
    hello_plen_delta: int
    frames: tuple[FrameSpec, ...]
    cut: int | None  # stop sending after this many bytes of the frames
    fail_midway: bool  # the decode worker fails grant 0 while frames arrive
    sizes: tuple[int, int]  # tokens of grant 0 and grant 1 (grant 1's lease is already over)
    auth: str = (
        "right"  # "hello" mode: how a CHALLENGE is answered: the right credential, a wrong one, or "none" (no AUTH)
    )


@st.composite
def sessions(draw) -> Session:
    sizes = draw(st.tuples(st.integers(1, 40), st.integers(1, 16)), label="sizes")
    frames = draw(st.lists(frame_specs(sizes), max_size=10), label="frames")
    if draw(st.integers(0, 3), label="insert a full transfer") == 0:  # a correct transfer amid the garbage
        g = draw(st.sampled_from([0, 1]))
        at = draw(st.integers(0, len(frames)))
        frames[at:at] = full_transfer(g, sizes[g], draw(st.integers(0, sizes[g])))
    return Session(
        mode=draw(st.sampled_from(["valid"] * 5 + ["hello"] * 2 + ["raw"]), label="mode"),
        hello=draw(hello_payloads(), label="hello"),
        hello_plen_delta=draw(st.just(0) | st.integers(-5, 5)),
        frames=tuple(frames),
        cut=draw(
            st.sampled_from([False] * 3 + [True]).flatmap(lambda c: st.integers(0, 6000) if c else st.none()),
            label="cut",
        ),
        fail_midway=draw(st.integers(0, 4), label="fail midway") == 0,
        sizes=sizes,
        auth=draw(st.sampled_from(["right"] * 3 + ["wrong", "none"]), label="auth"),
    )


# -- what the server must do, judged by the real handshake checks --------------------------


def hello_verdict(payload: bytes) -> bool:
    """Whether the server accepts this HELLO from a peer that proves the credential (the checks
    themselves are fuzzed in test_fuzz_kv_wire.py)."""
    try:
        remote = PeerInfo.from_json(payload)
        DECODE_INFO.check_compatible(remote)
        choose(DECODE_INFO, remote)
    except HandshakeError:
        return False
    return True


def sent_hello(session: Session) -> bytes | None:
    """The HELLO payload the server read whole and then challenged (None: no such HELLO)."""
    if session.mode == "valid":
        return json.dumps(peer_dict()).encode()
    if session.mode == "hello" and session.hello_plen_delta == 0:
        return session.hello
    return None


def exchange(side: DecodeSide, session: Session, grant_ids: list[int], fail=None) -> tuple[bytes, bytes, str]:
    """Runs one fuzz connection: returns (the frames' bytes as sent, the bytes received, how it ended)."""
    sock = socket.create_connection(side.address, timeout=5.0)
    received, ended = bytearray(), "eof"
    try:
        if session.mode == "valid":  # the whole handshake first, so frames are parsed as frames
            received += handshake(sock)
        elif session.mode == "hello":
            plen = max(0, len(session.hello) + session.hello_plen_delta)
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=plen).pack() + session.hello)
            if session.hello_plen_delta == 0:  # the HELLO arrived whole: it is answered at once
                header, payload = read_frame(sock)
                received += header.pack() + payload
                if header.kind is FrameKind.CHALLENGE and session.auth != "none":
                    send_auth(
                        sock,
                        auth_answer(
                            payload, session.hello, CREDENTIAL if session.auth == "right" else WRONG_CREDENTIAL
                        ),
                    )
        stream = b"".join(render(f, grant_ids) for f in session.frames)
        if session.cut is not None:
            stream = stream[: session.cut]
        half = len(stream) // 2
        try:
            sock.sendall(stream[:half])
            if fail is not None:
                fail()
            sock.sendall(stream[half:])
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            ended = "send-failed"  # the server hung up first (protocol error)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                ended = "reset"
                break
            except socket.timeout:
                raise AssertionError("the KV server neither answered nor closed the connection within 5 s") from None
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    return stream, bytes(received), ended


def parse_replies(data: bytes) -> list[tuple[FrameHeader, bytes]]:
    frames, pos = [], 0
    while pos + HEADER_SIZE <= len(data):
        h = FrameHeader.unpack(data[pos : pos + HEADER_SIZE])
        if pos + HEADER_SIZE + h.payload_len > len(data):
            break
        frames.append((h, data[pos + HEADER_SIZE : pos + HEADER_SIZE + h.payload_len]))
        pos += HEADER_SIZE + h.payload_len
    return frames


COUNTERS = ("protocol_errors", "handshakes_refused", "units_refused", "checksum_mismatch", "transfers_tcp")


@pytest.mark.timeout(240)
@fuzz(150)
@given(session=sessions())
@example(session=Session("raw", b"", 0, (), None, False, (5, 5)))
@example(
    session=Session(
        "valid",
        b"",
        0,
        (FrameSpec(FrameKind.DATA, ("grant", 0), 0, 0, 8, ("raw", 1 << 40), ("full",), 0),),
        None,
        False,
        (8, 8),
    )
)
@example(
    session=Session(
        "hello", json.dumps(peer_dict()).encode(), 0, tuple(full_transfer(0, 8, 3)), None, False, (8, 8), "wrong"
    )
)
def test_live_kv_server_survives_random_streams(decode_side, session):
    side = decode_side
    rng = random.Random(zlib.crc32(repr(session).encode()))
    baseline_threads = kv_conn_threads()
    ledger_errors = len(side.ledger_errors)
    with ThreadCrashes() as crashes:
        grants = [
            side.grant(session.sizes[0], rng),
            side.grant(session.sizes[1], rng, lease_s=1e-6),
        ]  # expired before anything arrives; reaped at the end
        try:
            check_one_connection(side, session, grants, baseline_threads, crashes)
        finally:
            # Every reserved block comes back exactly once (even when the example failed).
            wait_conn_threads(baseline_threads)
            side.settle(grants)
            leaked, side.reserved = set(side.reserved), set()
            side.free |= leaked
        assert side.ledger_errors[ledger_errors:] == []
        assert not leaked and side.ledger.num_active == 0 and not side.ledger.grants, leaked
        for g in grants:  # each grant told its owner how it ended, once
            side.report_of(g)
        # The server still serves a real transfer from a fresh connection.
        side.still_serving(rng)
        wait_conn_threads(baseline_threads)
        assert side.ledger_errors[ledger_errors:] == [] and not side.reserved and len(side.free) == NUM_BLOCKS
        assert not crashes.crashes, crashes.crashes


def check_one_connection(
    side: DecodeSide, session: Session, grants: list, baseline_threads: int, crashes: ThreadCrashes
) -> None:
    """What must hold whatever the bytes were: no crash or hang, the handshake judged by the real
    checks, nobody let in without proving the credential, a well-formed answer that never carries
    the credential, acknowledgements only for transfers a DONE asked about, no grant completed
    from garbage, and nothing written outside the granted blocks."""
    g0 = grants[0]
    grant_ids = [g.transfer_id for g in grants]
    granted = {b for g in grants for b in g.block_ids}
    before = side.tensor.clone()
    counters = {k: side.ledger.counters[k] for k in COUNTERS}
    fail = (lambda: side.ledger.fail(g0, "cancelled mid-transfer")) if session.fail_midway else None
    stream, received, ended = exchange(side, session, grant_ids, fail)
    wait_conn_threads(baseline_threads)
    delta = {k: side.ledger.counters[k] - counters[k] for k in COUNTERS}
    replies = parse_replies(received)
    kinds = [h.kind for h, _ in replies]
    acks = [(h.transfer_id, AckStatus(h.aux)) for h, _ in replies if h.kind is FrameKind.ACK]
    completed = [g for g in grants if g.state is GrantState.COMPLETE]
    note(f"ended={ended} sent={len(stream)}B received={len(received)}B delta={delta} kinds={[k.name for k in kinds]}")
    event(
        f"mode={session.mode} auth={session.auth if session.mode == 'hello' else '-'} ended={ended} "
        f"protocol_error={delta['protocol_errors'] > 0} refused={delta['handshakes_refused'] > 0}"
    )
    event(f"acks={sorted({s.name for _, s in acks})} completed={len(completed)}")

    # Nothing crashed; the connection ended at most one way.
    assert not crashes.crashes, crashes.crashes
    assert delta["protocol_errors"] + delta["handshakes_refused"] <= 1, delta
    hello = sent_hello(session)
    proved = session.mode == "valid" or (hello is not None and session.auth == "right")  # answered with the right AUTH
    accepted = proved and hello_verdict(hello)
    if proved:
        assert delta["handshakes_refused"] == (not accepted), delta
    elif hello is not None and session.auth == "wrong":
        assert delta["handshakes_refused"] == 1, delta  # malformed, or a wrong proof of the credential

    # The answer: REJECT (after a CHALLENGE if the HELLO was well formed), or a CHALLENGE, one
    # HELLO_OK and then ACKs; a HELLO_OK only to a peer that proved the credential, and never
    # the credential itself.
    assert FrameKind.CHALLENGE not in kinds[1:], kinds
    if delta["handshakes_refused"]:
        assert set(kinds) <= {FrameKind.CHALLENGE, FrameKind.REJECT} and FrameKind.REJECT not in kinds[:-1], kinds
    else:
        assert (
            set(kinds) <= {FrameKind.CHALLENGE, FrameKind.HELLO_OK, FrameKind.ACK}
            and FrameKind.HELLO_OK not in kinds[2:]
        ), kinds
    if FrameKind.HELLO_OK in kinds:
        assert accepted and kinds[:2] == [FrameKind.CHALLENGE, FrameKind.HELLO_OK], kinds
        info = PeerInfo.from_json(replies[1][1])
        assert info.proof == server_proof(hello_nonce(hello), replies[0][1]) and info.extra["transport"] == "tcp"
    if not accepted:  # an unauthenticated peer's frames never reach a grant
        assert FrameKind.HELLO_OK not in kinds and not acks and not completed, kinds
        assert delta["units_refused"] == delta["checksum_mismatch"] == delta["transfers_tcp"] == 0, delta
    assert CREDENTIAL not in received and CREDENTIAL.hex().encode() not in received

    # Acknowledgements answer DONE frames that were sent, one each at most; OK only for a grant
    # that completed, and every completed grant was counted and fully landed intact.
    dones = [f for f in session.frames if f.kind == FrameKind.DONE]
    asked = {grant_ids[f.tid[1]] if isinstance(f.tid, tuple) else f.tid for f in dones}
    assert len(acks) <= len(dones) and {tid for tid, _ in acks} <= asked, (acks, asked)
    for tid, status in acks:
        if status is AckStatus.OK:
            assert any(g.transfer_id == tid and g.state is GrantState.COMPLETE for g in grants), (tid, status)
    assert delta["transfers_tcp"] == len(completed), delta
    for g in completed:
        assert g.landed.all() and not g.corrupted

    # Nothing was written outside the granted blocks (and nothing at all before the handshake).
    diff = side.tensor.view(torch.int32) != before.view(torch.int32)  # bitwise: garbage K/V holds NaNs
    changed = sorted({int(b) for b in diff.flatten(2).any(2).nonzero()[:, 1]})
    assert not set(changed) - granted, f"blocks {changed} changed, but only {sorted(granted)} were granted"
    assert accepted or not changed, f"blocks {changed} changed, but the peer never got past the handshake"


@st.composite
def refusable_frames(draw, num_tokens: int) -> list[FrameSpec]:
    """Well-formed frames the server must refuse one by one without dropping the connection:
    units and DONEs for transfers nobody granted, units outside grant 0's layers or tokens."""
    out = []
    for _ in range(draw(st.integers(1, 8))):
        how = draw(st.sampled_from(["unknown", "unknown", "done-unknown", "bad-layer", "past-end"]))
        start = draw(st.integers(0, num_tokens - 1))
        end = draw(st.integers(start + 1, num_tokens))
        unknown = draw(st.integers(0, UINT64_MAX))
        seed = draw(st.integers(0, 255))
        if how == "unknown":
            out.append(
                FrameSpec(
                    FrameKind.DATA,
                    unknown,
                    draw(st.integers(0, LAYERS - 1)),
                    start,
                    end,
                    ("natural", 0),
                    ("full",),
                    "correct",
                    seed=seed,
                )
            )
        elif how == "done-unknown":
            out.append(FrameSpec(FrameKind.DONE, unknown, 0, 0, 0, ("raw", 0), ("full",), 0))
        elif how == "bad-layer":
            out.append(
                FrameSpec(
                    FrameKind.DATA, ("grant", 0), LAYERS, start, end, ("natural", 0), ("full",), "correct", seed=seed
                )
            )
        else:
            out.append(
                FrameSpec(
                    FrameKind.DATA,
                    ("grant", 0),
                    draw(st.integers(0, LAYERS - 1)),
                    start,
                    num_tokens + 1 + end,
                    ("natural", 0),
                    ("full",),
                    "correct",
                    seed=seed,
                )
            )
    return out


@pytest.mark.timeout(240)
@fuzz(60)
@given(data=st.data())
def test_live_kv_server_completes_a_clean_transfer_amid_refused_frames(decode_side, data):
    """The positive half: a correct transfer still completes, byte for byte, whatever well-formed
    but unwanted frames come between its units (each refused and counted, none fatal)."""
    side = decode_side
    num_tokens = data.draw(st.integers(1, 40), label="tokens")
    rng = random.Random(num_tokens)
    units = full_transfer(0, num_tokens, data.draw(st.integers(0, num_tokens), label="split"))
    *units, done = units
    noise = data.draw(refusable_frames(num_tokens), label="noise")
    frames = list(units)
    for frame in noise:
        frames.insert(data.draw(st.integers(0, len(frames)), label="at"), frame)
    baseline_threads = kv_conn_threads()
    with ThreadCrashes() as crashes:
        grant = side.grant(num_tokens, rng)
        try:
            assert all(f.tid != grant.transfer_id for f in noise)  # 2**-64 per frame
            counters = {k: side.ledger.counters[k] for k in COUNTERS}
            session = Session("valid", b"", 0, (*frames, done), None, False, (num_tokens, 1))
            _, received, ended = exchange(side, session, [grant.transfer_id])
            wait_conn_threads(baseline_threads)
            delta = {k: side.ledger.counters[k] - counters[k] for k in COUNTERS}
            acks = [(h.transfer_id, AckStatus(h.aux)) for h, _ in parse_replies(received) if h.kind is FrameKind.ACK]
            assert ended == "eof" and delta["protocol_errors"] == 0 and delta["checksum_mismatch"] == 0, (ended, delta)
            assert delta["units_refused"] == sum(f.kind == FrameKind.DATA for f in noise), delta
            expected_acks = [(f.tid, AckStatus.UNKNOWN_TRANSFER) for f in frames if f.kind == FrameKind.DONE]
            assert acks == expected_acks + [(grant.transfer_id, AckStatus.OK)], acks
            assert grant.state is GrantState.COMPLETE and delta["transfers_tcp"] == 1
            outcome = side.report_of(grant)
            assert outcome.ok and outcome.first_token_id == 5 and outcome.nbytes == num_tokens * LAYERS * TOKEN_BYTES
            for unit in units:  # what landed is what was sent
                payload = render(unit, [grant.transfer_id])[HEADER_SIZE:]
                got = side.cache.read(
                    unit.layer, side.cache.slots(grant.block_ids, unit.start, unit.end)
                ).data.tobytes()
                assert got == payload, f"layer {unit.layer} tokens [{unit.start}, {unit.end}) differ"
        finally:
            side.settle([grant])
        assert not side.reserved and len(side.free) == NUM_BLOCKS
        assert not crashes.crashes, crashes.crashes


WIRE_MALFORMED_HANDSHAKES = [
    pytest.param(b"0", id="non-object-json"),
    pytest.param(b"[" * 60_000, id="deeply-nested-json"),
    pytest.param(json.dumps(peer_dict(transports=[1])).encode(), id="non-string-transport"),
    pytest.param(json.dumps(peer_dict(nonce=5)).encode(), id="non-string-nonce"),
    pytest.param(json.dumps(peer_dict(proof=None)).encode(), id="null-proof"),
    pytest.param(json.dumps(peer_dict(auth_token=CREDENTIAL.decode())).encode(), id="protocol-1-credential-in-hello"),
    pytest.param(json.dumps({**peer_dict(), "\ud800": 1}).encode(), id="surrogate-in-refusal-reason"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hello", WIRE_MALFORMED_HANDSHAKES)
def test_live_kv_server_refuses_malformed_hellos(decode_side, hello):
    """Refused at once, before any challenge, and counted."""
    side = decode_side
    before = side.ledger.counters["handshakes_refused"]
    baseline_threads = kv_conn_threads()
    with ThreadCrashes() as crashes:
        sock = socket.create_connection(side.address, timeout=5.0)
        try:
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
        wait_conn_threads(baseline_threads)
        side.still_serving(random.Random(0))  # the server survives either way
    assert [h.kind for h, _ in parse_replies(received)] == [FrameKind.REJECT]
    assert side.ledger.counters["handshakes_refused"] == before + 1
    assert not crashes.crashes, crashes.crashes


HELLO = json.dumps(peer_dict()).encode()
OTHER_HELLO = json.dumps(peer_dict(role="another prefill worker")).encode()
_EARLIER: dict[str, bytes] = {}  # an AUTH that was right on an earlier connection


def _replayed(challenge: bytes) -> bytes:
    return _EARLIER["auth"]


UNPROVEN = [
    pytest.param(lambda c: auth_answer(c, HELLO, WRONG_CREDENTIAL), id="wrong-credential"),
    pytest.param(_replayed, id="replayed-auth"),
    pytest.param(lambda c: auth_answer(c, OTHER_HELLO), id="answer-for-another-hello"),
    pytest.param(lambda c: CREDENTIAL, id="the-credential-itself"),
    pytest.param(lambda c: None, id="units-instead-of-auth"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", UNPROVEN)
def test_live_kv_server_lets_in_only_a_proof_of_the_credential(decode_side, answer):
    """A peer that cannot prove the credential is refused and counted, and the transfer it sends
    anyway never lands (nothing in the cache changes, the grant stays open)."""
    side = decode_side
    rng = random.Random(2)
    baseline_threads = kv_conn_threads()
    if not _EARLIER:  # a right answer, to replay on a connection with a fresh challenge
        sock = socket.create_connection(side.address, timeout=5.0)
        try:
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(HELLO)).pack() + HELLO)
            _, challenge = read_frame(sock)
            _EARLIER["auth"] = auth_answer(challenge, HELLO)
            send_auth(sock, _EARLIER["auth"])
            assert read_frame(sock)[0].kind is FrameKind.HELLO_OK
        finally:
            sock.close()
        wait_conn_threads(baseline_threads)
    before, refused = side.tensor.clone(), side.ledger.counters["handshakes_refused"]
    with ThreadCrashes() as crashes:
        grant = side.grant(8, rng)
        try:
            sock = socket.create_connection(side.address, timeout=5.0)
            try:
                sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(HELLO)).pack() + HELLO)
                header, challenge = read_frame(sock)
                assert header.kind is FrameKind.CHALLENGE
                mac = answer(challenge)
                transfer = b"".join(render(f, [grant.transfer_id]) for f in full_transfer(0, 8, 3))
                try:
                    sock.sendall(
                        (b"" if mac is None else FrameHeader(FrameKind.AUTH, payload_len=len(mac)).pack() + mac)
                        + transfer
                    )
                except OSError:
                    pass  # refused and closed before all of it was read
                received = b""
                try:
                    while chunk := sock.recv(65536):
                        received += chunk
                except ConnectionResetError:
                    pass
            finally:
                sock.close()
            wait_conn_threads(baseline_threads)
            assert set(h.kind for h, _ in parse_replies(received)) <= {FrameKind.REJECT}, received
            assert side.ledger.counters["handshakes_refused"] == refused + 1
            assert grant.state is GrantState.ACTIVE and not grant.landed.any()
            assert torch.equal(
                side.tensor.view(torch.int32), before.view(torch.int32)
            )  # bitwise: earlier garbage holds NaNs
            assert CREDENTIAL not in received
        finally:
            side.settle([grant])
        assert not side.report_of(grant).ok and not side.reserved
        side.still_serving(rng)
    assert not crashes.crashes, crashes.crashes


@pytest.mark.timeout(60)
def test_a_failed_done_is_final(decode_side):
    """An INCOMPLETE answer ends the grant for good: the missing layer arriving afterwards
    neither lands nor turns it into a success, and the grant reports one failure."""
    side = decode_side
    rng = random.Random(1)
    baseline_threads = kv_conn_threads()
    grant = side.grant(8, rng)

    def data(layer: int) -> bytes:
        return render(
            FrameSpec(FrameKind.DATA, ("grant", 0), layer, 0, 8, ("natural", 0), ("full",), "correct", seed=layer),
            [grant.transfer_id],
        )

    done = done_frame(grant.transfer_id, 0)[0].pack()
    sock = socket.create_connection(side.address, timeout=5.0)
    try:
        handshake(sock)
        sock.sendall(data(0) + data(1) + done)  # layer 2 missing: INCOMPLETE
        first = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.sendall(data(2) + done)
        second = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
    finally:
        sock.close()
        wait_conn_threads(baseline_threads)
        side.settle([grant])
    assert AckStatus(first.aux) is AckStatus.INCOMPLETE
    assert AckStatus(second.aux) is not AckStatus.OK and grant.state is GrantState.FAILED
    assert not grant.landed[2].any()
    outcome = side.report_of(grant)
    assert not outcome.ok and "missing" in outcome.reason


@pytest.mark.parametrize("flipped", ["first token", "another choice's first token"])
def test_a_done_whose_tokens_arrive_corrupted_fails_the_transfer(decode_side, flipped):
    """The decode side continues the answer from DONE's tokens: a bit flipped in them is refused
    like corrupted K/V, never decoded from."""
    side = decode_side
    rng = random.Random(2)
    baseline_threads = kv_conn_threads()
    grant = side.grant(8, rng)
    mismatches = side.ledger.counters["checksum_mismatch"]
    units = b"".join(
        render(
            FrameSpec(FrameKind.DATA, ("grant", 0), layer, 0, 8, ("natural", 0), ("full",), "correct", seed=layer),
            [grant.transfer_id],
        )
        for layer in range(LAYERS)
    )
    header, payload = done_frame(grant.transfer_id, 42, (7, 9))
    if flipped == "first token":
        header = replace(header, aux=42 ^ 4)
    else:
        payload = payload[:8] + bytes([payload[8] ^ 1]) + payload[9:]
    sock = socket.create_connection(side.address, timeout=5.0)
    try:
        handshake(sock)
        sock.sendall(units + header.pack() + payload)
        ack = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
    finally:
        sock.close()
        wait_conn_threads(baseline_threads)
        side.settle([grant])
    assert AckStatus(ack.aux) is AckStatus.CHECKSUM_MISMATCH and grant.state is GrantState.FAILED
    assert side.ledger.counters["checksum_mismatch"] == mismatches + 1
    outcome = side.report_of(grant)
    assert not outcome.ok and outcome.corrupted
