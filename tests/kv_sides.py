"""Both sides of a KV handoff in one process, over real sockets (and real UCX / shared memory),
with small caches: what the kvtransfer tests drive."""

from __future__ import annotations

import threading
import time

import torch

from pdserve.addresses import join_host_port
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.kv_connector import TransferOutcome
from pdserve.kernels.reference import gather_kv
from pdserve.kvtransfer import shm_transport
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.handshake import PeerInfo, host_id
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVConnection, OutgoingTransfer
from pdserve.kvtransfer.ucx_worker import UcxWorker, ucx_available, ucx_unavailable_reason

LAYERS, HEADS, DIM = 3, 2, 8
TOKEN_BYTES = 2 * HEADS * DIM * 4
UCX_SKIP_REASON = None if ucx_available() else ucx_unavailable_reason()


def layout(block_size: int) -> KVLayout:
    return KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=block_size, dtype=torch.float32)


def peer(transports, block_size: int, **kw) -> PeerInfo:
    fields = dict(
        model_fingerprint="m",
        dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        host_id=host_id(),
        token_bytes=TOKEN_BYTES,
    )
    return PeerInfo(block_size=block_size, transports=tuple(transports), **{**fields, **kw})


class Outcomes:
    """Collects the reports of grants or transfers; each must come exactly once."""

    def __init__(self) -> None:
        self.got: dict[object, list[TransferOutcome]] = {}
        self._cond = threading.Condition()

    def reporter(self, key):
        def report(outcome: TransferOutcome) -> None:
            with self._cond:
                self.got.setdefault(key, []).append(outcome)
                self._cond.notify_all()

        return report

    def wait(self, key, timeout: float = 10.0) -> TransferOutcome:
        with self._cond:
            assert self._cond.wait_for(lambda: key in self.got, timeout), f"no outcome for {key}"
            assert len(self.got[key]) == 1, self.got[key]
            return self.got[key][0]


class Decode:
    """A decode side: a cache (in shared memory for shm), a grant ledger, a KV receiver."""

    def __init__(
        self,
        transport: str,
        block_size: int = 8,
        num_blocks: int = 32,
        lease_s: float = 10.0,
        secret: bytes | None = None,
        force_staging: bool = False,
        quarantine_s: float = 0.0,
        host: str = "127.0.0.1",
        **info,
    ) -> None:
        lay = layout(block_size)
        self.pool = shm_transport.make_pool(lay, num_blocks, torch.device("cpu")) if transport == "shm" else None
        tensor = self.pool.tensor if self.pool else torch.zeros(lay.shape(num_blocks))
        self.layers = list(tensor.unbind(0))
        self.cache = KVCacheView(self.layers, block_size, lay.token_bytes, force_staging=force_staging)
        self.ledger = GrantLedger(LAYERS, lay.token_bytes, lease_s=lease_s, quarantine_s=quarantine_s)
        self.outcomes = Outcomes()
        self._keys: dict[int, object] = {}
        self.ucx = UcxWorker() if transport == "ucx" else None
        extra = self.pool.describe() if self.pool else {}
        local = peer([transport], block_size, extra=extra, **info)
        self.receiver = KVReceiver(self.ledger, self.cache, local, host, 0, secret=secret, ucx=self.ucx)
        self.receiver.start()
        self.address = join_host_port(host, self.receiver.port)

    def grant(self, block_ids: list[int], num_tokens: int, skip_tokens: int = 0, lease_s: float | None = None) -> int:
        key = object()
        transfer_id = self.ledger.grant(
            block_ids, num_tokens, skip_tokens, self.outcomes.reporter(key), lease_s=lease_s
        )
        self._keys[transfer_id] = key
        return transfer_id

    def outcome(self, transfer_id: int, timeout: float = 10.0) -> TransferOutcome:
        return self.outcomes.wait(self._keys[transfer_id], timeout)

    def close(self) -> None:
        self.receiver.stop()
        if self.ucx:
            self.ucx.close()
        if self.pool:
            self.pool.close()


class Prefill:
    """A prefill side: a cache of random K/V and whatever connections the test opens."""

    def __init__(
        self,
        transport: str,
        block_size: int = 16,
        num_blocks: int = 16,
        faults: str = "",
        secret: bytes | None = None,
        force_staging: bool = False,
    ) -> None:
        torch.manual_seed(0)
        lay = layout(block_size)
        self.layers = list(torch.randn(lay.shape(num_blocks)).unbind(0))
        self.cache = KVCacheView(self.layers, block_size, lay.token_bytes, force_staging=force_staging)
        self.block_size = block_size
        self.ucx = UcxWorker() if transport == "ucx" else None
        self.info = peer([transport], block_size)
        self.faults = FaultPlan(faults)
        self.secret = secret
        self.outcomes = Outcomes()

    def connect(self, address: str) -> KVConnection:
        return KVConnection(address, self.info, self.cache, secret=self.secret, ucx=self.ucx, faults=self.faults)

    def ship(
        self,
        conn: KVConnection,
        transfer_id: int,
        src_blocks: list[int],
        dst_blocks: list[int],
        dst_block_size: int,
        num_tokens: int,
        chunks=(0,),
        skip_tokens: int = 0,
        first_token: int = 42,
    ) -> TransferOutcome:
        """Sends every layer of each chunk, then DONE; returns the decode side's answer."""
        transfer = self.start(
            conn, transfer_id, src_blocks, dst_blocks, dst_block_size, num_tokens, chunks, skip_tokens
        )
        return self.finish(transfer, first_token)

    def start(
        self, conn, transfer_id, src_blocks, dst_blocks, dst_block_size, num_tokens, chunks=(0,), skip_tokens=0
    ) -> OutgoingTransfer:
        transfer = conn.open(transfer_id, dst_blocks, dst_block_size, num_tokens, skip_tokens)
        bounds = [*chunks, num_tokens]
        for start, end in zip(bounds, bounds[1:]):
            for layer in range(LAYERS):
                transfer.send_layer(layer, src_blocks, start, end)
        return transfer

    def finish(self, transfer: OutgoingTransfer, first_token: int = 42, timeout: float = 10.0) -> TransferOutcome:
        transfer.finish(first_token, self.outcomes.reporter(transfer))
        return self.outcomes.wait(transfer, timeout)

    def close(self) -> None:
        if self.ucx:
            self.ucx.close()


def assert_same_tokens(src_layers, src_blocks, dst_layers, dst_blocks, n: int, start: int = 0) -> None:
    for src, dst in zip(src_layers, dst_layers):
        k1, v1 = gather_kv(src, torch.tensor(src_blocks), n)
        k2, v2 = gather_kv(dst, torch.tensor(dst_blocks), n)
        assert torch.equal(k1[start:], k2[start:]) and torch.equal(v1[start:], v2[start:])


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Polls ``condition`` until it holds or ``timeout`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()
