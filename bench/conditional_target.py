"""Conditional disaggregation against both fixed modes, on one machine, in one run.

    python bench/conditional_target.py --profile cpu.json --goodput ttft:4000 tpot:50 --slo-tpot-ms 50 \\
        --workload mixed --request-rates 0.25,0.5,1 --num-prompts 24 --seed 0

Runs ``pdserve bench`` with modes colocated, 1p1d and 1p1d-conditional (every stack gets the
profile: with ``--slo-tpot-ms``, each worker that mixes prefill into decode steps sizes its
chunks from it) and checks its target at each rate: goodput of 1p1d-conditional
>= 1.1x the better of colocated and 1p1d, with ITL p99 no worse than 1p1d's + 20%. The SLO
(``--goodput``) is fixed on the command line, before the run. Every other option is
``pdserve bench``'s. ``--compare-only`` checks the results of an earlier run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

from pdserve.bench import serve  # noqa: E402

MODES = ("colocated", "1p1d", "1p1d-conditional")
GOODPUT_RATIO = 1.1
ITL_SLACK = 1.2


def check(result_dir: Path) -> list[dict]:
    by_key = {}
    for path in result_dir.glob("*.json"):
        r = json.loads(path.read_text())
        if r.get("mode") in MODES:
            by_key[(r["mode"], r["request_rate"])] = r
    rows = []
    for rate in sorted({rate for _, rate in by_key}, key=float):
        runs = {m: by_key.get((m, rate)) for m in MODES}
        if any(r is None for r in runs.values()):
            continue
        good = {m: r["request_goodput"] or 0.0 for m, r in runs.items()}
        best_fixed = max(good["colocated"], good["1p1d"])
        ratio = good["1p1d-conditional"] / best_fixed if best_fixed else float("inf")
        itl = {m: r["p99_itl_ms"] for m, r in runs.items()}
        rows.append(
            {
                "rate": rate,
                "goodput": good,
                "goodput_ratio": ratio,
                "itl_p99_ms": itl,
                "ttft_p50_ms": {m: r["median_ttft_ms"] for m, r in runs.items()},
                "local_prefills": _local_prefills(runs["1p1d-conditional"]),
                "goodput_met": ratio >= GOODPUT_RATIO,
                "itl_met": itl["1p1d-conditional"] <= ITL_SLACK * itl["1p1d"],
            }
        )
    return rows


def _local_prefills(result: dict) -> float | None:
    """Prompts the decode worker prefilled itself: the router's counter (measured) or the simulator's."""
    counters = result.get("router_counters") or {}
    if "conditional_local_prefills" in counters:
        return counters["conditional_local_prefills"]
    return (result.get("sim_counters") or {}).get("prefill_local")


def render(rows: list[dict]) -> str:
    lines = [
        f"{'rate':>5s} {'goodput col / 1p1d / cond':>28s} {'ratio':>6s} {'ITL p99 1p1d / cond':>22s} "
        f"{'TTFT p50 col / 1p1d / cond':>28s} {'local':>6s}  target"
    ]
    for r in rows:
        g, i, t = r["goodput"], r["itl_p99_ms"], r["ttft_p50_ms"]
        met = (
            "met"
            if r["goodput_met"] and r["itl_met"]
            else (
                "missed: "
                + ", ".join(name for name, ok in (("goodput", r["goodput_met"]), ("ITL", r["itl_met"])) if not ok)
            )
        )
        lines.append(
            f"{r['rate']!s:>5s} {g['colocated']:>8.2f} / {g['1p1d']:.2f} / {g['1p1d-conditional']:.2f}"
            f"{r['goodput_ratio']:>7.2f}x {i['1p1d']:>9.1f} / {i['1p1d-conditional']:.1f}"
            f"{t['colocated']:>11.0f} / {t['1p1d']:.0f} / {t['1p1d-conditional']:.0f}"
            f" {r['local_prefills'] or 0:>6.0f}  {met}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results/conditional"))
    parser.add_argument("--compare-only", action="store_true")
    args, bench_args = parser.parse_known_args(argv)
    if "--goodput" not in bench_args:
        parser.error("fix the SLO before the run: --goodput ttft:MS tpot:MS")
    load = {}
    if not args.compare_only:
        load["before"] = os.getloadavg()
        code = serve.main([*bench_args, "--modes", ",".join(MODES), "--result-dir", str(args.result_dir)])
        load["after"] = os.getloadavg()
        if code == 2:
            return 2
    rows = check(args.result_dir)
    if not rows:
        print(
            f"conditional_target: no complete set of {', '.join(MODES)} results in {args.result_dir}", file=sys.stderr
        )
        return 1
    print(render(rows))
    if load:
        print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    (args.result_dir / "target.json").write_text(
        json.dumps({"bench_args": bench_args, "load_average": load, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
