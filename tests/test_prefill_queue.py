"""The prefill worker's --max-queued-requests bounds the requests waiting for its engine, not
those already prefilled whose KV is on its way (as the decode worker counts its queue)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine.request_output import KVSent, RequestOutput
from pdserve.prefill_worker.servicer import PrefillService
from pdserve.v1 import pdserve_pb2 as pb


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details="", trailing_metadata=()):
        raise Aborted(code, details, dict(trailing_metadata))


class Loop:
    """An engine loop whose requests prefill at once, then wait for their KV acknowledgement."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(
            validate=lambda *args, **kwargs: None,
            compile_constraint=lambda sampling: None,
            config=SimpleNamespace(block_size=16, max_num_seqs=8),
        )
        self.acked = asyncio.Event()

    async def generate(self, rid, start):
        yield RequestOutput(rid, [7], None, 4, 0)  # prefilled: the first token
        await self.acked.wait()  # its KV travels to the decode worker meanwhile
        yield RequestOutput(rid, [], None, 4, 0, finished=True, kv=KVSent("tcp", 64))


def request(rid: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=rid,
        token_ids=[1, 2, 3, 4],
        sampling=pb.ResolvedSampling(max_tokens=4, temperature=0, top_p=1, n=1),
        target=pb.KvTarget(
            transfer_id=f"{len(rid):016x}", kv_address="kv:1", block_ids=[0], block_size=16, num_tokens=4
        ),
    )


async def test_requests_whose_kv_is_on_its_way_do_not_fill_the_queue():
    loop = Loop()
    transfer = SimpleNamespace(close=lambda: None)
    sender = SimpleNamespace(connection=lambda address: SimpleNamespace(open=lambda *args, **kwargs: transfer))
    service = PrefillService(loop, sender, max_queued_requests=1)
    first = asyncio.create_task(service.Prefill(request("a"), Context()))
    for _ in range(100):  # it is prefilled; its acknowledgement is still to come
        await asyncio.sleep(0.01)
        if service.queued == 0:
            break
    assert service.queued == 0 and not first.done()
    second = asyncio.create_task(service.Prefill(request("bb"), Context()))  # the queue has room
    await asyncio.sleep(0.05)
    loop.acked.set()
    answers = await asyncio.gather(first, second)
    assert [a.first_token_id for a in answers] == [7, 7] and service.queued == 0


async def test_a_full_queue_is_refused_with_a_retry_hint():
    service = PrefillService(Loop(), SimpleNamespace(), max_queued_requests=1)
    service._waiting.add("other")  # one waits for the engine
    with pytest.raises(Aborted) as refused:
        await service.Prefill(request("c"), Context())
    assert refused.value.args[0] is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "block_ids, block_size, field",
    [([-1], 16, "target.block_ids"), ([0], 2, "target.block_ids"), ([0], 2048, "target.block_ids")],
)
async def test_a_target_whose_blocks_cannot_be_written_is_refused_naming_the_field(block_ids, block_size, field):
    bad = request("d")
    del bad.target.block_ids[:]
    bad.target.block_ids.extend(block_ids)
    bad.target.block_size = block_size
    service = PrefillService(Loop(), SimpleNamespace(), max_queued_requests=1)
    with pytest.raises(Aborted) as refused:
        await service.Prefill(bad, Context())
    assert refused.value.args[0] is grpc.StatusCode.INVALID_ARGUMENT and refused.value.args[1].startswith(field)


@pytest.mark.parametrize("corrupted", [False, True])
async def test_a_handoff_that_breaks_after_the_kv_left_charges_neither_side(corrupted):
    """A decode worker killed mid-transfer: this prefill worker says the handoff broke (the
    router charges neither side; several transfers failing at once took a healthy prefill
    worker out of rotation)."""
    from pdserve.engine.request_output import TransferFailed
    from pdserve.grpc_server import PEER_FAULT_KEY

    class BrokenHandoff(Loop):
        async def generate(self, rid, start):
            yield RequestOutput(rid, [7], None, 4, 0)
            raise TransferFailed("KV connection to kv:1 lost: Connection reset by peer", corrupted=corrupted)

    transfer = SimpleNamespace(close=lambda: None)
    sender = SimpleNamespace(connection=lambda address: SimpleNamespace(open=lambda *args, **kwargs: transfer))
    service = PrefillService(BrokenHandoff(), sender, max_queued_requests=1)
    with pytest.raises(Aborted) as failed:
        await service.Prefill(request("a"), Context())
    code, _, trailing = failed.value.args
    if corrupted:  # the router prefills it again (its own counter), whoever damaged it
        assert code is grpc.StatusCode.DATA_LOSS and not trailing
    else:
        assert code is grpc.StatusCode.UNAVAILABLE and trailing.get(PEER_FAULT_KEY) == "transfer"
