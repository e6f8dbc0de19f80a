"""The decode side's ledger of expected transfers, shared by every transport.

A *grant* is a set of reserved blocks a prefill worker may fill for one request. Transport
threads look grants up by id, bracket every write with ``begin_write``/``end_write`` and
report what landed; the decode worker (asyncio) awaits completion. A grant that does not
complete within its lease fails and its blocks are freed: never while a transport thread is
still writing into them, and, when peers write into our memory directly (shared memory,
CUDA IPC), only after a short quarantine so a late one-sided write cannot land in blocks
that already belong to another request.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.protocol import AckStatus

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


class TransferFailed(Exception):
    def __init__(self, reason: str, status: AckStatus = AckStatus.PROTOCOL_ERROR) -> None:
        super().__init__(reason)
        self.status = status


class GrantState(enum.Enum):
    ACTIVE = "active"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferResult:
    first_token_id: int
    transport: str
    nbytes: int


@dataclass(eq=False)
class Grant:
    transfer_id: int
    block_ids: list[int]
    num_tokens: int
    num_layers: int
    deadline: float
    future: asyncio.Future
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: GrantState = GrantState.ACTIVE
    corrupted: bool = False
    nbytes: int = 0
    owns_blocks: bool = True  # False once the engine took the blocks, or they were freed
    writers: int = 0  # transport writes in progress
    free_when_idle: bool = False  # failed during a write: the last writer frees
    pending_done: tuple[int, str, Callable[[AckStatus], None]] | None = None  # DONE seen, writes still landing
    landed: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.landed = np.zeros((self.num_layers, self.num_tokens), dtype=bool)

    @property
    def transfer_key(self) -> str:
        return f"{self.transfer_id:016x}"


class KVReceiver:
    def __init__(
        self,
        cache: CacheLayers,
        loop: asyncio.AbstractEventLoop,
        free_blocks: Callable[[list[int]], None],
        lease_s: float = DEFAULT_LEASE_S,
        quarantine_s: float = 0.0,
    ) -> None:
        self.cache = cache
        self.loop = loop
        self._free_blocks = free_blocks
        self.lease_s = lease_s
        self.quarantine_s = quarantine_s  # > 0 when peers may write into our memory directly
        self.grants: dict[int, Grant] = {}
        self.quarantined = 0
        self.counters: Counter[str] = Counter()

    # -- decode worker side (event loop) ------------------------------------------------------
    def grant(self, block_ids: list[int], num_tokens: int, lease_s: float | None = None, skip_tokens: int = 0) -> Grant:
        """Expects tokens [skip_tokens, num_tokens) of every layer in ``block_ids`` (the first
        ``skip_tokens`` are already there: shared prefix blocks)."""
        transfer_id = secrets.randbits(63)
        grant = Grant(
            transfer_id, list(block_ids), num_tokens, self.cache.num_layers,
            time.monotonic() + (lease_s or self.lease_s), self.loop.create_future(),
        )
        grant.landed[:, :skip_tokens] = True
        self.grants[transfer_id] = grant
        return grant

    async def wait(self, grant: Grant) -> TransferResult:
        """The transfer's result; raises TransferFailed (its blocks are then being freed)."""
        timeout = max(0.0, grant.deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(grant.future), timeout)
        except asyncio.TimeoutError:
            self.counters["lease_expired"] += 1
            self.fail(grant, "lease expired before the KV cache arrived")
            raise TransferFailed("lease expired before the KV cache arrived") from None

    def take(self, grant: Grant) -> list[int]:
        """Hands a completed grant's blocks to the engine."""
        with grant.lock:
            assert grant.state is GrantState.COMPLETE
            grant.owns_blocks = False
        self.grants.pop(grant.transfer_id, None)
        return grant.block_ids

    def fail(self, grant: Grant, reason: str, status: AckStatus = AckStatus.PROTOCOL_ERROR) -> None:
        """Ends an active grant (cancel, expiry, error); never blocks. No-op once complete or failed."""
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return
            grant.state = GrantState.FAILED
        self._cleanup_failed(grant, reason, status)

    def _cleanup_failed(self, grant: Grant, reason: str, status: AckStatus) -> None:
        """After a grant turned FAILED: free its blocks (now, or by the last writer) and tell the waiter."""
        with grant.lock:
            release = grant.owns_blocks and grant.writers == 0
            grant.free_when_idle = grant.owns_blocks and grant.writers > 0
            if release:
                grant.owns_blocks = False
            pending, grant.pending_done = grant.pending_done, None
        self.grants.pop(grant.transfer_id, None)
        if release:
            self._release(grant.block_ids)
        if pending is not None:
            pending[2](AckStatus.INCOMPLETE)
        self._resolve(grant, TransferFailed(reason, status))

    def reap_expired(self) -> int:
        now = time.monotonic()
        expired = [g for g in list(self.grants.values()) if g.deadline < now and g.state is GrantState.ACTIVE]
        for grant in expired:
            log.warning("transfer %s: lease expired, freeing %d blocks", grant.transfer_key, len(grant.block_ids))
            self.counters["lease_expired"] += 1
            self.fail(grant, "lease expired before the KV cache arrived")
        return len(expired)

    @property
    def num_active(self) -> int:
        return len(self.grants) + self.quarantined

    # -- transport side (any thread) ------------------------------------------------------------
    def lookup(self, transfer_id: int) -> Grant | None:
        return self.grants.get(transfer_id)

    def check_range(self, grant: Grant, layer: int, start: int, end: int, nbytes: int) -> str | None:
        """Why a unit may not be written into this grant, or None."""
        if not 0 <= layer < grant.num_layers:
            return f"layer {layer} out of range"
        if not 0 <= start < end <= grant.num_tokens:
            return f"tokens [{start}, {end}) outside the {grant.num_tokens} granted"
        if nbytes != (end - start) * self.cache.token_bytes:
            return f"{nbytes} bytes do not match {end - start} tokens"
        if grant.landed[layer, start:end].any():
            return f"tokens [{start}, {end}) of layer {layer} sent twice"
        return None

    def begin_write(self, grant: Grant) -> bool:
        """A transport is about to write into the grant's blocks; False: it must discard instead."""
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return False
            grant.writers += 1
            return True

    def end_write(self, grant: Grant, layer: int, start: int, end: int, checksum_ok: bool | None) -> None:
        """``checksum_ok`` None: the write broke off and nothing landed."""
        release = False
        with grant.lock:
            grant.writers -= 1
            if checksum_ok is not None:
                grant.landed[layer, start:end] = True
                grant.nbytes += (end - start) * self.cache.token_bytes
            if checksum_ok is False:
                grant.corrupted = True
                self.counters["checksum_mismatch"] += 1
            if grant.free_when_idle and grant.writers == 0:
                grant.free_when_idle = grant.owns_blocks = False
                release = True
            deferred = grant.pending_done if grant.writers == 0 else None
            if deferred is not None:
                grant.pending_done = None
        if release:
            self._release(grant.block_ids)
        if deferred is not None:
            deferred[2](self.finish(grant, deferred[0], deferred[1]))

    def finish(self, grant: Grant, first_token_id: int, transport: str, reply: Callable[[AckStatus], None] | None = None) -> AckStatus | None:
        """The sender is done: verify coverage and integrity, then complete or fail. Returns
        None when writes are still landing; ``reply`` then gets the status later."""
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return AckStatus.UNKNOWN_TRANSFER
            if grant.writers and reply is not None:
                grant.pending_done = (first_token_id, transport, reply)
                return None
            if grant.corrupted:
                status, reason = AckStatus.CHECKSUM_MISMATCH, "KV checksum mismatch: the cache arrived corrupted"
            elif not grant.landed.all():
                status, reason = AckStatus.INCOMPLETE, "transfer finished with K/V missing"
            else:
                grant.state = GrantState.COMPLETE
                self.counters[f"transfers_{transport}"] += 1
                self.counters[f"bytes_{transport}"] += grant.nbytes
                log.debug("transfer %s complete over %s (%d bytes)", grant.transfer_key, transport, grant.nbytes)
                self._resolve(grant, TransferResult(first_token_id, transport, grant.nbytes))
                return AckStatus.OK
            grant.state = GrantState.FAILED  # final now: no later DONE may complete it
        self.loop.call_soon_threadsafe(self._cleanup_failed, grant, reason, status)
        return status

    # -- internals ----------------------------------------------------------------------------
    def _release(self, block_ids: list[int]) -> None:
        if self.quarantine_s <= 0:
            self._free_blocks(block_ids)
            return
        self.quarantined += 1

        def free() -> None:
            self.quarantined -= 1
            self._free_blocks(block_ids)

        self.loop.call_soon_threadsafe(self.loop.call_later, self.quarantine_s, free)

    def _resolve(self, grant: Grant, outcome: TransferResult | Exception) -> None:
        def settle() -> None:
            if grant.future.done():
                return
            if isinstance(outcome, Exception):
                grant.future.set_exception(outcome)
                grant.future.exception()  # mark retrieved: a cancelled waiter may never read it
            else:
                grant.future.set_result(outcome)

        self.loop.call_soon_threadsafe(settle)
