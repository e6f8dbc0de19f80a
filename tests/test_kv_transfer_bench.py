"""Smoke tests of the KV-transfer benchmark (the micro part with a tiny payload, no model) and
of the UCX scatter-gather probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.bench.kv_transfer_bench import check_targets, main
from pdserve.kvtransfer.ucx_worker import ucx_available, ucx_unavailable_reason


@pytest.mark.parametrize("where", [[], ["--decode-in-process"]], ids=["decode-process", "in-process"])
def test_micro_part_reports_positive_throughput(tmp_path, capsys, where):
    out = tmp_path / "kv.json"
    argv = ["--sizes-mib", "1", "--repeats", "1", "--transports", "tcp,shm", "--parts", "micro", "--json", str(out)]
    assert main(argv + where) == 0
    result = json.loads(out.read_text())
    assert result["config"]["decode_in_process"] is bool(where)

    machine = result["machine"]
    assert machine["cpu_count"] >= 1 and len(machine["loadavg_start"]) == 3 and len(machine["loadavg_end"]) == 3
    assert isinstance(machine["other_load_present"], bool)
    assert result["config"]["transports"] == ["tcp", "shm"]
    assert "real_request" not in result and "ttft" not in result

    (row,) = result["micro"]
    assert row["label"] == "1 MiB" and row["samples"] >= 1
    assert abs(row["bytes"] - (1 << 20)) < row["num_layers"] * row["token_bytes"]  # whole tokens of every layer
    assert set(row["gbps"]) == {"memcpy", "raw_socket", "tcp", "shm"}
    assert all(v > 0 for v in row["gbps"].values()) and all(v > 0 for v in row["seconds_median"].values())
    assert set(row["ratios"]) == {"tcp_vs_raw_socket", "shm_vs_memcpy"} and all(v > 0 for v in row["ratios"].values())
    assert result["targets"] == []  # the targets are for 16 MiB and up: smaller payloads are reported, not judged
    assert "GB/s" in capsys.readouterr().out


def test_targets_judge_large_payloads_and_the_handoff_as_deployed():
    ratios = {"shm_vs_memcpy": 0.6, "tcp_vs_raw_socket": 0.5}
    rows = [
        {"label": "1 MiB", "bytes": 1 << 20, "ratios": ratios},
        {"label": "16 MiB", "bytes": 364 * 30 * 1536, "ratios": ratios},  # whole tokens, a little under 16 MiB
    ]
    per = {"exposed_pipelined_ms": 30.0, "transfer_ms": 4.0, "pipelined_minus_after_ms": 26.0}
    checks = check_targets(rows, {"deployed_mode": "after", "per_transport": {"shm": per}})
    got = {(c["row"], c["target"].split(" (")[0]): (c["value"], c["met"]) for c in checks}
    assert got == {
        ("16 MiB", "shm_vs_memcpy >= 0.5"): (0.6, True),
        ("16 MiB", "tcp_vs_raw_socket >= 0.9"): (0.5, False),
        ("ttft shm", "pipelined - after prefill <= 0 ms"): (26.0, False),
        ("ttft shm", "handoff adds <= 10.0 ms"): (4.0, True),  # sent after the forward, as such a worker does
    }
    (pipelined,) = [
        c["value"]
        for c in check_targets([], {"deployed_mode": "pipelined", "per_transport": {"shm": per}})
        if c["target"].startswith("handoff")
    ]
    assert pipelined == 30.0


def test_a_decode_side_that_cannot_start_says_why():
    from pdserve.bench.kv_links import RemoteDecodeSide
    from pdserve.bench.kv_payloads import Geometry, synthetic_peer

    geometry = Geometry()
    with pytest.raises(RuntimeError, match="decode side: .*no-such-transport"):
        RemoteDecodeSide("no-such-transport", geometry.layout(), 4, synthetic_peer(geometry, "tcp", "decode"))


@pytest.mark.skipif(not ucx_available(), reason=ucx_unavailable_reason())
def test_ucx_iov_probe_moves_verified_bytes(capsys):
    from pdserve.bench.ucx_iov_probe import main as probe

    argv = ["--sizes-mib", "1", "--repeats", "2", "--modes", "contiguous,recv-iov", "--deadline-s", "10"]
    assert probe(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["mode"] for row in rows] == ["contiguous", "recv-iov"]
    # "ok" means every transfer completed and its bytes matched, in token order, on both sides
    assert all(row["outcome"] == "ok" and row["gb_s"] > 0 and row["mib"] == 1 for row in rows)


@pytest.mark.skipif(not ucx_available(), reason=ucx_unavailable_reason())
def test_ucx_iov_probe_sends_pieces_with_the_get_rendezvous(capsys):
    """What RESULTS reports: with the receiver reading the sender's pieces, a scatter-gather
    send completes (UCX 1.21's default rendezvous never completes one here)."""
    from pdserve.bench.ucx_iov_probe import main as probe

    argv = ["--sizes-mib", "1", "--repeats", "2", "--modes", "send-iov,both-iov", "--rndv-scheme", "get_zcopy"]
    assert probe(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["mode"], row["outcome"], row["rndv_scheme"]) for row in rows] == [
        ("send-iov", "ok", "get_zcopy"),
        ("both-iov", "ok", "get_zcopy"),
    ]


def test_ucx_iov_probe_refuses_bad_arguments():
    from pdserve.bench.ucx_iov_probe import main as probe

    with pytest.raises(SystemExit):
        probe(["--modes", "contiguous,sideways"])
    with pytest.raises(SystemExit):
        probe(["--repeats", "0"])
    with pytest.raises(SystemExit):
        probe(["--sizes-mib", "16,lots"])
    with pytest.raises(SystemExit):
        probe(["--sizes-mib", "1", "--block-bytes", str(2 << 20)])
    with pytest.raises(SystemExit):  # refused here, not by UCX in each child after a deadline
        probe(["--rndv-scheme", "bogus"])


def test_ttft_part_hands_a_real_prefill_off_in_the_deployed_dtype(tmp_path):
    """The TTFT part on the default model: a short prompt, one triple over TCP. Every handoff's
    KV is checked against the engine's (the part raises otherwise); the engine runs in the dtype
    ``pdserve up`` picks here, which the report names."""
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.loader import parse_dtype

    out = tmp_path / "kv.json"
    argv = [
        "--parts",
        "ttft",
        "--transports",
        "tcp",
        "--ttft-repeats",
        "1",
        "--prompt-tokens",
        "40",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    ttft = json.loads(out.read_text())["ttft"]
    deployed = str(parse_dtype(EngineConfig().dtype, torch.device("cpu"))).removeprefix("torch.")
    assert ttft["dtype"] == deployed and ttft["prompt_tokens"] == 40
    assert (
        ttft["transfer_bytes"] == 40 * 30 * 3 * 64 * 2 * torch.empty(0, dtype=getattr(torch, deployed)).element_size()
    )
    (runs,) = ttft["runs_ms"]["tcp"]
    assert set(runs) == {"none", "pipelined", "after"}
    assert all(0 < first <= acked for first, acked in runs.values())
    assert ttft["per_transport"]["tcp"]["prefill_ms"] > 0


def test_bad_thread_counts_are_refused():
    with pytest.raises(SystemExit):
        main(["--parts", "ttft", "--prefill-threads", "0"])


def test_ucx_iov_probe_without_ucx_says_why(monkeypatch, capsys):
    from pdserve.bench import ucx_iov_probe

    monkeypatch.setattr(ucx_iov_probe, "ucx_available", lambda: False)
    assert ucx_iov_probe.main(["--sizes-mib", "1"]) == 1
    assert "ucxx" in capsys.readouterr().err


def test_importing_the_benchmark_leaves_the_environment_alone():
    """``pdserve profile`` imports it and then starts stacks, which inherit the environment: its
    script-only settings (passive OpenMP waiting) must not reach their workers."""
    code = (
        "import json, os; before = dict(os.environ); import pdserve.bench.kv_transfer_bench; "
        "print(json.dumps(sorted(k for k in os.environ if os.environ[k] != before.get(k))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY" and not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert "OMP_WAIT_POLICY" not in changed
    # What the import may set: the UCX bindings' own defaults (workers import them too).
    assert all(k.startswith("UCX_") for k in changed), changed
