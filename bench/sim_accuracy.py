"""The simulator against the real stacks, side by side: predicted vs measured TTFT and ITL.

    python bench/sim_accuracy.py --profile cpu.json --modes 1p1d,colocated,2p1d --workload mixed \\
        --request-rates 0.25,0.5,1 --num-prompts 24 --seed 0

Every option but ``--profile``, ``--result-dir``, ``--compare-only`` and ``--tolerance`` is
``pdserve bench``'s and goes unchanged to both ``pdserve bench`` (real stacks, results in
``RESULT_DIR/measured``) and ``pdserve simulate`` (results in ``RESULT_DIR/simulated``), so both
send the same requests at the same times. Then prints, per mode and rate, TTFT p50/p99 and
ITL p50/p99 predicted and measured with the relative error, and writes ``accuracy.json``.
The machine's load average before and after the measured runs is reported with them: on a
shared machine other tenants' work lands in the measurement and not in the prediction.
``--compare-only`` compares result folders from an earlier run.
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
from pdserve.planner import simulate_cli  # noqa: E402

METRICS = (
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
)


def compare(measured_dir: Path, simulated_dir: Path, tolerance: float) -> list[dict]:
    rows = []
    for sim_path in sorted(simulated_dir.glob("*.json")):
        real_path = measured_dir / sim_path.name
        if not real_path.is_file():
            continue
        sim, real = json.loads(sim_path.read_text()), json.loads(real_path.read_text())
        row = {"mode": sim["mode"], "rate": sim["request_rate"], "completed": [real["completed"], sim["completed"]]}
        for key, label in METRICS:
            error = (sim[key] - real[key]) / real[key] if real[key] else None
            row[label] = {
                "measured": real[key],
                "predicted": sim[key],
                "error": error,
                "within": error is not None and abs(error) <= tolerance,
            }
        rows.append(row)
    return rows


def render(rows: list[dict], tolerance: float) -> str:
    head = f"{'mode':>10s} {'rate':>5s}  " + "  ".join(f"{label + ' meas/pred (err)':>28s}" for _, label in METRICS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for _, label in METRICS:
            c = r[label]
            err = "-" if c["error"] is None else f"{c['error']:+.0%}" + ("" if c["within"] else "!")
            cells.append(f"{c['measured']:>9.1f} / {c['predicted']:>8.1f} ({err:>5s})")
        lines.append(f"{r['mode']:>10s} {r['rate']!s:>5s}  " + "  ".join(f"{c:>28s}" for c in cells))
    hits = sum(r[label]["within"] for r in rows for _, label in METRICS)
    lines.append(f"within {tolerance:.0%}: {hits} of {len(rows) * len(METRICS)} figures ('!' marks the others)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="the profile to simulate with (pdserve profile)")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results/sim-accuracy"))
    parser.add_argument("--compare-only", action="store_true", help="compare the result folders of an earlier run")
    parser.add_argument(
        "--tolerance", type=float, default=0.15, help="relative error counted as accurate (default 0.15)"
    )
    args, bench_args = parser.parse_known_args(argv)
    measured, simulated = args.result_dir / "measured", args.result_dir / "simulated"
    load = {}
    if not args.compare_only:
        common = [*bench_args, "--profile", args.profile, "--no-plots"]
        if simulate_cli.main([*common, "--result-dir", str(simulated)]) != 0:
            return 2
        load["before"] = os.getloadavg()
        code = serve.main([*common, "--result-dir", str(measured)])
        load["after"] = os.getloadavg()
        if code != 0:
            print(f"sim_accuracy: pdserve bench exited with {code}; comparing what it wrote", file=sys.stderr)
    rows = compare(measured, simulated, args.tolerance)
    if not rows:
        print(f"sim_accuracy: no result in {simulated} has a measured counterpart in {measured}", file=sys.stderr)
        return 1
    print(render(rows, args.tolerance))
    if load:
        print(f"load average (1, 5, 15 min) before the measured runs {load['before']}, after {load['after']}")
    (args.result_dir / "accuracy.json").write_text(
        json.dumps(
            {
                "profile": args.profile,
                "bench_args": bench_args,
                "tolerance": args.tolerance,
                "load_average": load,
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
