"""Property-based fuzzing (hypothesis) of a live decode side: a real ``KVReceiver`` and
``KVServer`` on loopback, fed random byte streams over real sockets.

Properties, whatever arrives: nothing crashes or hangs, the handshake is judged by the real
checks, answers are well formed and never echo the credential, no grant completes from
garbage, nothing is written outside granted blocks, every reserved block is freed exactly
once, and the server still serves a real transfer afterwards. And the positive half: a
correct transfer completes byte for byte whatever refusable frames come between its units.
The cases labelled "was a bug" are regression tests for what fuzzing found.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import traceback
import zlib
from dataclasses import dataclass

import pytest
import torch
import xxhash
from hypothesis import event, example, given, note
from hypothesis import strategies as st

from fuzzing import (
    BLOCK, DECODE_INFO, DIM, HEADS, INT64_MAX, INT64_MIN, LAYERS, MAX_PAYLOAD, NUM_BLOCKS, TOKEN_BYTES, UINT32_MAX,
    UINT64_MAX, encodings, fuzz, peer_dict, peer_json_objects,
)
from pdserve.engine.kv_cache import KVLayout
from pdserve.kvtransfer import negotiate
from pdserve.kvtransfer.client import KVConnection
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.protocol import HEADER, HEADER_SIZE, MAGIC, MAX_CONTROL_PAYLOAD, VERSION, AckStatus, FrameHeader, FrameKind
from pdserve.kvtransfer.receiver import GrantState, KVReceiver
from pdserve.kvtransfer.server import KVServer, check_auth

KIND_VALUES = [int(k) for k in FrameKind]


class LoopThread:
    """The decode worker's event loop, running in a thread the test drives from outside."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def call(self, fn, *args, timeout: float = 10.0):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def wait(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class DecodeSide:
    """A decode worker's KV side with a 32-block cache and a block ledger that catches double
    frees and frees of blocks that were never reserved."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        layout = KVLayout(LAYERS, HEADS, DIM, BLOCK, torch.float32)
        self.tensor = torch.zeros(layout.shape(NUM_BLOCKS))
        self.cache = CacheLayers(list(self.tensor.unbind(0)), BLOCK)
        self.lock = threading.Lock()
        self.free = set(range(NUM_BLOCKS))
        self.reserved: set[int] = set()
        self.ledger_errors: list[str] = []
        self.receiver = KVReceiver(self.cache, self.loop.loop, self._free_blocks, lease_s=30.0, quarantine_s=0.01)
        self.server = KVServer(self.receiver, DECODE_INFO, "127.0.0.1", 0, max_tokens=NUM_BLOCKS * BLOCK)
        self.server.start()
        self.address = ("127.0.0.1", self.server.port)
        # A prefill side for the "still serving" check: 16-token blocks (re-blocking), random K/V.
        gen = torch.Generator().manual_seed(0)
        self.src = CacheLayers(list(torch.randn(LAYERS, 4, 16, 2, HEADS, DIM, generator=gen).unbind(0)), 16)

    def _free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            for b in block_ids:
                if b not in self.reserved:
                    self.ledger_errors.append(f"block {b} freed but not reserved (double free?)")
                self.reserved.discard(b)
                self.free.add(b)

    def grant(self, num_tokens: int, rng: random.Random, lease_s: float | None = None):
        with self.lock:
            blocks = rng.sample(sorted(self.free), -(-num_tokens // BLOCK))
            self.free -= set(blocks)
            self.reserved |= set(blocks)
        return self.loop.call(self.receiver.grant, blocks, num_tokens, lease_s)

    def take(self, grant) -> None:
        blocks = self.loop.call(self.receiver.take, grant)
        with self.lock:
            self.reserved -= set(blocks)
            self.free |= set(blocks)

    def settle(self, grants) -> None:
        """Ends every grant (completed ones are taken, the rest failed or expired) and waits
        until every reserved block is back."""
        self.loop.call(self.receiver.reap_expired)
        for g in grants:
            if g.state is GrantState.COMPLETE and g.owns_blocks:
                self.take(g)
            else:
                self.loop.call(self.receiver.fail, g, "fuzz example over")
        deadline = time.monotonic() + 30  # generous: a loaded machine may be slow to run the loop
        while (self.receiver.num_active or self.reserved) and time.monotonic() < deadline:
            time.sleep(0.005)

    def still_serving(self, rng: random.Random) -> None:
        """A fresh, valid handshake and a full transfer into a fresh grant succeed."""
        n = rng.randint(1, 64)
        grant = self.grant(n, rng)
        src_blocks = rng.sample(range(4), -(-n // 16))
        info = PeerInfo(**{**peer_dict(), "transports": ("tcp",)})
        conn = KVConnection(f"127.0.0.1:{self.server.port}", info, self.src, connect_timeout=5.0)
        try:
            out = conn.open(grant.transfer_id, grant.block_ids, BLOCK, n)
            cut = rng.randint(1, n)
            for start, end in ((0, cut), (cut, n)):
                for layer in range(LAYERS):
                    if start < end:
                        out.send_layer(layer, src_blocks, start, end)
            assert out.finish(first_token_id=11).result(timeout=10) is AckStatus.OK
            result = self.loop.wait(self.receiver.wait(grant))
            assert result.first_token_id == 11 and result.transport == "tcp"
            for layer in range(LAYERS):
                got = b"".join(bytes(v) for v in self.cache.read(layer, grant.block_ids, 0, n))
                assert got == b"".join(bytes(v) for v in self.src.read(layer, src_blocks, 0, n))
            self.take(grant)
        finally:
            conn.close()

    def close(self) -> None:
        self.server.stop()
        self.loop.close()


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
            f"{args.thread.name if args.thread else '?'}: " + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
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
    flags: int = 0
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
        start = draw(st.sampled_from([None] * 4 + [LAYERS]).flatmap(lambda x: st.integers(0, sizes[g] - 1) if x is None else st.integers(0, 48)))
        end = draw(st.sampled_from([True] * 4 + [False]).flatmap(
            lambda inside: st.integers(start + 1, max(start + 1, sizes[g])) if inside else st.integers(start, start + 16)))
        return FrameSpec(
            FrameKind.DATA, ("grant", g), draw(st.sampled_from(list(range(LAYERS)) * 3 + [LAYERS])), start, end,
            ("natural", draw(st.sampled_from([0] * 8 + [-1, 1, -TOKEN_BYTES, TOKEN_BYTES]))),
            draw(st.sampled_from([("full",)] * 8 + [("short", 1), ("short", 100)])),
            draw(st.sampled_from(["correct"] * 3 + ["wrong"])), seed=draw(st.integers(0, 255)),
        )
    if shape == "done":
        return FrameSpec(
            FrameKind.DONE, draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)), 0, 0, 0,
            ("raw", draw(st.just(0) | st.integers(0, 64) | st.just(MAX_CONTROL_PAYLOAD))), ("full",), 0,
            aux=draw(st.integers(INT64_MIN, INT64_MAX)),
        )
    small = st.integers(0, 20)
    start = draw(small | st.integers(0, UINT32_MAX))
    return FrameSpec(
        kind=draw(st.sampled_from(KIND_VALUES) | st.integers(0, 255)),
        tid=draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)),
        layer=draw(st.integers(0, LAYERS) | st.integers(0, UINT32_MAX)),
        start=start,
        end=draw(small | st.integers(start, min(start + 64, UINT32_MAX)) | st.just(UINT32_MAX) | st.integers(0, UINT32_MAX)),
        plen=draw(st.tuples(st.just("natural"), st.just(0) | st.integers(-TOKEN_BYTES, TOKEN_BYTES))
                  | st.tuples(st.just("raw"), st.integers(0, 300) | st.sampled_from([MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1,
                                                                                     MAX_PAYLOAD, MAX_PAYLOAD + 1, UINT64_MAX]))),
        send=draw(st.just(("full",)) | st.tuples(st.just("short"), st.integers(1, 100)) | st.tuples(st.just("extra"), st.binary(min_size=1, max_size=60))),
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
    units = [FrameSpec(FrameKind.DATA, ("grant", g), layer, a, b, ("natural", 0), ("full",), "correct", seed=layer)
             for layer in range(LAYERS) for a, b in zip(bounds, bounds[1:])]
    return units + [FrameSpec(FrameKind.DONE, ("grant", g), 0, 0, 0, ("raw", 0), ("full",), 0, aux=5)]


SEND_CAP = 40_000  # never send more than this for one frame's payload (the server needs EOF instead)


def render(spec: FrameSpec, grant_ids: list[int]) -> bytes:
    tid = grant_ids[spec.tid[1]] if isinstance(spec.tid, tuple) else spec.tid
    natural = max(0, spec.end - spec.start) * TOKEN_BYTES
    plen = natural + spec.plen[1] if spec.plen[0] == "natural" else spec.plen[1]
    plen = min(max(plen, 0), UINT64_MAX)
    body = random.Random(spec.seed).randbytes(min(plen, SEND_CAP))
    csum = {"correct": xxhash.xxh3_64_intdigest(body), "wrong": xxhash.xxh3_64_intdigest(body) ^ 1}.get(spec.checksum, spec.checksum)
    if spec.send[0] == "short":
        body = body[: max(0, len(body) - spec.send[1])]
    elif spec.send[0] == "extra":
        body += spec.send[1]
    return HEADER.pack(spec.magic, spec.version, spec.kind, spec.flags, tid, spec.layer, spec.start, spec.end, spec.aux, plen, csum) + body


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
        cut=draw(st.sampled_from([False] * 3 + [True]).flatmap(lambda c: st.integers(0, 6000) if c else st.none()), label="cut"),
        fail_midway=draw(st.integers(0, 4), label="fail midway") == 0,
        sizes=sizes,
    )


# -- what the server must do, judged by the real handshake checks --------------------------

def hello_verdict(payload: bytes) -> bool:
    """Whether the server accepts this HELLO (the checks themselves are fuzzed in section 4)."""
    try:
        remote = PeerInfo.from_json(payload)
        check_auth(DECODE_INFO, remote)
        DECODE_INFO.check_compatible(remote)
        negotiate.choose(DECODE_INFO, remote)
    except HandshakeError:
        return False
    return True


def exchange(side: DecodeSide, session: Session, grant_ids: list[int], fail=None) -> tuple[bytes, bytes, str]:
    """Runs one fuzz connection: returns (the frames' bytes as sent, the bytes received, how it ended)."""
    sock = socket.create_connection(side.address, timeout=5.0)
    received, ended = bytearray(), "eof"
    try:
        if session.mode == "valid":
            hello = json.dumps(peer_dict()).encode()
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
        elif session.mode == "hello":
            plen = max(0, len(session.hello) + session.hello_plen_delta)
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=plen).pack() + session.hello)
        if session.mode == "valid":  # wait for HELLO_OK, so frames are parsed as frames
            while len(received) < HEADER_SIZE or len(received) < HEADER_SIZE + FrameHeader.unpack(received[:HEADER_SIZE]).payload_len:
                chunk = sock.recv(65536)
                assert chunk, "the server refused a valid handshake"
                received += chunk
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
        h = FrameHeader.unpack(data[pos:pos + HEADER_SIZE])
        if pos + HEADER_SIZE + h.payload_len > len(data):
            break
        frames.append((h, data[pos + HEADER_SIZE:pos + HEADER_SIZE + h.payload_len]))
        pos += HEADER_SIZE + h.payload_len
    return frames


COUNTERS = ("protocol_errors", "handshakes_refused", "units_refused", "checksum_mismatch", "transfers_tcp")


@pytest.mark.timeout(240)
@fuzz(150)
@given(session=sessions())
@example(session=Session("raw", b"", 0, (), None, False, (5, 5)))
@example(session=Session("valid", b"", 0, (FrameSpec(FrameKind.DATA, ("grant", 0), 0, 0, 8, ("raw", 1 << 40), ("full",), 0),), None, False, (8, 8)))
def test_live_kv_server_survives_random_streams(decode_side, session):
    side = decode_side
    rng = random.Random(zlib.crc32(repr(session).encode()))
    baseline_threads = kv_conn_threads()
    ledger_errors = len(side.ledger_errors)
    with ThreadCrashes() as crashes:
        grants = [side.grant(session.sizes[0], rng),
                  side.grant(session.sizes[1], rng, lease_s=1e-6)]  # expired before anything arrives; reaped at the end
        try:
            check_one_connection(side, session, grants, baseline_threads, crashes)
        finally:
            # Every reserved block comes back exactly once (even when the example failed).
            wait_conn_threads(baseline_threads)
            side.settle(grants)
            leaked, side.reserved = set(side.reserved), set()
            side.free |= leaked
        assert side.ledger_errors[ledger_errors:] == []
        assert not leaked and side.receiver.num_active == 0 and not side.receiver.grants, leaked
        # The server still serves a real transfer from a fresh connection.
        side.still_serving(rng)
        wait_conn_threads(baseline_threads)
        assert side.ledger_errors[ledger_errors:] == [] and not side.reserved and len(side.free) == NUM_BLOCKS
        assert not crashes.crashes, crashes.crashes


def check_one_connection(side: DecodeSide, session: Session, grants: list, baseline_threads: int, crashes: ThreadCrashes) -> None:
    """What must hold whatever the bytes were: no crash or hang, the handshake judged by the real
    checks, a well-formed answer that never echoes the credential, acknowledgements only for
    transfers a DONE asked about, no grant completed from garbage, and nothing written outside
    the granted blocks."""
    g0 = grants[0]
    grant_ids = [g.transfer_id for g in grants]
    granted = {b for g in grants for b in g.block_ids}
    before = side.tensor.clone()
    counters = {k: side.receiver.counters[k] for k in COUNTERS}
    fail = (lambda: side.loop.call(side.receiver.fail, g0, "cancelled mid-transfer")) if session.fail_midway else None
    stream, received, ended = exchange(side, session, grant_ids, fail)
    wait_conn_threads(baseline_threads)
    side.loop.call(lambda: None)  # let the fails that finish() scheduled on the loop run
    delta = {k: side.receiver.counters[k] - counters[k] for k in COUNTERS}
    replies = parse_replies(received)
    kinds = [h.kind for h, _ in replies]
    acks = [(h.transfer_id, AckStatus(h.aux)) for h, _ in replies if h.kind is FrameKind.ACK]
    completed = [g for g in grants if g.state is GrantState.COMPLETE]
    note(f"ended={ended} sent={len(stream)}B received={len(received)}B delta={delta} acks={acks}")
    event(f"mode={session.mode} ended={ended} protocol_error={delta['protocol_errors'] > 0} "
          f"refused={delta['handshakes_refused'] > 0}")
    event(f"acks={sorted({s.name for _, s in acks})} completed={len(completed)}")

    # Nothing crashed; the connection ended at most one way.
    assert not crashes.crashes, crashes.crashes
    assert delta["protocol_errors"] + delta["handshakes_refused"] <= 1, delta
    if session.mode == "valid":
        assert delta["handshakes_refused"] == 0, delta
    elif session.mode == "hello" and session.hello_plen_delta == 0:
        assert delta["handshakes_refused"] == (not hello_verdict(session.hello)), delta

    # The answer: a REJECT alone, or one HELLO_OK first and then ACKs; never the credential.
    if delta["handshakes_refused"]:
        assert set(kinds) <= {FrameKind.REJECT}, kinds
    else:
        assert set(kinds) <= {FrameKind.HELLO_OK, FrameKind.ACK} and FrameKind.HELLO_OK not in kinds[1:], kinds
    for h, payload in replies:
        if h.kind is FrameKind.HELLO_OK:
            info = PeerInfo.from_json(payload)
            assert info.auth_token == "" and info.extra["transport"] == "tcp"

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

    # Nothing was written outside the granted blocks.
    diff = side.tensor.view(torch.int32) != before.view(torch.int32)  # bitwise: garbage K/V holds NaNs
    changed = sorted({int(b) for b in diff.flatten(2).any(2).nonzero()[:, 1]} - granted)
    assert not changed, f"blocks {changed} changed, but only {sorted(granted)} were granted"


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
            out.append(FrameSpec(FrameKind.DATA, unknown, draw(st.integers(0, LAYERS - 1)), start, end, ("natural", 0),
                                 ("full",), "correct", seed=seed))
        elif how == "done-unknown":
            out.append(FrameSpec(FrameKind.DONE, unknown, 0, 0, 0, ("raw", 0), ("full",), 0))
        elif how == "bad-layer":
            out.append(FrameSpec(FrameKind.DATA, ("grant", 0), LAYERS, start, end, ("natural", 0), ("full",), "correct", seed=seed))
        else:
            out.append(FrameSpec(FrameKind.DATA, ("grant", 0), draw(st.integers(0, LAYERS - 1)), start, num_tokens + 1 + end,
                                 ("natural", 0), ("full",), "correct", seed=seed))
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
            counters = {k: side.receiver.counters[k] for k in COUNTERS}
            session = Session("valid", b"", 0, (*frames, done), None, False, (num_tokens, 1))
            _, received, ended = exchange(side, session, [grant.transfer_id])
            wait_conn_threads(baseline_threads)
            delta = {k: side.receiver.counters[k] - counters[k] for k in COUNTERS}
            acks = [(h.transfer_id, AckStatus(h.aux)) for h, _ in parse_replies(received) if h.kind is FrameKind.ACK]
            assert ended == "eof" and delta["protocol_errors"] == 0 and delta["checksum_mismatch"] == 0, (ended, delta)
            assert delta["units_refused"] == sum(f.kind == FrameKind.DATA for f in noise), delta
            expected_acks = [(f.tid, AckStatus.UNKNOWN_TRANSFER) for f in frames if f.kind == FrameKind.DONE]
            assert acks == expected_acks + [(grant.transfer_id, AckStatus.OK)], acks
            assert grant.state is GrantState.COMPLETE and delta["transfers_tcp"] == 1
            for unit in units:  # what landed is what was sent
                payload = render(unit, [grant.transfer_id])[HEADER_SIZE:]
                got = b"".join(bytes(v) for v in side.cache.read(unit.layer, grant.block_ids, unit.start, unit.end))
                assert got == payload, f"layer {unit.layer} tokens [{unit.start}, {unit.end}) differ"
        finally:
            side.settle([grant])
        assert not side.reserved and len(side.free) == NUM_BLOCKS
        assert not crashes.crashes, crashes.crashes


WIRE_MALFORMED_HANDSHAKES = [
    pytest.param(b"0", id="non-object-json"),
    pytest.param(b"[" * 60_000, id="deeply-nested-json"),
    pytest.param(json.dumps(peer_dict(transports=[1])).encode(), id="non-string-transport"),
    pytest.param(json.dumps(peer_dict(auth_token=5)).encode(), id="non-string-credential"),
    pytest.param(json.dumps(peer_dict(auth_token="\ud800")).encode(), id="surrogate-credential"),
    pytest.param(json.dumps({**peer_dict(), "\ud800": 1}).encode(), id="surrogate-in-refusal-reason"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hello", WIRE_MALFORMED_HANDSHAKES)
def test_live_kv_server_refuses_malformed_hellos(decode_side, hello):
    side = decode_side
    before = side.receiver.counters["handshakes_refused"]
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
    assert side.receiver.counters["handshakes_refused"] == before + 1
    assert not crashes.crashes, crashes.crashes


@pytest.mark.timeout(60)
def test_a_failed_done_is_final(decode_side):
    side = decode_side
    rng = random.Random(1)
    baseline_threads = kv_conn_threads()
    grant = side.grant(8, rng)
    blocked, release = threading.Event(), threading.Event()
    side.loop.loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(10)))  # a busy event loop
    assert blocked.wait(5)

    def data(layer: int) -> bytes:
        return render(FrameSpec(FrameKind.DATA, ("grant", 0), layer, 0, 8, ("natural", 0), ("full",), "correct", seed=layer), [grant.transfer_id])

    done = FrameHeader(FrameKind.DONE, grant.transfer_id).pack()
    sock = socket.create_connection(side.address, timeout=5.0)
    try:
        hello = json.dumps(peer_dict()).encode()
        sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
        reply = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(reply.payload_len, socket.MSG_WAITALL)
        sock.sendall(data(0) + data(1) + done)  # layer 2 missing: INCOMPLETE
        first = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.sendall(data(2) + done)
        second = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
    finally:
        release.set()
        sock.close()
        wait_conn_threads(baseline_threads)
        side.settle([grant])
    assert AckStatus(first.aux) is AckStatus.INCOMPLETE
    assert AckStatus(second.aux) is not AckStatus.OK and grant.state is GrantState.FAILED
