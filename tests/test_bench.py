"""The serving benchmark: metrics on hand-computed timelines, arrivals, workloads, result keys,
bad input, and one short end-to-end run against a real 1P1D stack."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.bench import arrivals, results, workloads
from pdserve.bench.metrics import Goodput, Timeline, compute
from pdserve.bench.serve import main

# -- metrics -------------------------------------------------------------------------------


def _timelines() -> list[Timeline]:
    # A: 4 tokens in 3 messages (the last carries 2), so ITLs are per message, not per token.
    a = Timeline(prompt_len=10, max_tokens=4, send_time=0.0, chunk_times=[0.5, 0.7, 1.0], chunk_tokens=[1, 1, 2], end_time=1.0)
    # B: one token; its final message carries none (e2el ends at the final message).
    b = Timeline(prompt_len=20, max_tokens=1, send_time=1.0, chunk_times=[1.25], chunk_tokens=[1], end_time=1.5)
    c = Timeline(prompt_len=30, max_tokens=8, send_time=1.0, error="UNAVAILABLE: no worker")
    return [a, b, c]


def test_metrics_match_hand_computed_timeline():
    m = compute(_timelines(), duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (30, 5)  # failed requests count in neither
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    # TTFT: A 500 ms, B 250 ms.
    assert m.ttft.mean == pytest.approx(375.0)
    assert m.ttft.median == pytest.approx(375.0)
    assert m.ttft.p90 == pytest.approx(250 + 0.9 * 250)
    # TPOT only for outputs > 1 token: A (1.0 - 0.5) / 3.
    assert m.tpot.mean == pytest.approx(500 / 3)
    # ITL: A's two gaps between messages, 200 ms and 300 ms; B has none.
    assert m.itl.mean == pytest.approx(250.0)
    assert m.itl.p99 == pytest.approx(200 + 0.99 * 100)
    # E2EL: A 1000 ms, B 500 ms.
    assert m.e2el.mean == pytest.approx(750.0)
    assert m.request_goodput is None


@pytest.mark.parametrize(
    "slos, good",
    [
        (["ttft:400", "tpot:200"], 1),  # A misses TTFT; B (TPOT counts as 0) meets both
        (["ttft:600", "tpot:100"], 1),  # A misses TPOT
        (["ttft:600", "tpot:200"], 2),
        (["ttft:100"], 0),
        (["e2el:800"], 1),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = compute(_timelines(), duration_s=2.0, goodput=Goodput.parse(slos))
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_metrics_when_everything_failed():
    m = compute([Timeline(5, 5, error="DEADLINE_EXCEEDED")], duration_s=1.0, goodput=Goodput(ttft_ms=1))
    assert (m.completed, m.failed, m.request_goodput, m.ttft.mean, m.max_concurrent_requests) == (0, 1, 0.0, 0.0, 0)


@pytest.mark.parametrize("bad", ["ttft", "foo:10", "ttft:-5", "ttft:0", "tpot:fast"])
def test_goodput_rejects_bad_pairs(bad):
    with pytest.raises(ValueError, match="goodput"):
        Goodput.parse([bad])


# -- arrivals ------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.5, math.sqrt(2)), (4.0, 0.5)])
def test_arrivals_mean_rate_and_shape(burstiness, cv):
    offsets = arrivals.arrival_offsets(5000, rate=8.0, burstiness=burstiness, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma shape k: CV = 1/sqrt(k)
    assert offsets == arrivals.arrival_offsets(5000, rate=8.0, burstiness=burstiness, seed=3)


def test_arrivals_inf_and_bad_rates():
    assert arrivals.arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrivals.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", "1,,2", "nan"):
        with pytest.raises(ValueError):
            arrivals.parse_rates(bad)
    with pytest.raises(ValueError):
        arrivals.arrival_offsets(3, 1.0, burstiness=0)


# -- workloads -----------------------------------------------------------------------------


class WordTokenizer:
    """One id per word, so token counts are obvious."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [1000 + sum(map(ord, w)) % 5000 for w in text.split()]


def test_random_and_sharegpt_lengths():
    cfg = workloads.WorkloadConfig("random", num_prompts=50, seed=1, input_len=(5, 9), output_len=(3, 4))
    specs = workloads.build(cfg, WordTokenizer)
    assert all(5 <= s.prompt_len <= 9 and 3 <= s.max_tokens <= 4 for s in specs)
    assert all(workloads.TOKEN_ID_RANGE[0] <= t < workloads.TOKEN_ID_RANGE[1] for s in specs for t in s.prompt_token_ids)
    assert specs == workloads.build(cfg, WordTokenizer)  # seeded
    share = workloads.build(workloads.WorkloadConfig("sharegpt", num_prompts=2000, seed=0), WordTokenizer)
    ins = np.array([s.prompt_len for s in share])
    assert ins.min() >= 4 and ins.max() <= 1024 and all(s.prompt_len + s.max_tokens <= 2048 for s in share)
    assert np.median(ins) == pytest.approx(math.exp(workloads.SHAREGPT_INPUT[0]), rel=0.15)
    warm = workloads.warmup_specs(specs, 3, seed=1)
    assert [w.prompt_len for w in warm] == [s.prompt_len for s in specs[:3]] and warm[0] != specs[0]


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    cfg = workloads.WorkloadConfig("shared-prefix", num_prompts=12, num_prefixes=3, prefix_len=40, input_len=(5, 8))
    specs = workloads.build(cfg, WordTokenizer)
    for i, s in enumerate(specs):
        assert 45 <= s.prompt_len <= 48
        assert s.prompt_token_ids[:40] == specs[i % 3].prompt_token_ids[:40]
    assert specs[0].prompt_token_ids[:40] != specs[1].prompt_token_ids[:40]


def test_jsonl_workload(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two three", "output_len": 5}\n\n{"prompt_token_ids": [7, 8], "max_tokens": 2}\n{"prompt": "x"}\n')
    specs = workloads.build(workloads.WorkloadConfig("jsonl", num_prompts=10, path=str(path), output_len=(9, 9)), WordTokenizer)
    assert [(s.prompt_len, s.max_tokens) for s in specs] == [(4, 5), (2, 2), (2, 9)]
    for line, error in [("{bad", "not valid JSON"), ('{"text": "a"}', "needs a non-empty"), ('{"prompt": "a", "output_len": 0}', "output_len")]:
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(workloads.WorkloadError, match=rf"p\.jsonl:2: {error}"):
            workloads.build(workloads.WorkloadConfig("jsonl", path=str(path)), WordTokenizer)


# -- results and bad input -----------------------------------------------------------------

VLLM_KEYS = {
    "date", "backend", "label", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    "input_lens", "output_lens", "ttfts", "itls", "errors",
} | {f"{s}_{k}_ms" for s in ("mean", "median", "std", "p99") for k in ("ttft", "tpot", "itl", "e2el")}


def test_result_uses_vllm_key_names():
    info = results.RunInfo("1p1d", "pdserve-grpc", "default", "random", 3, math.inf, 1.0, None, 0, Goodput(ttft_ms=400))
    tl = _timelines()
    r = results.to_result(info, compute(tl, 2.0, info.goodput), tl)
    assert VLLM_KEYS <= r.keys() and {"p90_ttft_ms", "p90_itl_ms"} <= r.keys()
    assert r["request_rate"] == "inf" and r["errors"] == ["", "", "UNAVAILABLE: no worker"]
    assert r["output_lens"] == [4, 1, 0] and r["itls"][0] == pytest.approx([0.2, 0.3]) and r["ttfts"][0] == 0.5
    assert results.file_name(info) == "1p1d-infqps.json"
    json.dumps(r)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--request-rates", "0"], "request rate must be > 0"),
        (["--request-rates=-2,1"], "request rate must be > 0"),
        (["--modes", "1p1d,turbo"], "unknown mode turbo"),
        (["--input-len", "9:3"], "LO:HI"),
        (["--goodput", "ttft:abc"], "not a number"),
        (["--addr", "127.0.0.1:9", "--connect-timeout-s", "1"], "cannot reach a router at 127.0.0.1:9"),
    ],
)
def test_bad_input_gives_a_message_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--result-dir", str(tmp_path), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_malformed_jsonl_line_is_named(capsys, tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt": \n')
    assert main(["--workload", "jsonl", "--dataset-path", str(path), "--result-dir", str(tmp_path)]) == 2
    assert "mine.jsonl:2: not valid JSON" in capsys.readouterr().err


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_hf_baseline_records_every_token(model_dir):
    from pdserve.bench.hf_baseline import HFConfig, run_hf

    specs = [workloads.RequestSpec((1000, 2000, 3000), 3), workloads.RequestSpec((1500,) * 6, 5)]
    res = run_hf(specs, HFConfig(num_threads=1, progress=False))
    assert [t.output_tokens for t in res.timelines] == [3, 5] and all(t.success for t in res.timelines)
    assert res.timelines[0].end_time <= res.timelines[1].end_time  # same batch: shared step times


@pytest.mark.e2e
def test_end_to_end_against_a_started_1p1d_stack(tmp_path, capsys):
    # The user's own prompts; one has a token id outside the vocabulary: it must fail, be
    # counted and shown, and not disturb the others.
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Tell me fact number {i} about the sea.", "output_len": 8 + i} for i in range(4)]
    lines.insert(2, {"prompt_token_ids": [5, 10**9], "output_len": 8})
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results"
    code = main([
        "--modes", "1p1d", "--workload", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "5",
        "--request-rates", "4", "--warmup", "1", "--goodput", "ttft:5000", "tpot:1000",
        "--kv-cache-memory", "256MiB", "--time-limit-s", "60", "--request-timeout-s", "30",
        "--result-dir", str(out), "--disable-tqdm",
    ])
    assert code == 0
    result = json.loads((out / "1p1d-4qps.json").read_text())
    assert VLLM_KEYS <= result.keys()
    assert (result["completed"], result["failed"]) == (4, 1), result["errors"]
    assert "INVALID_ARGUMENT" in result["errors"][2]
    assert result["output_lens"] == [8, 9, 0, 10, 11]  # greedy with ignore_eos: exactly as asked
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0 and result["request_goodput"] is not None
    for name in ("ttft_cdf.png", "itl_cdf.png", "latency_vs_rate.png", "throughput_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "== TTFT (ms) ==" in printed and "1 failed requests" in printed
