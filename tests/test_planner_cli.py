"""The planner's commands: pdserve simulate (bench's options, result files and requests), pdserve
plan, their bad input, and the new flags of pdserve up. No servers, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.bench import workloads
from pdserve.bench.arrivals import arrival_offsets
from pdserve.planner import plan_cli, simulate_cli
from pdserve.planner.profile import Overheads, Profile, StepCost, TransferCost
from pdserve.planner.sim_topology import SimConfig, Topology
from pdserve.planner.simulator import simulate


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    p = Profile(
        model="toy",
        device="cpu (2 cores)",
        parallel="threads",
        steps={1: StepCost(17.0, 0.8, 1.3, 5e-4, 2e-4), 2: StepCost(12.0, 0.5, 0.7, 3e-4, 1e-4)},
        kv_bytes_per_token=23040,
        transfers={"shm": TransferCost(2.0, 0.3)},
        transport="shm",
        overheads=Overheads(first_token_ms=5.0, handoff_ms=20.0, step_ms=1.0, seq_ms=0.1),
        cores=2,
        kv_cache_tokens={1: 90000, 2: 90000},
        source="test fixture",
    )
    return str(p.save(tmp_path_factory.mktemp("profile") / "cpu.json"))


def _simulate(tmp_path, profile_path, *extra: str) -> int:
    return cli.main(
        [
            "simulate",
            "--profile",
            profile_path,
            "--result-dir",
            str(tmp_path),
            "--no-plots",
            "--disable-tqdm",
            "--seed",
            "3",
            *extra,
        ]
    )


def test_simulate_writes_bench_results(tmp_path, profile_path, capsys):
    args = (
        "--modes",
        "1p1d,colocated,2p1d,1p1d-conditional",
        "--workload",
        "mixed",
        "--request-rates",
        "0.5,2",
        "--num-prompts",
        "30",
        "--goodput",
        "ttft:2500",
        "tpot:80",
    )
    assert _simulate(tmp_path, profile_path, *args) == 0
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == sorted(
        f"{m}-{r}qps.json" for m in ("1p1d", "colocated", "2p1d", "1p1d-conditional") for r in ("0.5", "2")
    )
    out = capsys.readouterr().out
    assert "== TTFT (ms) ==" in out and "1p1d-conditional" in out
    result = json.loads((tmp_path / "1p1d-2qps.json").read_text())
    for key in (
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "request_throughput",
        "request_goodput",
        "completed",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
    ):
        assert key in result, key
    assert result["simulated"] is True and result["backend"] == "pdserve-sim" and result["completed"] == 30
    # The benchmark's own requests: rate k of the sweep sends variant k of the workload.
    specs = workloads.variant(workloads.build(workloads.WorkloadConfig(name="mixed", num_prompts=30, seed=3), None), 1)
    assert result["input_lens"] == [s.prompt_len for s in specs]
    assert result["output_lens"] == [s.max_tokens for s in specs]
    conditional = json.loads((tmp_path / "1p1d-conditional-2qps.json").read_text())
    assert conditional["stack"]["conditional"] is True and conditional["sim_counters"]["prefill_local"] > 0


def test_simulate_is_deterministic_and_matches_the_simulator(tmp_path, profile_path):
    args = ("--modes", "1p1d", "--workload", "random", "--request-rates", "1", "--num-prompts", "20")
    a, b = tmp_path / "a", tmp_path / "b"
    assert _simulate(a, profile_path, *args) == 0 and _simulate(b, profile_path, *args) == 0
    ra, rb = (json.loads((d / "1p1d-1qps.json").read_text()) for d in (a, b))
    for key in ("ttfts", "itls", "duration", "median_ttft_ms", "p99_itl_ms"):
        assert ra[key] == rb[key], key
    # The same arrivals as pdserve bench: arrival_offsets with the run's seed.
    specs = workloads.build(workloads.WorkloadConfig(name="random", num_prompts=20, seed=3), None)
    run = simulate(Profile.load(profile_path), Topology(1, 1), specs, arrival_offsets(20, 1.0, 1.0, 3), SimConfig())
    assert ra["ttfts"] == [t.ttft for t in run.timelines]


def test_simulate_runs_with_its_own_default_modes(tmp_path, profile_path):
    """Not bench's default (live, a running stack, which cannot be simulated)."""
    assert _simulate(tmp_path, profile_path, "--request-rates", "1", "--num-prompts", "3") == 0
    assert {p.name for p in tmp_path.glob("*.json")} >= {"1p1d-1qps.json", "colocated-1qps.json"}


def test_simulate_refuses_a_kv_format_its_profile_was_not_measured_with(tmp_path, profile_path, capsys):
    """KV bytes per token and transfer times are the profiled format's: an int8 cache simulated
    from an auto profile held half the tokens it does and moved twice the bytes."""
    assert Profile.load(profile_path).kv_cache_dtype == "auto"
    assert (
        _simulate(tmp_path, profile_path, "--request-rates", "1", "--num-prompts", "3", "--kv-cache-dtype", "int8") == 2
    )
    err = capsys.readouterr().err
    assert "--kv-cache-dtype int8: the profile was measured with kv_cache_dtype auto" in err


def test_simulate_reads_jsonl_traces(tmp_path, profile_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"prompt_token_ids": list(range(1000, 1000 + n)), "output_len": 8}) for n in (20, 300, 45))
        + "\n"
    )
    assert (
        _simulate(
            tmp_path,
            profile_path,
            "--modes",
            "colocated",
            "--workload",
            "jsonl",
            "--dataset-path",
            str(trace),
            "--request-rates",
            "inf",
            "--num-prompts",
            "3",
        )
        == 0
    )
    result = json.loads((tmp_path / "colocated-infqps.json").read_text())
    assert result["input_lens"] == [20, 300, 45] and result["output_lens"] == [8, 8, 8]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "1p1d"], "--profile FILE is required"),
        (["--profile", "/nonexistent.json", "--modes", "1p1d"], "no such file"),
        (["--modes", "live"], "is not a pdserve stack and cannot be simulated"),
        (["--modes", "colocated", "--input-len", "9000", "--num-prompts", "2"], "exceed the profile's max_model_len"),
        (["--modes", "colocated-conditional"], "unknown mode"),
        (["--modes", "1p1d", "--slo-tpot-ms", "-5"], "--slo-tpot-ms"),
        (["--modes", "colocated-ngram"], "speculative decoding is not modelled"),
        (["--modes", "1p1d", "--kv-cache-memory", "1KiB"], "holds no block"),
    ],
)
def test_simulate_bad_input(tmp_path, profile_path, capsys, args, message):
    if "--profile" not in args and "required" not in message:
        args = ["--profile", profile_path, *args]
    assert simulate_cli.main([*args, "--result-dir", str(tmp_path), "--disable-tqdm"]) == 2
    assert message in capsys.readouterr().err


def test_plan_prints_and_writes_a_plan(tmp_path, profile_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(
        [
            "plan",
            "--profile",
            profile_path,
            "--workload",
            "mixed",
            "--slo",
            "ttft:4000",
            "tpot:80",
            "--devices",
            "2",
            "--num-prompts",
            "40",
            "--request-rate",
            "0.5",
            "--top-k",
            "3",
            "--json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "plan for 2 cores" in text and "target 0.5 req/s" in text
    plan = json.loads(out.read_text())
    assert plan["devices_used"] <= 2 and plan["unit"]["goodput_rps"] > 0
    assert {c["unit"] for c in plan["candidates"]} >= {"colocated x2", "1P(x1) 1D(x1)"}


def test_a_target_rate_is_planned_on_the_fewest_devices_that_serve_it(tmp_path, capsys):
    """The budget's best unit (the most goodput on 2 cores) is not what a small target needs:
    one colocated core serves 1 req/s here, and the plan says so."""
    out = tmp_path / "plan.json"
    bundled = Path(__file__).resolve().parents[1] / "bench" / "profiles" / "smollm2-cpu-2vcpu-quiet.json"
    args = ["--profile", str(bundled), "--num-prompts", "50"]
    args += ["--input-len", "256", "--output-len", "64", "--slo", "ttft:1500", "tpot:60", "--devices", "2"]
    assert plan_cli.main([*args, "--request-rate", "1", "--json", str(out), "--disable-tqdm"]) == 0
    plan = json.loads(out.read_text())
    target = plan["target_unit"]
    assert target["devices"] * plan["replicas_for_target"] < plan["unit"]["devices"] * plan["replicas"]
    assert target["goodput_rps"] * plan["replicas_for_target"] >= 1
    cheaper = [c for c in plan["candidates"] if c.get("goodput_rps") and c["goodput_rps"] >= 1]
    assert target["devices"] == min(c["devices"] for c in cheaper)
    assert f"= {target['devices']} cores (fits the budget)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slo", "ttft:100", "--devices", "0"], "must be >= 1"),
        (["--slo", "speed:3", "--devices", "2"], "--slo takes KEY:MS"),
        (["--slo", "ttft:abc", "--devices", "2"], "--slo ttft: 'abc'"),
        (["--slo", "ttft:100", "--devices", "2", "--attainment", "1.5"], "--attainment"),
        (["--slo", "ttft:100", "--devices", "2", "--request-rate", "inf"], "--request-rate"),
        (["--slo", "ttft:100", "--devices", "2", "--json", "/proc/no-such-folder/plan.json"], "--json"),
        (["--slo", "ttft:100", "--devices", "2", "--slo-tpot-ms", "0"], "--slo-tpot-ms must be a positive"),
        (["--slo", "ttft:100", "--devices", "2", "--input-len", "9000", "--num-prompts", "2"], "max_model_len 8192"),
    ],
)
def test_plan_bad_input(profile_path, capsys, args, message):
    assert plan_cli.main(["--profile", profile_path, "--disable-tqdm", *args]) == 2
    assert message in capsys.readouterr().err


def test_up_takes_the_planner_flags():
    args = cli._parser().parse_args(
        [
            "up",
            "--conditional",
            "--profile",
            "p.json",
            "--slo-tpot-ms",
            "50",
            "--slo-ttft-ms",
            "2000",
            "--conditional-threshold-tokens",
            "64",
        ]
    )
    assert (args.conditional, args.profile, args.slo_tpot_ms, args.conditional_threshold_tokens) == (
        True,
        "p.json",
        50.0,
        64,
    )
    for role in ("prefill", "decode"):
        worker = cli._parser().parse_args([role, "--profile", "p.json", "--slo-tpot-ms", "40"])
        assert (worker.profile, worker.slo_tpot_ms) == ("p.json", 40.0)


def test_plan_says_when_nothing_meets_the_slo(profile_path, capsys):
    code = plan_cli.main(
        [
            "--profile",
            profile_path,
            "--workload",
            "random",
            "--slo",
            "ttft:5",
            "--devices",
            "2",
            "--num-prompts",
            "20",
            "--top-k",
            "2",
            "--disable-tqdm",
        ]
    )
    assert code == 0
    assert "no placement within 2 cores meets the SLOs for 90% of the requests" in capsys.readouterr().out


def test_outputs_that_could_not_be_written_are_refused_before_any_work(tmp_path, profile_path, capsys):
    from pdserve.planner import profile_cli

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = ["--profile", profile_path, "--modes", "1p1d", "--disable-tqdm", "--result-dir", str(a_file)]
    assert simulate_cli.main(args) == 2 and "--result-dir" in capsys.readouterr().err
    assert profile_cli.main(["--output", str(tmp_path), "--disable-tqdm"]) == 2
    assert "--output" in capsys.readouterr().err


def test_profile_names_a_degree_that_is_not_a_number(tmp_path, capsys):
    from pdserve.planner import profile_cli

    assert profile_cli.main(["--output", str(tmp_path / "p.json"), "--degrees", "1,abc"]) == 2
    assert "--degrees takes comma-separated integers, got '1,abc'" in capsys.readouterr().err
