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


def test_a_stack_reports_each_process_and_its_cache_is_not_resident_at_start(capsys, model_dir):
    # A 2 GiB KV cache that nothing has written yet holds no memory (engine/host_memory.py).
    result = report(capsys, ["up", "--runs", "1", "--", "--colocated", "--kv-cache-memory", "2GiB"])
    assert result["command"] == "pdserve up --colocated --kv-cache-memory 2GiB"
    processes = result["processes"]
    assert set(processes) == {"decode-0", "router"}
    worker = processes["decode-0"]
    assert worker["torch_loaded"] and not processes["router"]["torch_loaded"]
    assert 0 < worker["rss_mib_median"] <= worker["peak_rss_mib_max"]
    assert worker["rss_mib_median"] < 2048, f"the worker holds {worker['rss_mib_median']:.0f} MiB at start"
