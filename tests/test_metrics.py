"""Prometheus /metrics on the router and every worker: parseable, and moving with traffic."""

from __future__ import annotations

import time
import urllib.request

import pytest
from conftest import PROMPTS
from processes import Stack
from prometheus_client.parser import text_string_to_metric_families
from test_stack_e2e import collect

from pdserve.client import build_request

pytestmark = pytest.mark.e2e


def scrape(address: str) -> dict[str, float]:
    """Sample name (with labels) -> value, parsed with Prometheus' own text parser."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


@pytest.fixture(scope="module")
def stack():
    s = Stack.up("--metrics", "--dtype", "float32", "--kv-cache-memory", "128MiB", "--kv-transport", "tcp")
    yield s
    s.down()


async def test_metrics_move_with_traffic(stack):
    by_role = {p["role"]: p["metrics"] for p in stack.processes}
    assert set(by_role) == {"router", "prefill", "decode"} and all(by_role.values())
    before = {role: scrape(address) for role, address in by_role.items()}
    prompt_tokens = generated = 0
    for prompt in PROMPTS[:2]:
        ids, _, messages = await collect(stack.address, build_request(prompt, max_tokens=8, temperature=0))
        prompt_tokens, generated = prompt_tokens + messages[-1].usage.prompt_tokens, generated + len(ids)
    after = {role: scrape(address) for role, address in by_role.items()}

    router_before, router_after = before["router"], after["router"]
    finished = lambda m: sum(v for k, v in m.items() if k.startswith("pdserve_requests_total"))  # noqa: E731
    assert finished(router_after) - finished(router_before) == 2
    assert (
        router_after["pdserve_time_to_first_token_seconds_count{}"]
        - router_before.get("pdserve_time_to_first_token_seconds_count{}", 0)
        == 2
    )
    assert router_after["pdserve_inter_token_latency_seconds_count{}"] > router_before.get(
        "pdserve_inter_token_latency_seconds_count{}", 0
    )
    assert (
        router_after["pdserve_e2e_request_latency_seconds_count{}"]
        - router_before.get("pdserve_e2e_request_latency_seconds_count{}", 0)
        == 2
    )
    for name, sent in (
        ("pdserve_prompt_tokens_total{}", prompt_tokens),
        ("pdserve_generation_tokens_total{}", generated),
    ):
        assert router_after[name] - router_before.get(name, 0) == sent, name

    decode = after["decode"]
    assert (
        decode["pdserve_kv_transfers_total{role=decode,transport=tcp}"]
        - before["decode"].get("pdserve_kv_transfers_total{role=decode,transport=tcp}", 0)
        == 2
    )
    assert decode["pdserve_kv_transfer_bytes_total{role=decode,transport=tcp}"] > 0
    assert decode["pdserve_kv_blocks{role=decode}"] > 0
    deadline = time.monotonic() + 10  # the engine's snapshot of its blocks follows its next step
    while decode["pdserve_kv_blocks_free{role=decode}"] != decode["pdserve_kv_blocks{role=decode}"]:
        assert time.monotonic() < deadline, "the decode worker's blocks were not all freed"
        time.sleep(0.05)
        decode = scrape(by_role["decode"])
    # Each role exports its own series only (and its process's): no router histograms on workers.
    for role in ("prefill", "decode"):
        assert not any(
            k.startswith(("pdserve_time_to_first", "pdserve_router_", "pdserve_planner_")) for k in after[role]
        )
        assert "process_resident_memory_bytes{}" in after[role]
    assert not any(k.startswith(("pdserve_kv_blocks", "pdserve_kv_transfer_duration")) for k in after["router"])
    prefill = after["prefill"]
    assert prefill["pdserve_kv_transfer_duration_seconds_count{transport=tcp}"] == 2
    assert prefill["pdserve_prefix_cache_queries_total{role=prefill}"] >= 1
    assert "pdserve_prefix_cache_hit_ratio{role=prefill}" in prefill


def test_prompts_prefilled_is_traffic_not_a_kv_transfer_problem():
    from pdserve.metrics import _kv_families

    families = {
        f.name: f for f in _kv_families("prefill", {"prompts_prefilled": 3, "transfers_tcp": 2, "transfer_failed": 1})
    }
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("pdserve_prompts_prefilled_total", (("role", "prefill"),))] == 3
    assert samples[("pdserve_kv_transfers_total", (("role", "prefill"), ("transport", "tcp")))] == 2
    events = [labels for name, labels in samples if name == "pdserve_kv_transfer_events_total"]
    assert events == [(("event", "transfer_failed"), ("role", "prefill"))]  # only problems


def test_a_silent_scrape_connection_is_closed_and_does_not_hold_a_thread(monkeypatch, capfd):
    """prometheus_client gives each connection a thread that waits for its request forever:
    connections opened and left silent (or half-sent) must be closed after a while."""
    import socket
    import threading

    from prometheus_client import CollectorRegistry, Counter

    from pdserve import metrics

    monkeypatch.setattr(metrics, "SCRAPE_IDLE_TIMEOUT_S", 0.5)
    registry = CollectorRegistry()
    Counter("pdserve_test_scrapes", "a series to scrape", registry=registry).inc()
    port = metrics.serve_metrics("127.0.0.1", 0, registry)
    threads = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    silent[0].sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
    try:
        for sock in silent:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
        deadline = time.monotonic() + 5
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"pdserve_test_scrapes_total 1.0" in response.read()
        assert "Traceback" not in capfd.readouterr().err  # closed quietly
    finally:
        for sock in silent:
            sock.close()
