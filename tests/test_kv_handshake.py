"""The KV handshake: layout compatibility, the HMAC challenge-response (the credential never
on the wire, both sides proven), negotiation, transport availability, the model fingerprint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch
from kv_sides import Decode, Prefill, peer, wait_until
from processes import can_mount_private_shm
from safetensors.torch import save_file

from pdserve.kvtransfer import registry
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.fingerprint import model_fingerprint
from pdserve.kvtransfer.handshake import HandshakeError, choose, client_handshake
from pdserve.kvtransfer.protocol import HEADER_SIZE, FrameHeader, FrameKind

SECRET = b"s3cret-cluster-token"


def test_handshake_refuses_another_layout():
    decode = Decode("tcp", dtype="bfloat16")
    try:
        with pytest.raises(HandshakeError, match="dtype"):
            Prefill("tcp").connect(decode.address)
        assert decode.ledger.counters["handshakes_refused"] == 1
    finally:
        decode.close()
    decode = Decode("tcp", token_bytes=999)  # e.g. a quantized cache with other scales
    try:
        with pytest.raises(HandshakeError, match="token_bytes"):
            Prefill("tcp").connect(decode.address)
    finally:
        decode.close()


def test_credentials_are_proven_both_ways():
    decode = Decode("tcp", secret=SECRET)
    try:
        with pytest.raises(HandshakeError, match="unauthenticated"):
            Prefill("tcp", secret=b"wrong").connect(decode.address)
        with pytest.raises(HandshakeError, match="requires the cluster credential"):
            Prefill("tcp").connect(decode.address)
        assert decode.ledger.counters["handshakes_refused"] == 1  # the second one gave up on its own
        conn = Prefill("tcp", secret=SECRET).connect(decode.address)
        conn.close()
    finally:
        decode.close()
    open_decode = Decode("tcp")  # holds no credential: a prefill worker that has one refuses it
    try:
        with pytest.raises(HandshakeError, match="could not prove"):
            Prefill("tcp", secret=SECRET).connect(open_decode.address)
    finally:
        open_decode.close()


def test_the_credential_never_crosses_the_wire():
    """A fake decode worker records every byte the prefill side sends while authenticating."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def fake_decode() -> None:
        conn, _ = listener.accept()
        with conn:
            header = FrameHeader.unpack(conn.recv(HEADER_SIZE, socket.MSG_WAITALL))
            received.extend(conn.recv(header.payload_len, socket.MSG_WAITALL))
            nonce = b"n" * 32
            conn.sendall(FrameHeader(FrameKind.CHALLENGE, payload_len=len(nonce)).pack() + nonce)
            while chunk := conn.recv(4096):
                received.extend(chunk)
                break
            reason = b"recorded"
            conn.sendall(FrameHeader(FrameKind.REJECT, payload_len=len(reason)).pack() + reason)

    thread = threading.Thread(target=fake_decode)
    thread.start()
    sock = socket.create_connection(listener.getsockname())
    try:
        with pytest.raises(HandshakeError, match="recorded"):
            client_handshake(sock, peer(["tcp"], 16), SECRET, "fake")
    finally:
        sock.close()
        thread.join(5)
        listener.close()
    assert received and SECRET not in received and SECRET.hex().encode() not in received
    assert "auth_token" not in json.loads(received[: received.index(b"}", received.rindex(b'"proof"')) + 1])


def test_negotiation_order_and_host_rules():
    cpu, gpu_like = peer(["ucx", "shm", "tcp"], 16), peer(["cuda_ipc", "ucx", "shm", "tcp"], 16)
    assert choose(cpu, peer(["shm", "tcp"], 16)) == "shm"
    assert choose(cpu, cpu) == "ucx"
    far = replace(peer(["shm", "tcp"], 16), host_id="elsewhere")
    assert choose(cpu, far) == "tcp"  # shared memory needs one host
    with pytest.raises(HandshakeError, match="no common KV transport"):
        choose(peer(["shm"], 16), far)
    # CUDA IPC only when the prefill worker sees the decode worker's GPU (by PCI bus id).
    decode = replace(gpu_like, extra={"cuda_ipc": {"pci_bus_id": "0000:41:00.0"}})
    assert choose(decode, replace(gpu_like, extra={"cuda_devices": ["0000:41:00.0"]})) == "cuda_ipc"
    assert choose(decode, replace(gpu_like, extra={"cuda_devices": ["0000:01:00.0"]})) == "ucx"


def test_the_registry_is_the_one_list_of_transports():
    assert registry.TRANSPORT_NAMES == ("cuda_ipc", "ucx", "shm", "tcp")
    assert registry.TRANSPORT_CHOICES[0] == "auto"
    assert {t.name for t in registry.TRANSPORTS if t.one_sided} == {"cuda_ipc", "shm"}
    assert registry.pool_transport(("ucx", "shm", "tcp")).name == "shm"
    assert registry.pool_transport(("ucx", "tcp")) is None
    for spec in registry.TRANSPORTS:  # each module implements both halves
        module = spec.load()
        assert hasattr(module, "Sender") and hasattr(module, "Receiver") and callable(module.unavailable_reason)
        assert hasattr(module, "make_pool") == (spec.pool is not None)


def test_forcing_an_unavailable_transport_fails_with_a_reason(monkeypatch):
    with pytest.raises(ValueError, match="cuda_ipc.*CPU"):
        registry.offered_transports("cuda_ipc", torch.device("cpu"))
    from pdserve.kvtransfer import ucx_transport

    monkeypatch.setattr(ucx_transport, "ucx_available", lambda: False)
    with pytest.raises(ValueError, match="pip install 'pdserve\\[ucx\\]'"):
        registry.offered_transports("ucx", torch.device("cpu"))
    assert registry.offered_transports("auto", torch.device("cpu")) == ("shm", "tcp")
    with pytest.raises(ValueError, match="kv_transport"):
        registry.offered_transports("carrier-pigeon", torch.device("cpu"))


def test_fault_plan_parsing():
    plan = FaultPlan("corrupt=2,stall=1")
    assert [plan.take("corrupt") for _ in range(3)] == [True, True, False]
    assert plan.take("stall") and not plan.take("stall")
    with pytest.raises(ValueError):
        FaultPlan("explode=1")


def _model(folder, tensors: dict, shards: int = 1):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    names = sorted(tensors)
    for i in range(shards):
        save_file({n: tensors[n] for n in names[i::shards]}, str(folder / f"model-{i}.safetensors"))
    return folder


def test_the_fingerprint_hashes_weight_content(tmp_path):
    """Issue 13, defect 6: two fine-tunes of one base model (same config, names and sizes)
    must not accept each other's KV."""
    torch.manual_seed(0)
    base = {"embed.weight": torch.randn(16, 8), "layer.0.weight": torch.randn(8, 8), "norm.weight": torch.ones(8)}
    tuned = {**base, "layer.0.weight": base["layer.0.weight"] + 1e-3}
    cache = tmp_path / "cache"
    a = model_fingerprint(_model(tmp_path / "base", base), cache)
    b = model_fingerprint(_model(tmp_path / "tuned", tuned), cache)
    resharded = model_fingerprint(_model(tmp_path / "resharded", base, shards=2), cache)
    assert a != b
    assert a == resharded  # the same weights, however they are split into files
    assert len(list((cache / "fingerprints").glob("*.json"))) == 4  # computed once per file...
    assert model_fingerprint(tmp_path / "base", cache) == a  # ...and read back


def test_peers_that_never_finish_their_handshake_are_dropped_and_cannot_stop_the_listener(monkeypatch):
    """A peer trickling a byte at a time is cut off at the handshake's deadline for the whole
    handshake; past MAX_HANDSHAKING waiting (or MAX_HANDSHAKING_PER_HOST from one address) the
    oldest makes room; a thread that cannot start costs only its connection. Through all of it, a proper prefill side still connects."""
    import time

    from pdserve.kvtransfer import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "HANDSHAKE_TIMEOUT_S", 1.5)

    monkeypatch.setattr(receiver_module, "MAX_HANDSHAKING", 3)
    decode = Decode("tcp", secret=SECRET)
    hello = FrameHeader(FrameKind.HELLO, payload_len=1000).pack()
    slow = [socket.create_connection(("127.0.0.1", decode.receiver.port)) for _ in range(3)]
    try:
        started = time.monotonic()
        for sock in slow:
            sock.sendall(hello)  # a HELLO of 1000 bytes, which then come one at a time
        dropped = set()
        while len(dropped) < len(slow) and time.monotonic() - started < 15:
            for i, sock in enumerate(slow):  # each socket read's own timeout is never reached
                if i not in dropped:
                    try:
                        sock.sendall(b"{")
                    except OSError:
                        dropped.add(i)
            time.sleep(0.2)
        assert dropped == {0, 1, 2} and time.monotonic() - started < 8  # the deadline, not never
        # Three in their handshake (the cap): a fourth takes the oldest one's place at once.
        monkeypatch.setattr(receiver_module, "HANDSHAKE_TIMEOUT_S", 30.0)  # the three stay in their handshake
        waiting = [socket.create_connection(("127.0.0.1", decode.receiver.port)) for _ in range(3)]
        assert wait_until(lambda: len(decode.receiver._handshaking) == 3)
        refused_before = decode.ledger.counters["handshakes_refused"]
        extra = socket.create_connection(("127.0.0.1", decode.receiver.port))
        waiting[0].settimeout(5)
        asked = time.monotonic()
        assert waiting[0].recv(1) == b"" and time.monotonic() - asked < 5  # closed without a word
        assert decode.ledger.counters["handshakes_refused"] == refused_before + 1
        # Peers that hold every slot without a word cannot keep a proper prefill side out...
        Prefill("tcp", secret=SECRET).connect(decode.address).close()
        for sock in [*waiting, extra]:
            sock.close()
        assert wait_until(lambda: not decode.receiver._handshaking)
        # ...nor can one address crowd out another: its own oldest make room for it.
        monkeypatch.setattr(receiver_module, "MAX_HANDSHAKING_PER_HOST", 2)
        bystander = socket.create_connection(("127.0.0.1", decode.receiver.port))
        assert wait_until(lambda: len(decode.receiver._handshaking) == 1)
        flood = [
            socket.create_connection(("127.0.0.1", decode.receiver.port), source_address=("127.0.0.2", 0))
            for _ in range(5)
        ]
        assert wait_until(lambda: len(decode.receiver._handshaking) == 3)
        bystander.settimeout(0.5)
        with pytest.raises(TimeoutError):
            bystander.recv(1)  # still waiting in its handshake, not dropped
        for sock in [bystander, *flood]:
            sock.close()
        assert wait_until(lambda: not decode.receiver._handshaking)
        # No thread for a connection: that one is dropped, the next is served.
        real_thread = threading.Thread
        failures = iter([RuntimeError("can't start new thread")])

        def one_failed_start(*args, **kwargs):
            thread = real_thread(*args, **kwargs)
            if kwargs.get("name") == "kv-conn" and (failure := next(failures, None)):

                def start() -> None:
                    raise failure

                thread.start = start
            return thread

        monkeypatch.setattr(receiver_module.threading, "Thread", one_failed_start)
        refused = socket.create_connection(("127.0.0.1", decode.receiver.port))
        refused.settimeout(5)
        assert refused.recv(1) == b""
        refused.close()
        Prefill("tcp", secret=SECRET).connect(decode.address).close()
    finally:
        for sock in slow:
            sock.close()
        decode.close()


@pytest.mark.skipif(not can_mount_private_shm(), reason="a private /dev/shm needs unshare and CAP_SYS_ADMIN")
def test_a_process_with_its_own_dev_shm_is_another_host_for_shared_memory():
    """Containers on the host's network share its hostname and boot id, not a private /dev/shm:
    shm between them must not be chosen (its segments are not there)."""
    from pdserve.kvtransfer.handshake import host_id

    script = "from pdserve.kvtransfer.handshake import host_id; print(host_id())"
    private = subprocess.run(
        [
            *("unshare", "-m", "--propagation", "private", "sh", "-c"),
            'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
            *("sh", sys.executable, "-c", script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    shared = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert shared.stdout.strip() == host_id()  # the same memory: the same identity
    assert private and private != host_id()
    assert choose(peer(["shm", "tcp"], 16), replace(peer(["shm", "tcp"], 16), host_id=private)) == "tcp"


def test_other_weights_are_refused_even_where_the_slots_agree():
    """int8-quantized weights (or fp32 ones feeding an 8-bit cache) make K/V of the same shape
    and format, and a decode worker continuing from them matches neither deployment."""
    mine = peer(["tcp"], 16, weights="float32/none")
    for other in ("float32/int8", "bfloat16/none"):
        with pytest.raises(HandshakeError, match="--dtype/--quantization"):
            mine.check_compatible(replace(mine, weights=other))
    mine.check_compatible(replace(mine, weights="float32/none"))
