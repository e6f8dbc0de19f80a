"""The decode side's grant ledger: leases (and what renews them), the race between expiry and
completion, writes in progress, quarantine; every grant is reported exactly once."""

from __future__ import annotations

import time

from kv_sides import LAYERS, TOKEN_BYTES, Decode, Outcomes, Prefill

from pdserve.kvtransfer.grants import GrantLedger, GrantState
from pdserve.kvtransfer.protocol import AckStatus


def ledger_with_grant(num_tokens: int = 8, lease_s: float = 10.0, quarantine_s: float = 0.0):
    ledger, outcomes = GrantLedger(LAYERS, TOKEN_BYTES, lease_s=lease_s, quarantine_s=quarantine_s), Outcomes()
    tid = ledger.grant([1, 2], num_tokens, 0, outcomes.reporter("g"))
    return ledger, outcomes, tid


def land_everything(ledger: GrantLedger, tid: int, num_tokens: int = 8) -> None:
    for layer in range(LAYERS):
        grant = ledger.admit(tid, layer, 0, num_tokens, num_tokens * TOKEN_BYTES, "DATA")
        ledger.end_write(grant, layer, 0, num_tokens, True)


def test_lease_expiry_fails_the_grant_once():
    ledger, outcomes, tid = ledger_with_grant(lease_s=0.05)
    assert ledger.reap_expired() == 0
    time.sleep(0.06)
    assert ledger.reap_expired() == 1 and ledger.reap_expired() == 0
    outcome = outcomes.wait("g")
    assert not outcome.ok and "lease expired" in outcome.reason
    assert ledger.counters["lease_expired"] == 1 and ledger.num_active == 0


def test_completion_just_before_expiry_stays_complete():
    """Issue 13, defect 3: a grant completed as its lease ran out used to stay complete and
    leak its blocks while the waiter was told it had expired."""
    ledger, outcomes, tid = ledger_with_grant(lease_s=10)
    grant = ledger.lookup(tid)
    land_everything(ledger, tid)
    assert ledger.finish(grant, 7, "tcp") is AckStatus.OK
    assert ledger.reap_expired(now=time.monotonic() + 60) == 0  # the expiry comes too late: nothing happens
    outcome = outcomes.wait("g")
    assert outcome.ok and outcome.first_token_id == 7
    assert grant.state is GrantState.COMPLETE and ledger.num_active == 0 and ledger.counters["lease_expired"] == 0


def test_expiry_just_before_completion_wins_and_the_done_is_refused():
    ledger, outcomes, tid = ledger_with_grant(lease_s=10)
    grant = ledger.lookup(tid)
    land_everything(ledger, tid)
    assert ledger.reap_expired(now=time.monotonic() + 60) == 1
    assert ledger.finish(grant, 7, "tcp") is AckStatus.UNKNOWN_TRANSFER
    assert not outcomes.wait("g").ok and ledger.num_active == 0


def test_a_failure_during_a_write_is_reported_when_the_write_ends():
    ledger, outcomes, tid = ledger_with_grant()
    grant = ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES, "DATA")
    cancelled = []
    ledger.on_cancel(grant, lambda: cancelled.append(True))
    ledger.cancel(tid, "request gone")
    assert cancelled == [True] and "g" not in outcomes.got and ledger.num_active == 1  # a write is in progress
    ledger.end_write(grant, 0, 0, 8, True)
    assert not outcomes.wait("g").ok and ledger.num_active == 0


def test_one_sided_failures_are_quarantined():
    ledger, outcomes, tid = ledger_with_grant(quarantine_s=0.2)
    told = []
    assert ledger.tell_writer_at_end(ledger.lookup(tid), lambda: told.append(True))  # the writer got HELD
    started = time.monotonic()
    ledger.cancel(tid, "request gone")
    assert told == [True] and "g" not in outcomes.got and ledger.num_active == 1
    outcomes.wait("g")
    assert time.monotonic() - started >= 0.2 and ledger.num_active == 0


def test_a_grant_no_one_sided_writer_was_told_of_is_released_at_once():
    """Only a writer that heard HELD writes into our memory: with none, nothing can land late."""
    ledger, outcomes, tid = ledger_with_grant(quarantine_s=30.0)
    grant = ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES, "DATA")  # a two-sided write, over
    ledger.end_write(grant, 0, 0, 8, True)
    ledger.cancel(tid, "request gone")
    assert [o.ok for o in outcomes.got["g"]] == [False] and ledger.num_active == 0
    assert not ledger.tell_writer_at_end(grant, lambda: None)  # and no writer can be told any more


def test_a_done_that_arrives_before_the_last_write_waits_for_it():
    ledger, outcomes, tid = ledger_with_grant()
    grant = ledger.lookup(tid)
    for layer in range(LAYERS - 1):
        ledger.end_write(ledger.admit(tid, layer, 0, 8, 8 * TOKEN_BYTES, "DATA"), layer, 0, 8, True)
    last = ledger.admit(tid, LAYERS - 1, 0, 8, 8 * TOKEN_BYTES, "UCX_DATA")  # still landing
    replies = []
    assert ledger.finish(grant, 3, "ucx", reply=replies.append) is None
    ledger.end_write(last, LAYERS - 1, 0, 8, True)
    assert replies == [AckStatus.OK] and outcomes.wait("g").ok


def test_a_range_still_landing_is_not_admitted_again():
    """A peer repeating a unit while its first copy lands would hold a receive (and a buffer)
    per repeat, renewing the lease each time; a broken write may be sent again."""
    ledger, outcomes, tid = ledger_with_grant()
    first = ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES, "UCX_DATA")
    assert first is not None
    assert ledger.admit(tid, 0, 4, 8, 4 * TOKEN_BYTES, "UCX_DATA") is None  # overlaps the write in progress
    assert ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES * 2, "UCX_DATA", num_layers=2) is None
    assert ledger.lookup(tid).writers == 1 and ledger.counters["units_refused"] == 2
    ledger.end_write(first, 0, 0, 8, None)  # broke off: nothing landed
    again = ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES, "DATA")
    assert again is not None
    ledger.end_write(again, 0, 0, 8, True)
    assert ledger.admit(tid, 0, 0, 8, 8 * TOKEN_BYTES, "DATA") is None  # landed: a repeat is refused as before
    for layer in range(1, LAYERS):
        ledger.end_write(ledger.admit(tid, layer, 0, 8, 8 * TOKEN_BYTES, "DATA"), layer, 0, 8, True)
    assert ledger.finish(ledger.lookup(tid), 5, "tcp") is AckStatus.OK and outcomes.wait("g").ok


def test_the_lease_covers_a_prefill_queued_longer_than_it():
    """Issue 13, defect 4: with a prefill backlog longer than the lease, every disaggregated
    request failed after its prefill work was spent. The prefill worker now renews the lease
    of each transfer it holds until it sends DONE."""
    lease_s = 1.0  # renewed every third of it: a loaded machine may delay one by a few 100 ms
    decode, prefill = Decode("tcp", lease_s=lease_s), Prefill("tcp")
    try:
        conn = prefill.connect(decode.address)
        assert conn.renew_interval_s < lease_s / 2
        tid = decode.grant([1, 2], 12)
        transfer = conn.open(tid, [1, 2], 8, 12)  # the request waits in the prefill queue...
        deadline = time.monotonic() + 3 * lease_s
        while time.monotonic() < deadline:  # ...three leases long, the reaper running
            assert decode.ledger.reap_expired() == 0
            time.sleep(0.05)
        for layer in range(LAYERS):
            transfer.send_layer(layer, [0], 0, 12)
        assert prefill.finish(transfer).ok and decode.outcome(tid).ok

        tid2 = decode.grant([3, 4], 12)  # a transfer nobody renews any more does expire
        abandoned = conn.open(tid2, [3, 4], 8, 12)
        abandoned.cancel()
        deadline = time.monotonic() + 5 * lease_s
        while not decode.ledger.reap_expired() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not decode.outcome(tid2).ok
        conn.close()
    finally:
        prefill.close()
        decode.close()
