"""The decode side's ledger of grants: reserved blocks a prefill worker may fill for one request.

A grant is ACTIVE until it COMPLETEs (every layer of every expected token landed, checksums
right, DONE received) or FAILs (checksum mismatch, missing K/V, cancel, an expired lease).
Every transition happens under the grant's lock, so completion and expiry cannot both win,
and the engine hears the outcome exactly once, through the grant's ``report``: at once for
a completion, and for a failure only when nothing can land in its blocks any more (no write
in progress, UCX receives finished or cancelled, and, when peers write into our memory
directly and one was told it may, a short quarantine against its late write).

The lease starts with the grant and is renewed by every sign of life from the prefill side
(a unit, or a RENEW while the request waits in the prefill worker's queue); the owner calls
``reap_expired`` periodically.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pdserve.engine.kv_connector import Report, TransferOutcome
from pdserve.event_counts import EventCounts
from pdserve.kvtransfer.layout import KVCacheView, Slots
from pdserve.kvtransfer.protocol import AckStatus

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


class GrantState(enum.Enum):
    ACTIVE = "active"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class Grant:
    transfer_id: int
    block_ids: list[int]
    num_tokens: int
    num_layers: int
    report: Report
    lease_s: float
    deadline: float
    skip_tokens: int = 0  # leading tokens already there (shared prefix blocks): never written
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: GrantState = GrantState.ACTIVE
    corrupted: bool = False
    nbytes: int = 0
    writers: int = 0  # writes in progress (a TCP payload being read, a posted UCX receive, ...)
    cancellers: list[Callable[[], None]] = field(default_factory=list)  # stop the writes in progress
    writer_told: bool = False  # a one-sided writer hears of its end (``tell_writer_at_end``)
    pending_done: tuple[int, str, Callable[[AckStatus], None], tuple[int, ...]] | None = (
        None  # DONE seen, writes still landing
    )
    failure: TransferOutcome | None = None  # set when FAILED; reported once the blocks are safe
    landed: np.ndarray = field(init=False)  # [layer, token]: arrived (checked at DONE)
    writing: np.ndarray = field(init=False)  # [layer, token]: a write admitted and not ended yet
    _slots: tuple[int, int, Slots] | None = None  # the last token range's slots: every layer reuses them

    def __post_init__(self) -> None:
        self.landed = np.zeros((self.num_layers, self.num_tokens), dtype=bool)
        self.writing = np.zeros_like(self.landed)

    def slots(self, cache: KVCacheView, start: int, end: int) -> Slots:
        """Where tokens [start, end) of this grant live in ``cache`` (computed once per range)."""
        last = self._slots
        if last is None or last[:2] != (start, end):
            last = self._slots = (start, end, cache.slots(self.block_ids, start, end))
        return last[2]

    @property
    def transfer_key(self) -> str:
        return f"{self.transfer_id:016x}"


class GrantLedger:
    """Implements the engine's ``IncomingKV``; transport threads call the rest."""

    def __init__(
        self, num_layers: int, token_bytes: int, lease_s: float = DEFAULT_LEASE_S, quarantine_s: float = 0.0
    ) -> None:
        self.num_layers = num_layers
        self.token_bytes = token_bytes
        self.lease_s = lease_s
        self.quarantine_s = quarantine_s  # > 0 when peers may write into our memory directly
        self.grants: dict[int, Grant] = {}
        self.releasing = 0  # failed grants whose blocks are not safe yet
        self.counters = EventCounts()  # bumped on connection threads and the event loop
        self._lock = threading.Lock()  # guards ``grants`` and ``releasing``

    # -- the engine side -----------------------------------------------------------------------
    def grant(
        self, block_ids: list[int], num_tokens: int, skip_tokens: int, report: Report, lease_s: float | None = None
    ) -> int:
        """Expects tokens [skip_tokens, num_tokens) of every layer in ``block_ids`` (the first
        ``skip_tokens`` are already there: shared prefix blocks). Returns the transfer id."""
        lease = lease_s or self.lease_s
        grant = Grant(
            secrets.randbits(63),
            list(block_ids),
            num_tokens,
            self.num_layers,
            report,
            lease,
            time.monotonic() + lease,
            skip_tokens=skip_tokens,
        )
        grant.landed[:, :skip_tokens] = True
        with self._lock:
            self.grants[grant.transfer_id] = grant
        return grant.transfer_id

    def cancel(self, transfer_id: int, reason: str) -> None:
        grant = self.lookup(transfer_id)
        if grant is not None:
            self.fail(grant, reason)

    def reap_expired(self, now: float | None = None) -> int:
        """Fails every active grant whose lease has run out; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [g for g in self.grants.values() if g.deadline < now and g.state is GrantState.ACTIVE]
        expired = 0
        for grant in due:
            if self.fail(grant, "lease expired before the KV cache arrived"):
                log.warning("transfer %s: lease expired, freeing %d blocks", grant.transfer_key, len(grant.block_ids))
                self.counters.add("lease_expired")
                expired += 1
        return expired

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self.grants) + self.releasing

    # -- transport threads ---------------------------------------------------------------------
    def lookup(self, transfer_id: int) -> Grant | None:
        with self._lock:
            return self.grants.get(transfer_id)

    def tell_writer_at_end(self, grant: Grant, tell: Callable[[], None]) -> bool:
        """For a writer into our memory: ``tell`` runs as the grant fails, so the writer stops
        long before the quarantine ends (registered once). False if the grant has ended."""
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return False
            if not grant.writer_told:
                grant.writer_told = True
                grant.cancellers.append(tell)
            return True

    def renew(self, grant: Grant) -> None:
        with grant.lock:
            if grant.state is GrantState.ACTIVE:
                grant.deadline = time.monotonic() + grant.lease_s

    def admit(
        self, transfer_id: int, layer: int, start: int, end: int, nbytes: int, what: str, num_layers: int = 1
    ) -> Grant | None:
        """The grant a unit (tokens [start, end) of layers [layer, layer + num_layers)) may write
        into (its write has begun: call ``end_write``), or None (refused, counted and logged).
        Renews the lease."""
        grant = self.lookup(transfer_id)
        problem = (
            "unknown or finished transfer"
            if grant is None
            else self._check_range(grant, layer, start, end, nbytes, num_layers)
        )
        if problem is None:
            rows, cols = slice(layer, layer + num_layers), slice(start, end)
            with grant.lock:
                if grant.state is not GrantState.ACTIVE:
                    problem = "transfer ended"
                elif grant.landed[rows, cols].any() or grant.writing[rows, cols].any():
                    # Also while the first copy is still landing: each admitted write holds a
                    # receive (and maybe a buffer) until it ends.
                    problem = f"tokens [{start}, {end}) of layers [{layer}, {layer + num_layers}) sent twice"
                else:
                    grant.writing[rows, cols] = True
                    grant.writers += 1
                    grant.deadline = time.monotonic() + grant.lease_s
                    return grant
        log.warning("KV %s unit for transfer %016x refused: %s", what, transfer_id, problem)
        self.counters.add("units_refused")
        return None

    def _check_range(self, grant: Grant, layer: int, start: int, end: int, nbytes: int, num_layers: int) -> str | None:
        if not (0 <= layer and 1 <= num_layers and layer + num_layers <= grant.num_layers):
            return f"layers [{layer}, {layer + num_layers}) out of range"
        if not 0 <= start < end <= grant.num_tokens:
            return f"tokens [{start}, {end}) outside the {grant.num_tokens} granted"
        if nbytes != (end - start) * self.token_bytes * num_layers:
            return f"{nbytes} bytes do not match {end - start} tokens of {num_layers} layers"
        return None

    def on_cancel(self, grant: Grant, canceller: Callable[[], None]) -> None:
        """Registers how to stop a write in progress (called if the grant fails first)."""
        with grant.lock:
            if grant.state is GrantState.ACTIVE:
                grant.cancellers.append(canceller)
                return
        canceller()

    def end_write(
        self,
        grant: Grant,
        layer: int,
        start: int,
        end: int,
        checksum_ok: bool | None,
        canceller: Callable[[], None] | None = None,
        num_layers: int = 1,
    ) -> None:
        """A write admitted by ``admit`` is over. ``checksum_ok`` None: it broke off and
        nothing usable landed."""
        with grant.lock:
            grant.writers -= 1
            grant.writing[layer : layer + num_layers, start:end] = False  # a broken write may be sent again
            if canceller is not None and canceller in grant.cancellers:
                grant.cancellers.remove(canceller)
            if grant.state is GrantState.ACTIVE and checksum_ok is not None:
                grant.landed[layer : layer + num_layers, start:end] = True
                grant.nbytes += (end - start) * self.token_bytes * num_layers
                if not checksum_ok:
                    grant.corrupted = True
                    self.counters.add("checksum_mismatch")
                    # Memory, a NIC or the shared segment corrupted data: worth an operator's look.
                    log.warning(
                        "transfer %s: checksum mismatch in layers %d-%d, tokens [%d, %d): the transfer is refused",
                        grant.transfer_key,
                        layer,
                        layer + num_layers - 1,
                        start,
                        end,
                    )
            release = grant.state is GrantState.FAILED and grant.writers == 0
            deferred = grant.pending_done if grant.writers == 0 else None
            if deferred is not None:
                grant.pending_done = None
        if release:
            self._release(grant)
        if deferred is not None:
            deferred[2](self.finish(grant, deferred[0], deferred[1], more_token_ids=deferred[3]))

    def finish(
        self,
        grant: Grant,
        first_token_id: int,
        transport: str,
        reply: Callable[[AckStatus], None] | None = None,
        more_token_ids: tuple[int, ...] = (),
        tokens_intact: bool = True,
    ) -> AckStatus | None:
        """The sender is done: verify coverage and integrity, then complete or fail. Returns
        None when writes are still landing; ``reply`` then gets the status later.
        ``more_token_ids``: the other choices' first tokens (n > 1); ``tokens_intact``: whether
        the DONE frame that carried the tokens passed its checksum."""
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return AckStatus.UNKNOWN_TRANSFER
            if not tokens_intact and not grant.corrupted:
                grant.corrupted = True
                self.counters.add("checksum_mismatch")
                log.warning(
                    "transfer %s: checksum mismatch in its first tokens: the transfer is refused", grant.transfer_key
                )
            if grant.writers and reply is not None:
                grant.pending_done = (first_token_id, transport, reply, more_token_ids)
                return None
            if grant.corrupted:
                status = AckStatus.CHECKSUM_MISMATCH
                failure = TransferOutcome(False, "KV checksum mismatch: the cache arrived corrupted", corrupted=True)
            elif not grant.landed.all():
                status, failure = AckStatus.INCOMPLETE, TransferOutcome(False, "transfer finished with K/V missing")
            else:
                grant.state = GrantState.COMPLETE
                status, failure = AckStatus.OK, None
        if failure is not None:
            self._fail_now(grant, failure)
            return status
        with self._lock:
            self.grants.pop(grant.transfer_id, None)
        self.counters.add(f"transfers_{transport}")
        self.counters.add(f"bytes_{transport}", grant.nbytes)
        grant.report(
            TransferOutcome(
                True,
                first_token_id=first_token_id,
                transport=transport,
                nbytes=grant.nbytes,
                more_first_token_ids=tuple(more_token_ids),
            )
        )
        return AckStatus.OK

    def fail(self, grant: Grant, reason: str) -> bool:
        """Ends an active grant (cancel, expiry, a broken connection); False if it had ended."""
        return self._fail_now(grant, TransferOutcome(False, reason))

    # -- internals ------------------------------------------------------------------------------
    def _fail_now(self, grant: Grant, failure: TransferOutcome) -> bool:
        with grant.lock:
            if grant.state is not GrantState.ACTIVE:
                return False
            grant.state, grant.failure = GrantState.FAILED, failure
            cancellers, grant.cancellers = grant.cancellers, []
            pending, grant.pending_done = grant.pending_done, None
            release = grant.writers == 0
        with self._lock:
            self.grants.pop(grant.transfer_id, None)
            self.releasing += 1
        for cancel in cancellers:
            cancel()
        if pending is not None:
            pending[2](AckStatus.INCOMPLETE)
        if release:
            self._release(grant)
        return True

    def _release(self, grant: Grant) -> None:
        """Reports a failed grant once its blocks are safe: after the quarantine if a one-sided
        writer was told it may write (it writes only after HELD), else at once. ``writer_told``
        no longer changes once the grant has failed."""

        def report() -> None:
            with self._lock:
                self.releasing -= 1
            grant.report(grant.failure)

        if self.quarantine_s > 0 and grant.writer_told:
            timer = threading.Timer(self.quarantine_s, report)
            timer.daemon = True
            timer.start()
        else:
            report()
