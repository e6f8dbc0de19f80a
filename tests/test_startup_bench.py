"""bench/startup.py: how long pdserve takes to start and what its processes hold once ready."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.startup import main

pytestmark = pytest.mark.e2e  # starts real pdserve processes


def report(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_the_router_alone_starts_without_torch(capsys):
    result = report(capsys, ["router", "--runs", "1"])
    assert result["command"] == "pdserve router" and result["runs"] == 1
    assert 0 < result["ready_s_median"] <= result["ready_s_max"]
    (name,) = result["processes"]
    assert name == "router" and not result["processes"]["router"]["torch_loaded"]


def test_a_stack_reports_each_process_and_no_cache_is_resident_at_start(capsys, model_dir):
    # 2 GiB KV caches that nothing has written yet hold no memory (engine/host_memory.py for the
    # prefill worker's, a shared-memory segment for the decode worker's).
    result = report(capsys, ["up", "--runs", "1", "--", "--kv-cache-memory", "2GiB"])
    assert result["command"] == "pdserve up --kv-cache-memory 2GiB"
    processes = result["processes"]
    assert set(processes) == {"prefill-0", "decode-0", "router"}
    assert not processes["router"]["torch_loaded"]
    for name in ("prefill-0", "decode-0"):
        worker = processes[name]
        assert worker["torch_loaded"] and 0 < worker["rss_mib_median"] <= worker["peak_rss_mib_max"]
        assert worker["rss_mib_median"] < 2048, f"{name} holds {worker['rss_mib_median']:.0f} MiB at start"
