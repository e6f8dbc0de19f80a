"""Each KV transport end to end through `pdserve up --kv-transport X`, the fallback when ucxx
is missing, corruption and stall injection, and re-blocking between block sizes."""

from __future__ import annotations

import asyncio
import ipaddress
import os

import psutil
import pytest
from conftest import PROMPTS
from processes import Proc, Stack, can_mount_private_shm
from test_stack_e2e import assert_blocks_all_free, cluster_stats, collect

from pdserve.client import build_request
from pdserve.kvtransfer.ucx_worker import ucx_available, ucx_unavailable_reason
from pdserve.v1 import pdserve_pb2 as pb

pytestmark = pytest.mark.e2e
MAX_NEW = 12
ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB")


async def check_greedy(address: str, hf_reference, prompts=(PROMPTS[0], PROMPTS[3])) -> None:
    for prompt in prompts:
        ids, _, _ = await collect(address, build_request(prompt, max_tokens=MAX_NEW, temperature=0))
        assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, MAX_NEW)


def worker_counters(stats: pb.ClusterStats, role: str) -> dict:
    return next(dict(w.counters) for w in stats.workers if w.role == role)


def _loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # gRPC listens on ::ffff:127.0.0.1


UCX = pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason=ucx_unavailable_reason()))


@pytest.mark.parametrize("transport", ["tcp", "shm", UCX])
async def test_each_transport_gives_hf_greedy_output(transport, hf_reference):
    stack = Stack.up("--kv-transport", transport, *ARGS, env={"UCX_NET_DEVICES": None})  # as a user runs it
    try:
        await check_greedy(stack.address, hf_reference)
        stats = await cluster_stats(stack.address)
        assert worker_counters(stats, "decode")[f"kv_transfers_{transport}"] >= 2
        assert worker_counters(stats, "prefill")[f"kv_transfers_{transport}"] >= 2
        await assert_blocks_all_free(stack.address)
        # A stack on loopback listens on loopback only (UCX's TCP transport included).
        for pid in stack.children:
            listening = [c.laddr for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
            assert all(_loopback(host) for host, _ in listening), (pid, listening)
    finally:
        stack.down()


def without_ucxx(tmp_path) -> dict[str, str]:
    """An environment in which ``import ucxx`` fails, as where it is not installed."""
    fake = tmp_path / "ucxx"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated: ucxx is not installed')\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


async def test_without_ucxx_auto_falls_back_and_says_so(tmp_path, hf_reference):
    stack = Stack.up(*ARGS, env=without_ucxx(tmp_path))
    try:
        assert stack.proc.saw(lambda line: "UCX unavailable" in line and "pip install 'pdserve[ucx]'" in line), (
            stack.proc.log_tail()
        )
        await check_greedy(stack.address, hf_reference, prompts=(PROMPTS[0],))
        counters = worker_counters(await cluster_stats(stack.address), "decode")
        assert counters.get("kv_transfers_shm", 0) >= 1, counters
    finally:
        stack.down()


SMALL_SHM = [  # a private /dev/shm of 8 MiB, as a container's (64 MiB by default) is small
    *("unshare", "-m", "--propagation", "private", "sh", "-c"),
    'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"',
    "sh",
]


@pytest.mark.skipif(not can_mount_private_shm(), reason="a private /dev/shm needs unshare and CAP_SYS_ADMIN")
async def test_a_dev_shm_too_small_for_the_cache_drops_shm_instead_of_crashing(tmp_path, hf_reference):
    stack = Stack.up(*ARGS, env=without_ucxx(tmp_path), prefix=SMALL_SHM)  # 128 MiB of KV cache
    try:
        assert stack.proc.saw(lambda line: "KV transport shm not offered" in line and "--shm-size" in line)
        await check_greedy(stack.address, hf_reference)
        counters = worker_counters(await cluster_stats(stack.address), "decode")
        assert counters.get("kv_transfers_tcp", 0) >= 2 and not counters.get("kv_transfers_shm"), counters
        assert not stack.proc.saw(lambda line: "exited with code" in line, timeout=0)
    finally:
        stack.down()

    proc = Proc(["up", "--port", "0", "--kv-transport", "shm", *ARGS], prefix=SMALL_SHM)  # forced: refused by name
    try:
        assert await asyncio.to_thread(proc.process.wait, 120) != 0
        assert "--kv-transport shm" in proc.log_tail() and "MiB are free" in proc.log_tail()
    finally:
        proc.stop()


async def test_forcing_an_unavailable_transport_fails_at_start():
    proc = Proc(["up", "--port", "0", "--kv-transport", "cuda_ipc", *ARGS])
    code = await asyncio.to_thread(proc.process.wait, 120)
    assert code != 0
    assert "cuda_ipc" in proc.log_tail() and "not available" in proc.log_tail()


async def test_corrupted_transfer_is_reprefilled_never_decoded(hf_reference):
    stack = Stack.up("--kv-transport", "tcp", *ARGS, env={"PDSERVE_KV_FAULTS": "corrupt=1"})
    try:
        await check_greedy(stack.address, hf_reference, prompts=(PROMPTS[2],))
        stats = await cluster_stats(stack.address)
        assert worker_counters(stats, "decode")["kv_checksum_mismatch"] == 1
        assert stats.counters["reprefills_after_corruption"] == 1
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_stalled_transfer_times_out_and_fails_over(hf_reference):
    stack = Stack.up("--kv-transport", "tcp", "--kv-lease-s", "3", *ARGS, env={"PDSERVE_KV_FAULTS": "stall=1"})
    try:
        await check_greedy(stack.address, hf_reference, prompts=(PROMPTS[2],))
        stats = await cluster_stats(stack.address)
        assert worker_counters(stats, "decode")["kv_lease_expired"] >= 1
        assert stats.counters["retries"] >= 1
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_prefill_and_decode_with_different_block_sizes(hf_reference):
    """Prefill blocks of 16 tokens, decode blocks of 32: the K/V is re-blocked on arrival."""
    procs = []
    try:
        prefill = Proc(["prefill", "--port", "0", "--block-size", "16", "--num-threads", "1", *ARGS])
        decode = Proc(["decode", "--port", "0", "--block-size", "32", "--num-threads", "1", *ARGS])
        procs += [prefill, decode]
        p_info, d_info = prefill.wait_ready(), decode.wait_ready()
        router = Proc(
            ["router", "--port", "0", "--prefill-workers", p_info["grpc"], "--decode-workers", d_info["grpc"]]
        )
        procs.append(router)
        address = router.wait_ready()["grpc"]
        await check_greedy(address, hf_reference)
        await assert_blocks_all_free(address)
    finally:
        for proc in procs:
            assert proc.stop() == 0


async def test_requests_sharing_a_client_request_id_do_not_collide(hf_reference):
    """Issue 13, defect 2: workers keyed their state on the client's request_id, so two requests
    with the same id (a client retrying) leaked the decode worker's blocks or cut the other's
    transfer short on the prefill worker. Workers now key on the router's own id."""
    stack = Stack.up("--kv-transport", "tcp", *ARGS)
    try:
        prompts = (PROMPTS[0], PROMPTS[2], PROMPTS[3])
        results = await asyncio.gather(
            *(
                collect(stack.address, build_request(p, max_tokens=MAX_NEW, temperature=0, request_id="same-id"))
                for p in prompts
            )
        )
        for prompt, (ids, _, messages) in zip(prompts, results):
            assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, MAX_NEW)
            assert {m.request_id for m in messages} == {"same-id"}  # the client's id is echoed
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_quantized_weights_and_8bit_kv_through_the_stack(hf_reference):
    """int4 weights and an int8 KV cache on both pools: the KV (codes and scales) crosses the
    handoff like any cache and the answer starts as the unquantized model's does."""
    stack = Stack.up("--quantization", "int4", "--kv-cache-dtype", "int8", "--kv-cache-memory", "64MiB")
    try:
        prompt = PROMPTS[0]
        ids, _, _ = await collect(stack.address, build_request(prompt, max_tokens=MAX_NEW, temperature=0))
        assert ids[:2] == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 2)
        assert (
            sum(
                v
                for k, v in worker_counters(await cluster_stats(stack.address), "decode").items()
                if k.startswith("kv_transfers_")
            )
            >= 1
        )
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
