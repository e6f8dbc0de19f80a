"""The serving benchmark: metrics on hand-computed timelines, arrivals, workloads, result keys,
mode names, prefix hit rates from fake cluster stats, bad input, and one short end-to-end run
against a real 1P1D stack."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from pdserve.bench import arrivals, plots, results, workloads
from pdserve.bench.metrics import Goodput, Timeline, cluster_delta, cluster_snapshot, compute, ttft_by_length
from pdserve.bench.serve import _stack_config, main
from pdserve.bench.serve_plan import build_parser, make_plan, parse_mode

# -- metrics -------------------------------------------------------------------------------


def _timelines() -> list[Timeline]:
    # A: 4 tokens in 3 messages (the last carries 2), so ITLs are per message, not per token.
    a = Timeline(
        prompt_len=10, max_tokens=4, send_time=0.0, chunk_times=[0.5, 0.7, 1.0], chunk_tokens=[1, 1, 2], end_time=1.0
    )
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
    # ITL per token: A's second gap is split over the 2 tokens of its message: 200, 150, 150 ms.
    assert m.itl_per_token.mean == pytest.approx(500 / 3) and m.itl_per_token.median == pytest.approx(150.0)
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
    assert all(
        workloads.TOKEN_ID_RANGE[0] <= t < workloads.TOKEN_ID_RANGE[1] for s in specs for t in s.prompt_token_ids
    )
    assert specs == workloads.build(cfg, WordTokenizer)  # seeded
    share = workloads.build(workloads.WorkloadConfig("sharegpt", num_prompts=2000, seed=0), WordTokenizer)
    ins = np.array([s.prompt_len for s in share])
    assert ins.min() >= 4 and ins.max() <= 1024 and all(s.prompt_len + s.max_tokens <= 2048 for s in share)
    assert np.median(ins) == pytest.approx(math.exp(workloads.SHAREGPT_INPUT[0]), rel=0.15)
    warm = workloads.warmup_specs(specs, 3, seed=1)
    assert [w.prompt_len for w in warm] == [s.prompt_len for s in specs[:3]] and warm[0] != specs[0]


def test_shared_prefix_8_system_prompts_x_16_users():
    cfg = workloads.WorkloadConfig("shared-prefix", num_prompts=128, num_prefixes=8, prefix_len=40, input_len=(5, 8))
    specs = workloads.build(cfg, WordTokenizer)
    assert all(45 <= s.prompt_len <= 48 for s in specs)
    groups = workloads.prefix_groups(specs, 40)
    assert sorted(groups.count(g) for g in set(groups)) == [16] * 8  # 8 system prompts x 16 users
    # Every user of a system prompt sends exactly its token ids, then a question of its own.
    assert len({s.prompt_token_ids[40:] for s in specs}) == 128
    for g in range(8):
        members = [s for s, x in zip(specs, groups) if x == g]
        assert len({s.prompt_token_ids[:40] for s in members}) == 1
    # Shuffled: not a fixed stride, so round-robin over 2 workers splits every system prompt.
    assert all(len({i % 2 for i, x in enumerate(groups) if x == g}) == 2 for g in range(8))
    assert specs == workloads.build(cfg, WordTokenizer)


def test_mixed_workload_is_bimodal_and_seeded():
    cfg = workloads.WorkloadConfig("mixed", num_prompts=400, seed=5)
    specs = workloads.build(cfg, WordTokenizer)
    assert specs == workloads.build(cfg, WordTokenizer)
    assert specs != workloads.build(workloads.WorkloadConfig("mixed", num_prompts=400, seed=6), WordTokenizer)
    long = [s for s in specs if s.prompt_len >= 256]
    short = [s for s in specs if s.prompt_len < 256]
    assert len(long) == 80  # exactly round(0.2 * 400)
    assert all(32 <= s.prompt_len <= 128 and 16 <= s.max_tokens <= 64 for s in short)
    assert all(1024 <= s.prompt_len <= 2048 and 128 <= s.max_tokens <= 256 for s in long)
    positions = [i for i, s in enumerate(specs) if s.prompt_len >= 256]
    assert positions[0] < 100 and positions[-1] > 300  # spread through the run, not bunched
    # --input-len/--output-len set the short class; long prompts are clipped to the context.
    cfg = workloads.WorkloadConfig(
        "mixed",
        num_prompts=10,
        input_len=(8, 8),
        output_len=(2, 2),
        long_fraction=0.5,
        long_input_len=(9000, 9000),
        long_output_len=(100, 100),
    )
    lens = sorted((s.prompt_len, s.max_tokens) for s in workloads.build(cfg, WordTokenizer))
    assert lens == [(8, 2)] * 5 + [(workloads.MAX_MODEL_LEN - 100, 100)] * 5
    no_long = workloads.build(workloads.WorkloadConfig("mixed", num_prompts=20, long_fraction=0), WordTokenizer)
    assert all(s.prompt_len <= 128 for s in no_long)
    for bad in ({"long_fraction": 1.5}, {"long_input_len": (5, 2)}, {"long_output_len": (8192, 8192)}):
        with pytest.raises(workloads.WorkloadError):
            workloads.WorkloadConfig("mixed", **bad)


def test_each_rate_gets_a_workload_variant_with_nothing_cached_in_common():
    cfg = workloads.WorkloadConfig("shared-prefix", num_prompts=12, num_prefixes=3, prefix_len=40, input_len=(5, 8))
    specs = workloads.build(cfg, WordTokenizer)
    assert workloads.variant(specs, 0) == specs
    variants = [workloads.variant(specs, k) for k in range(3)]
    top = max(t for s in specs for t in s.prompt_token_ids)
    for v in variants:
        assert [(s.prompt_len, s.max_tokens) for s in v] == [(s.prompt_len, s.max_tokens) for s in specs]
        assert workloads.prefix_groups(v, 40) == workloads.prefix_groups(specs, 40)  # the same sharing
        assert all(t <= top for s in v for t in s.prompt_token_ids)  # ids the model knows
        assert all(a.prompt_token_ids[1:] == b.prompt_token_ids[1:] for a, b in zip(v, specs))
    firsts = [{s.prompt_token_ids[0] for s in v} for v in variants]
    assert not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2]) and not (firsts[0] & firsts[2])


def test_jsonl_workload(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "one two three", "output_len": 5}\n\n{"prompt_token_ids": [7, 8], "max_tokens": 2}\n{"prompt": "x"}\n'
    )
    specs = workloads.build(
        workloads.WorkloadConfig("jsonl", num_prompts=3, path=str(path), output_len=(9, 9)), WordTokenizer
    )
    assert [(s.prompt_len, s.max_tokens) for s in specs] == [(4, 5), (2, 2), (2, 9)]
    specs = workloads.build(  # a file shorter than --num-prompts is sent over again, as vLLM oversamples
        workloads.WorkloadConfig("jsonl", num_prompts=7, path=str(path), output_len=(9, 9)), WordTokenizer
    )
    assert [s.prompt_len for s in specs] == [4, 2, 2, 4, 2, 2, 4]
    for line, error in [
        ("{bad", "not valid JSON"),
        ('{"text": "a"}', "needs a non-empty"),
        ('{"prompt": "a", "output_len": 0}', "output_len"),
    ]:
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(workloads.WorkloadError, match=rf"p\.jsonl:2: {error}"):
            workloads.build(workloads.WorkloadConfig("jsonl", path=str(path)), WordTokenizer)


# -- results and bad input -----------------------------------------------------------------

VLLM_KEYS = {
    "date",
    "backend",
    "label",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
} | {f"{s}_{k}_ms" for s in ("mean", "median", "std", "p99") for k in ("ttft", "tpot", "itl", "e2el")}


def test_extractive_prompts_quote_python_docs_and_are_seeded():
    from pydoc_data.topics import topics

    cfg = workloads.WorkloadConfig("extractive", num_prompts=30, seed=3)
    specs = workloads.build(cfg, WordTokenizer)
    assert specs == workloads.build(cfg, WordTokenizer)
    assert specs != workloads.build(workloads.WorkloadConfig("extractive", num_prompts=30, seed=4), WordTokenizer)
    lo, hi = workloads.DEFAULT_INPUT_LEN["extractive"]
    assert all(s.prompt_len >= lo and 64 <= s.max_tokens <= 128 for s in specs)
    assert min(s.prompt_len for s in specs) < hi + 200  # whole paragraphs: a little past the drawn length
    # Each prompt is an instruction, then a passage of the docs (WordTokenizer: one id per word).
    docs = {WordTokenizer().encode(w, add_special_tokens=False)[0] for text in topics.values() for w in text.split()}
    for s in specs:
        passage = s.prompt_token_ids[1 + 12 :]  # after BOS and the instruction's first words
        assert sum(t in docs for t in passage) > 0.9 * len(passage)
    # Typos are swapped letters inside words of the passage, a few per passage.
    text = "alpha bravo charlie delta echo foxtrot golf hotel india juliet"
    typoed = workloads._with_typos(np.random.default_rng(0), text, 3)
    changed = [(a, b) for a, b in zip(text.split(), typoed.split()) if a != b]
    assert 1 <= len(changed) <= 3 and all(sorted(a) == sorted(b) and a[0] == b[0] for a, b in changed)


def test_result_uses_vllm_key_names():
    info = results.RunInfo("1p1d", "pdserve-grpc", "default", "random", 3, math.inf, 1.0, None, 0, Goodput(ttft_ms=400))
    tl = _timelines()
    r = results.to_result(info, compute(tl, 2.0, info.goodput), tl)
    assert VLLM_KEYS <= r.keys() and {"p90_ttft_ms", "p90_itl_ms"} <= r.keys()
    assert r["request_rate"] == "inf" and r["errors"] == ["", "", "UNAVAILABLE: no worker"]
    assert r["output_lens"] == [4, 1, 0] and r["itls"][0] == pytest.approx([0.2, 0.3]) and r["ttfts"][0] == 0.5
    assert results.file_name(info) == "1p1d-infqps.json"
    json.dumps(r)


def _tl(prompt_len: int, ttft: float, error: str = "") -> Timeline:
    return Timeline(
        prompt_len,
        2,
        send_time=10.0,
        chunk_times=[10.0 + ttft, 10.0 + ttft + 0.1],
        chunk_tokens=[1, 1],
        end_time=10.0 + ttft + 0.1,
        error=error,
    )


def test_ttft_split_by_prompt_length():
    tls = [_tl(50, 0.1), _tl(255, 0.3), _tl(100, 0.2), _tl(256, 2.0), _tl(2000, 4.0), _tl(60, 9.0, error="UNAVAILABLE")]
    split = ttft_by_length(tls, short_threshold=256)
    assert (split["num_short"], split["num_long"]) == (3, 2)  # the failed one counts in neither
    assert split["short_ttft_p50_ms"] == pytest.approx(200.0)
    assert split["short_ttft_p99_ms"] == pytest.approx(200 + 0.98 * 100)
    assert split["long_ttft_p50_ms"] == pytest.approx(3000.0)
    assert split["long_ttft_p99_ms"] == pytest.approx(2000 + 0.99 * 2000)
    none_long = ttft_by_length(tls[:3], short_threshold=256)
    assert none_long["num_long"] == 0 and none_long["long_ttft_p99_ms"] is None
    assert ttft_by_length(tls, short_threshold=100)["num_short"] == 1


def _stats(workers, counters=None):
    from pdserve.v1 import pdserve_pb2 as pb

    return pb.ClusterStats(
        counters=counters or {},
        workers=[
            pb.WorkerStats(
                address=a,
                role=role,
                healthy=healthy,
                counters={"prefix_hits": h, "prefix_queries": q} if healthy else {},
            )
            for a, role, h, q, healthy in workers
        ],
    )


def test_prefix_hit_rate_from_cluster_stats_before_and_after():
    before = cluster_snapshot(
        _stats(
            [("p0", "prefill", 10, 20, True), ("p1", "prefill", 0, 4, True), ("d0", "decode", 1, 2, True)],
            {"retries": 1.0},
        )
    )
    after = cluster_snapshot(
        _stats(
            [("p0", "prefill", 40, 60, True), ("p1", "prefill", 20, 44, True), ("d0", "decode", 3, 102, True)],
            {"retries": 1.0, "migrations": 2.0, "finished_length": 8.0},
        )
    )
    d = cluster_delta(before, after)
    assert d["prefix_hit_rate"] == pytest.approx(50 / 80)  # prefill workers only: (30 + 20) / (40 + 40)
    assert d["prefix_cache"]["prefill"] == {"hits": 50, "queries": 80, "hit_rate": pytest.approx(0.625)}
    assert d["prefix_cache"]["decode"]["hit_rate"] == pytest.approx(0.02)
    assert (d["migrations"], d["retries"], d["router_counters"]) == (
        2.0,
        0.0,
        {"finished_length": 8.0, "migrations": 2.0},
    )
    assert d["incomplete"] is False
    # Colocated: no prefill worker, so the colocated worker's lookups count.
    co = cluster_delta(
        cluster_snapshot(_stats([("c0", "colocated", 0, 0, True)])),
        cluster_snapshot(_stats([("c0", "colocated", 9, 12, True)])),
    )
    assert co["prefix_hit_rate"] == pytest.approx(0.75) and co["migrations"] == 0.0
    # A restarted worker counts from 0; one that did not answer is left out and flagged.
    odd = cluster_delta(
        before, cluster_snapshot(_stats([("p0", "prefill", 3, 6, True), ("p1", "prefill", 0, 0, False)]))
    )
    assert odd["prefix_hit_rate"] == pytest.approx(0.5) and odd["incomplete"] is True
    nothing = cluster_delta(before, before)
    assert nothing["prefix_hit_rate"] is None and nothing["router_counters"] == {}


def test_speculative_counters_over_a_run():
    from pdserve.v1 import pdserve_pb2 as pb

    def stats(*workers):
        return cluster_snapshot(
            pb.ClusterStats(
                workers=[
                    pb.WorkerStats(
                        address=a, role=r, healthy=True, counters={"prefix_hits": 0, "prefix_queries": 0, **c}
                    )
                    for a, r, c in workers
                ]
            )
        )

    plain = stats(("p0", "prefill", {}), ("d0", "decode", {}))
    assert cluster_delta(plain, plain)["speculative"] is None  # no worker speculates
    before = stats(
        ("p0", "prefill", {}),
        ("d0", "decode", dict(spec_drafts=5, spec_draft_tokens=20, spec_accepted_tokens=10)),
        ("d1", "decode", dict(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)),
    )
    after = stats(
        ("p0", "prefill", {}),
        ("d0", "decode", dict(spec_drafts=15, spec_draft_tokens=60, spec_accepted_tokens=40)),
        ("d1", "decode", dict(spec_drafts=10, spec_draft_tokens=20, spec_accepted_tokens=5)),
    )
    spec = cluster_delta(before, after)["speculative"]
    assert spec == {
        "drafts": 20,
        "draft_tokens": 60,
        "accepted_tokens": 35,
        "acceptance_rate": pytest.approx(35 / 60),
        "mean_accepted_length": pytest.approx(1 + 35 / 20),
    }
    tls = _timelines()
    info = results.RunInfo("1p1d-ngram", "pdserve-grpc", "default", "extractive", 3, 1.0, 1.0, None, 0, Goodput())
    r = results.to_result(info, compute(tls, 2.0), tls, cluster_delta(before, after))
    assert r["speculative"] == spec and r["median_itl_per_token_ms"] == pytest.approx(150.0)
    out = io.StringIO()
    results.print_tables([r], out)
    text = out.getvalue()
    assert "== Speculative decoding (over each run) ==" in text and "58.3%" in text and "2.75" in text


def test_results_and_tables_carry_prefix_hits_and_the_ttft_split(tmp_path):
    tls = [_tl(50, 0.1), _tl(1500, 2.0)]
    cluster = cluster_delta(
        cluster_snapshot(_stats([("p0", "prefill", 0, 0, True)])),
        cluster_snapshot(_stats([("p0", "prefill", 3, 4, True)])),
    )
    runs = []
    for label in ("2p1d-kv_aware", "2p1d-round_robin-nochunk", "colocated", "hf"):
        info = results.RunInfo(label, "pdserve-grpc", "default", "mixed", 2, 1.0, 1.0, None, 0, Goodput())
        runs.append(results.to_result(info, compute(tls, 3.0), tls, None if label == "hf" else cluster))
    assert runs[0]["prefix_hit_rate"] == 0.75 and runs[3]["prefix_hit_rate"] is None and runs[3]["migrations"] is None
    assert runs[0]["short_ttft_p99_ms"] == pytest.approx(100.0) and runs[0]["long_ttft_p99_ms"] == pytest.approx(2000.0)
    json.dumps(runs)
    out = io.StringIO()
    results.print_tables(runs, out)
    text = out.getvalue()
    assert "prefix hit" in text and "75.0%" in text and "3/4" in text
    assert "== TTFT by prompt length (ms; short: < 256 tokens) ==" in text and "2p1d-round_robin-nochunk" in text
    for r in runs:
        r["workload"] = "random"
    out = io.StringIO()
    results.print_tables(runs, out)
    assert "TTFT by prompt length" not in out.getvalue()
    # Plots take any labels, more than fit in one row.
    more = [dict(runs[0], mode=f"{n}p1d-least_loaded") for n in range(1, 4)]
    for path in plots.write_all(runs + more, tmp_path):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "modes, expected",
    [
        ("1p1d", [("1p1d", 1, 1, False, "kv_aware", True)]),
        (
            "colocated,colocated-nochunk",
            [("colocated", 0, 1, True, "kv_aware", True), ("colocated-nochunk", 0, 1, True, "kv_aware", False)],
        ),
        (
            "2p1d-kv_aware,2p1d-round_robin",
            [("2p1d-kv_aware", 2, 1, False, "kv_aware", True), ("2p1d-round_robin", 2, 1, False, "round_robin", True)],
        ),
        (
            "1p1d, 1p1d-nochunk",
            [("1p1d", 1, 1, False, "kv_aware", True), ("1p1d-nochunk", 1, 1, False, "kv_aware", False)],
        ),
        ("3p2d-nochunk-least_loaded", [("3p2d-nochunk-least_loaded", 3, 2, False, "least_loaded", False)]),
    ],
)
def test_modes_name_the_stack_they_start(modes, expected):
    plan = make_plan(build_parser().parse_args(["--modes", modes]))
    got = []
    for mode in plan.modes:
        engine, router, cluster = _stack_config(mode, plan)
        got.append(
            (
                mode.label,
                cluster.prefill,
                cluster.decode,
                cluster.colocated,
                router.policy,
                engine.enable_chunked_prefill,
            )
        )
    assert got == expected
    assert [parse_mode(m).kind for m in ("live", "hf", "1p1d")] == ["live", "hf", "stack"]
    # --policy is the default of modes that name none.
    plan = make_plan(build_parser().parse_args(["--modes", "1p1d,1p1d-kv_aware", "--policy", "least_loaded"]))
    assert [_stack_config(m, plan)[1].policy for m in plan.modes] == ["least_loaded", "kv_aware"]


def test_speculative_mode_suffixes_turn_it_on_per_stack():
    plan = make_plan(
        build_parser().parse_args(
            [
                "--modes",
                "colocated,colocated-ngram,1p1d-nochunk-draft",
                "--draft-model",
                "default",
                "--num-speculative-tokens",
                "3",
            ]
        )
    )
    engines = [_stack_config(m, plan)[0] for m in plan.modes]
    assert [(e.speculative, e.enable_chunked_prefill) for e in engines] == [
        ("none", True),
        ("ngram", True),
        ("draft", False),
    ]
    assert all(e.num_speculative_tokens == 3 for e in engines)
    # --speculative is what modes without a suffix get.
    plan = make_plan(
        build_parser().parse_args(["--modes", "1p1d,1p1d-draft", "--speculative", "ngram", "--draft-model", "default"])
    )
    assert [_stack_config(m, plan)[0].speculative for m in plan.modes] == ["ngram", "draft"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--request-rates", "0"], "request rate must be > 0"),
        (["--request-rates=-2,1"], "request rate must be > 0"),
        (["--modes", "1p1d,turbo"], "unknown mode turbo"),
        (["--modes", "2p1d-fast"], "unknown mode 2p1d-fast: bad or repeated suffix -fast"),
        (["--modes", "1p1d-nochunk-nochunk"], "bad or repeated suffix -nochunk"),
        (["--modes", "1p1d-kv_aware-round_robin"], "bad or repeated suffix -round_robin"),
        (["--modes", "1p1d-ngram-draft"], "bad or repeated suffix -draft"),
        (["--modes", "colocated-draft"], "a -draft mode needs the draft model: give --draft-model PATH"),
        (["--num-speculative-tokens", "0"], "num_speculative_tokens must be an integer in [1, 16]"),
        (["--modes", "live-nochunk"], "live takes no suffix"),
        (["--modes", "0p1d"], "need 1 to 16 prefill and decode workers"),
        (["--modes", "1p1d,1p1d"], "mode 1p1d given twice"),
        (["--request-rates", "5,5.0"], "request rate '5.0' is given twice"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "x.json"],
            "--dataset-path is read by the jsonl workload only",
        ),
        (["--modes", ","], "no mode given"),
        (["--workload", "mixed", "--long-fraction", "2"], "--long-fraction must be in [0, 1]"),
        (["--short-threshold", "0"], "--short-threshold must be >= 1"),
        (["--input-len", "9:3"], "LO:HI"),
        (["--goodput", "ttft:abc"], "not a number"),
        (["--temperature", "-1"], "sampling.temperature: must be in [0,"),
        (["--top-p", "0"], "sampling.top_p: must be in (0, 1]"),
        (["--addr", "127.0.0.1:9", "--connect-timeout-s", "1"], "cannot reach a router at 127.0.0.1:9"),
    ],
)
def test_bad_input_gives_a_message_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--result-dir", str(tmp_path), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes-mib", "nan"], "finite and > 0"),
        (["--sizes-mib", "inf"], "finite and > 0"),
        (["--parts", ""], "lists not empty"),
        (["--json", "/nonexistent-folder/k.json"], "is not a folder"),
    ],
)
def test_kv_transfer_bench_refuses_bad_arguments_before_running(argv, message, capsys):
    from pdserve.bench import kv_transfer_bench

    with pytest.raises(SystemExit) as exit_:
        kv_transfer_bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["overhead", "--repeats", "0"], "--repeats must be >= 1"),
        (["quality", "--text-tokens", "1"], "--text-tokens must be >= 2"),
        (["throughput", "--num-requests", "0"], "--num-requests must be >= 1"),
        (["overhead", "--batch-sizes", "0,8"], "--batch-sizes must be integers >= 1"),
    ],
)
def test_engine_bench_refuses_bad_arguments_before_running(argv, message, capsys):
    from pdserve.bench import engine_bench

    with pytest.raises(SystemExit) as exit_:
        engine_bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


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
    # "auto", pdserve bench's default dtype, read as the engine reads it.
    sampled = run_hf(specs, HFConfig(dtype="auto", num_threads=1, progress=False, temperature=0.8, top_p=0.9))
    assert [t.output_tokens for t in sampled.timelines] == [3, 5] and all(t.success for t in sampled.timelines)


@pytest.mark.e2e
def test_end_to_end_against_a_started_1p1d_stack(tmp_path, capsys):
    # The user's own prompts; one has a token id outside the vocabulary: it must fail, be
    # counted and shown, and not disturb the others.
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Tell me fact number {i} about the sea.", "output_len": 8 + i} for i in range(4)]
    lines.insert(2, {"prompt_token_ids": [5, 10**9], "output_len": 8})
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results"
    code = main(
        [
            "--modes",
            "1p1d",
            "--workload",
            "jsonl",
            "--dataset-path",
            str(prompts),
            "--num-prompts",
            "5",
            "--request-rates",
            "4",
            "--warmup",
            "1",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--kv-cache-memory",
            "256MiB",
            "--time-limit-s",
            "60",
            "--request-timeout-s",
            "30",
            "--result-dir",
            str(out),
            "--disable-tqdm",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
        ]
    )
    assert code == 0
    result = json.loads((out / "1p1d-4qps.json").read_text())
    assert VLLM_KEYS <= result.keys()
    assert (result["completed"], result["failed"]) == (4, 1), result["errors"]
    assert "INVALID_ARGUMENT" in result["errors"][2]
    assert result["output_lens"] == [8, 9, 0, 10, 11]  # ignore_eos: exactly as asked, sampled or not
    assert (result["temperature"], result["top_p"]) == (0.8, 0.9)
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0 and result["request_goodput"] is not None
    for name in ("ttft_cdf.png", "itl_cdf.png", "latency_vs_rate.png", "throughput_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "== TTFT (ms) ==" in printed and "1 failed requests" in printed


@pytest.mark.e2e
def test_router_overhead_compares_both_paths_on_a_real_cluster(capsys):
    from pdserve.bench import router_overhead

    assert router_overhead.main(["--requests", "4", "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 4 and report["prompt_tokens"] > 0
    assert report["max_tokens"] >= 2  # both paths wait for the KV handoff's acknowledgement
    assert report["ttft_router_p50_ms"] > 0 and report["ttft_direct_p50_ms"] > 0
    assert math.isclose(
        report["router_added_p50_ms"], report["ttft_router_p50_ms"] - report["ttft_direct_p50_ms"], abs_tol=0.02
    )


def test_sampling_bench_times_each_setting_on_the_real_model(capsys):
    from pdserve.bench import engine_bench

    assert engine_bench.main(["sampling", "--batch-sizes", "2", "--repeats", "2", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["by_batch"]["2"]
    assert set(rows) == set(engine_bench.SAMPLING_SETTINGS)
    assert all(row["step_ms"] > 0 and row["sampler_ms"] > 0 for row in rows.values())
    # --dtype auto (the default) is reported as what the engine resolved it to.
    assert report["dtype"] in ("float32", "bfloat16")


@pytest.mark.parametrize(
    "script, argv, words",
    [
        ("speculative_bench", ["--output-len", "abc"], "length range"),
        ("speculative_bench", ["--parts", "foo"], "--parts"),
        ("speculative_bench", ["--k", "0"], "--k"),
        ("speculative_bench", ["--draft-layers", "x"], "invalid literal"),
        ("parallel_bench", ["measure", "--layouts", "0x1"], "--layouts"),
        ("parallel_bench", ["measure", "--layouts", "abc"], "--layouts"),
        ("paper_plan", ["--num-prompts", "0"], "--num-prompts"),
    ],
)
def test_bench_scripts_refuse_bad_arguments_in_one_line_before_loading_anything(
    script, argv, words, monkeypatch, capsys
):
    import importlib

    module = importlib.import_module(f"pdserve.bench.{script}")
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv) if script != "parallel_bench" else module.main()
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_the_llamacpp_comparison_without_llama_cpp_python_says_how_to_install_it(monkeypatch):
    import importlib.util

    from pdserve.bench import engine_bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        engine_bench.main(["llamacpp"])
    assert str(e.value).startswith("llama-cpp-python is not installed: ") and "pdserve[bench]" in str(e.value)
