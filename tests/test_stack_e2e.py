"""The whole stack in real processes: `pdserve up` (1P1D and colocated), real gRPC, the real
model. Greedy output must equal Hugging Face's; cancels and deadlines must free every block."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from conftest import PROMPTS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from processes import Stack, descendants

from pdserve.client import build_request
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e
MAX_NEW = 16
MAX_MODEL_LEN = 4096  # below the model's 8192: --max-model-len reaches the router and every worker
STACK_ARGS = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def stack():
    s = Stack.up("--prefill", "1", "--decode", "1", *STACK_ARGS, "--log-level", "DEBUG")
    yield s
    s.down()


@pytest.fixture(scope="module")
def colocated():
    s = Stack.up("--colocated", *STACK_ARGS)
    yield s
    s.down(signal.SIGINT)  # Ctrl-C stops it as cleanly as SIGTERM


async def collect(address: str, request: pb.GenerateRequest, timeout: float = 120.0):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        messages = [m async for m in stub.Generate(request, timeout=timeout)]
    ids = [t for m in messages for t in m.token_ids]
    return ids, "".join(m.text for m in messages), messages


async def cluster_stats(address: str) -> pb.ClusterStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pdserve_pb2_grpc.RouterStub(channel).GetClusterStats(pb.ClusterStatsRequest(), timeout=10)


async def assert_blocks_all_free(address: str, timeout: float = 30.0) -> None:
    """Every worker is healthy (a restarted one included) and holds no block, reservation or request."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await cluster_stats(address)
        busy = [
            (w.address, w.healthy, w.blocks_total - w.blocks_free, w.reserved_transfers)
            for w in stats.workers
            if not w.healthy
            or w.blocks_total == 0
            or w.blocks_free != w.blocks_total
            or w.reserved_transfers
            or w.running
            or w.waiting
        ]
        if not busy:
            return
        assert time.monotonic() < deadline, (
            f"workers still busy or unhealthy (address, healthy, blocks, reserved): {busy}"
        )
        await asyncio.sleep(0.2)


def greedy(prompt: str, max_tokens: int = MAX_NEW, **kwargs) -> pb.GenerateRequest:
    return build_request(prompt, max_tokens=max_tokens, temperature=0.0, **kwargs)


async def test_greedy_output_equals_transformers(stack, hf_reference):
    for prompt in (PROMPTS[0], PROMPTS[3]):
        ids, text, messages = await collect(stack.address, greedy(prompt))
        expected = hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, MAX_NEW)
        assert ids == expected
        assert text == hf_reference.tokenizer.decode(ids, skip_special_tokens=True)
        last = messages[-1]
        assert last.finish_reason in ("stop", "length") and all(not m.finish_reason for m in messages[:-1])
        assert last.usage.prompt_tokens == len(hf_reference.tokenizer(prompt).input_ids)
        assert last.usage.completion_tokens == len(ids) and last.usage.ttft_ms > 0
    await assert_blocks_all_free(stack.address)


async def test_token_ids_and_chat_messages_inputs(stack, hf_reference):
    prompt_ids = hf_reference.tokenizer(PROMPTS[2]).input_ids
    ids, _, _ = await collect(
        stack.address, build_request(prompt_token_ids=prompt_ids, max_tokens=MAX_NEW, temperature=0)
    )
    assert ids == hf_reference.greedy(prompt_ids, MAX_NEW)
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    chat_ids = hf_reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    ids, text, msgs = await collect(stack.address, build_request(messages=messages, max_tokens=MAX_NEW, temperature=0))
    assert ids == hf_reference.greedy(chat_ids, MAX_NEW)
    assert msgs[-1].usage.prompt_tokens == len(chat_ids)


async def test_sixteen_concurrent_streams(stack, hf_reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    results = await asyncio.gather(*(collect(stack.address, greedy(p, 12)) for p in prompts))
    for prompt, (ids, _, _) in zip(prompts, results):
        assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 12)
    await assert_blocks_all_free(stack.address)


async def test_colocated_gives_the_same_tokens(stack, colocated):
    for prompt in PROMPTS[:3]:
        disaggregated, _, _ = await collect(stack.address, greedy(prompt))
        together, _, _ = await collect(colocated.address, greedy(prompt))
        assert disaggregated == together
    await assert_blocks_all_free(colocated.address)


async def test_stop_string_ends_the_stream(stack, hf_reference):
    _, full_text, _ = await collect(stack.address, greedy(PROMPTS[0], 24))
    stop = full_text[8:12]
    _, text, messages = await collect(stack.address, greedy(PROMPTS[0], 24, stop=[stop]))
    assert messages[-1].finish_reason == "stop"
    assert text == full_text[: full_text.index(stop)]
    await assert_blocks_all_free(stack.address)


@pytest.mark.parametrize("mode", ["stack", "colocated"])
async def test_cancel_mid_stream_frees_blocks(mode, request):
    address = request.getfixturevalue(mode).address
    async with grpc.aio.insecure_channel(address) as channel:
        call = pdserve_pb2_grpc.RouterStub(channel).Generate(
            build_request(PROMPTS[3], max_tokens=400, temperature=0, ignore_eos=True), timeout=120
        )
        for _ in range(3):
            await call.read()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert call.cancelled()
        assert (await call.code()) is grpc.StatusCode.CANCELLED
    await assert_blocks_all_free(address)


async def test_expiring_deadline_frees_blocks(stack):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(
            stack.address, build_request(PROMPTS[3], max_tokens=400, temperature=0, ignore_eos=True), timeout=1.5
        )
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_blocks_all_free(stack.address)


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    (dict(prompt="hi", messages=[{"role": "user", "content": "x"}]), "messages"),
    (dict(prompt_token_ids=[1, 49152]), "prompt_token_ids"),
    (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5] * 9000), "prompt_token_ids"),
    (dict(prompt="word " * 9000), "prompt"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(prompt="hi", max_tokens=0), "sampling.max_tokens"),
    (dict(prompt="hi", max_tokens=100_000), "sampling.max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "sampling.temperature"),
    (dict(prompt="hi", top_p=0.0), "sampling.top_p"),
    (dict(prompt="hi", top_p=1.5), "sampling.top_p"),
    (dict(prompt="hi", top_k=-2), "sampling.top_k"),
    (dict(prompt="hi", seed=-3), "sampling.seed"),
    (dict(prompt="hi", stop=["x"] * 17), "sampling.stop"),
    (dict(prompt="hi", stop=[""]), "sampling.stop[0]"),
    (dict(prompt="hi", stop_token_ids=[10**7]), "sampling.stop_token_ids"),
    (dict(prompt="hi", priority=1000), "priority"),
]


@pytest.mark.parametrize("fields, field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
async def test_bad_input_is_invalid_argument_naming_the_field(stack, fields, field):
    fields = dict(fields)
    prompt = fields.pop("prompt", None)
    before = (await cluster_stats(stack.address)).counters["rejected_invalid"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stack.address, build_request(prompt, **fields), timeout=60)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    # Refused up front by the router's validation, not after a worker round trip.
    assert (await cluster_stats(stack.address)).counters["rejected_invalid"] == before + 1


async def test_max_model_len_holds_requests_to_the_context_it_sets(stack):
    for fields, words in (
        (dict(prompt_token_ids=[1] * MAX_MODEL_LEN), f"prompt_token_ids: {MAX_MODEL_LEN} tokens leave no room"),
        (dict(prompt_token_ids=[1] * 96, max_tokens=MAX_MODEL_LEN - 95), f"exceed the context of {MAX_MODEL_LEN}"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stack.address, build_request(**fields), timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    ids, _, messages = await collect(stack.address, greedy(None, prompt_token_ids=[1] * 96, max_tokens=4), timeout=60)
    assert len(ids) == 4 and messages[-1].finish_reason == "length"
    cmdlines = [" ".join(psutil.Process(pid).cmdline()) for pid in descendants(stack.proc.process.pid)]
    roles = [line for line in cmdlines if any(f" {role} " in line for role in ("router", "prefill", "decode"))]
    assert len(roles) == 3 and all(f"--max-model-len={MAX_MODEL_LEN}" in line for line in roles), cmdlines


async def test_one_request_is_followed_across_processes_at_debug(stack):
    """The client's id and the router's key of each try, in the router's and both workers' logs;
    and no other library's debug lines (gRPC's per health probe) around them."""
    await collect(stack.address, greedy(PROMPTS[0], max_tokens=4, request_id="trace-me-1"))
    tried = re.compile(r"request trace-me-1: try ([0-9a-f]{32}) on prefill worker \S+, decode worker \S+")
    assert stack.proc.saw(lambda line: tried.search(line) is not None), stack.proc.log_tail()
    key = next(m.group(1) for line in stack.proc.output if (m := tried.search(line)))
    for role in ("prefill_worker", "decode_worker"):
        arrived = f"pdserve.{role}.servicer"
        assert stack.proc.saw(
            lambda line, arrived=arrived: arrived in line and f"request {key} (client trace-me-1)" in line
        )
    assert stack.proc.saw(lambda line: "request trace-me-1 finished (length)" in line)
    assert not [line for line in stack.proc.output if "DEBUG grpc" in line]


async def test_health_and_reflection_on_every_server(stack):
    stats = await cluster_stats(stack.address)
    targets = [(stack.address, "pdserve.v1.Router")] + [
        (w.address, "pdserve.v1.PrefillWorker" if w.role == "prefill" else "pdserve.v1.DecodeWorker")
        for w in stats.workers
    ]
    assert len(targets) == 3
    for address, service in targets:
        async with grpc.aio.insecure_channel(address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name async for r in stream for s in r.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_cli_generate_json_streams_one_object_per_message(stack, hf_reference):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            "--addr",
            stack.address,
            "--json",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            PROMPTS[0],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert all({"token_ids", "text", "finish_reason"} <= row.keys() for row in rows)
    assert all(row["finish_reason"] is None for row in rows[:-1]) and rows[-1]["finish_reason"] == "length"
    ids = [t for row in rows for t in row["token_ids"]]
    assert ids == hf_reference.greedy(hf_reference.tokenizer(PROMPTS[0]).input_ids, 8)


def test_cli_generate_leaves_quietly_when_its_reader_does(stack):
    """`pdserve generate --json ... | head -1`: no BrokenPipeError traceback, the shell's SIGPIPE
    status, and the request is cancelled on the server."""
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--addr", stack.address, "--json"]
    proc = subprocess.Popen(
        [*cmd, "--max-tokens", "400", "--seed", "1", PROMPTS[0]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, err
    finally:
        proc.kill()
    assert first["finish_reason"] is None and "Traceback" not in err
    asyncio.run(assert_blocks_all_free(stack.address))


async def test_stopping_the_stack_drains_the_router_before_its_workers_stop():
    """SIGTERM to `pdserve up`: the router drains its streams while the workers still serve them
    (stopped together, the workers' health turned NOT_SERVING under the draining router, which
    marked them failed and moved quiet requests to workers that were going away)."""
    worker_stopping = re.compile(r"pdserve\.decode_worker\.main\[\d+\]: SIGTERM: shutting down")
    stack = Stack.up("--colocated", *STACK_ARGS)
    try:
        total, tokens, started = 200, 0, time.monotonic()
        signal_at = signalled = None
        async with grpc.aio.insecure_channel(stack.address) as channel:
            call = pdserve_pb2_grpc.RouterStub(channel).Generate(
                build_request(PROMPTS[0], max_tokens=total, ignore_eos=True), timeout=300
            )
            async for message in call:
                tokens += len(message.token_ids)
                if signal_at is None and tokens >= 20:  # about 1.5 s of tokens left, whatever this hour's speed
                    signal_at = max(tokens + 1, total - int(1.5 * tokens / (time.monotonic() - started)))
                if signalled is None and signal_at is not None and tokens >= signal_at:
                    signalled = len(stack.proc.output)
                    stack.proc.process.send_signal(signal.SIGTERM)
                last = message
            # The stream is over and the router still draining: its worker has not been told to stop.
            during = "".join(stack.proc.output[signalled:])
        assert tokens == total and last.finish_reason == "length"  # drained to its end
        assert "pdserve.router.main" in during and not worker_stopping.search(during), during
        stack.down()
    finally:
        stack.proc.stop()
    after = "".join(stack.proc.output[signalled:])
    # Not one probe saw a worker stopping (a probe slow on a loaded machine is another matter).
    assert not any(line in after for line in ("NOT_SERVING", "taken out of rotation", "does not answer")), after
    assert worker_stopping.search(after[after.index("pdserve.router.main") :]), after
