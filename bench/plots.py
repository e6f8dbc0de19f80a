"""PNG plots from result dicts (the same dicts that go to the JSON files).

- ttft_cdf.png, itl_cdf.png: one panel per mode (shared axes; at most 4 a row), a CDF per rate.
- latency_vs_rate.png: rows TTFT/TPOT/ITL/E2EL, columns median/p90/p99, a line per mode.
- throughput_vs_rate.png: request and output-token throughput per mode.
Rates are categories on the x axis (finite rates ascending, then ``inf``), since ``inf``
(and fixed-concurrency runs) have no place on a numeric axis. Modes are whatever labels the
results carry (``2p1d-kv_aware``, ...), in the order they first appear.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.bench.results import LATENCY_METRICS  # noqa: E402

CDF_COLUMNS = 4
PLOT_FILES = ("ttft_cdf.png", "itl_cdf.png", "latency_vs_rate.png", "throughput_vs_rate.png")


def _rate_key(r: dict) -> tuple[float, int]:
    rate = math.inf if r["request_rate"] == "inf" else float(r["request_rate"])
    return rate, r.get("max_concurrency") or 0


def _rate_label(r: dict) -> str:
    label = str(r["request_rate"]) + (" req/s" if r["request_rate"] != "inf" else "")
    return label + (f", conc {r['max_concurrency']}" if r.get("max_concurrency") else "")


def _modes(results: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in results))


def _ok(r: dict, values: list) -> list:
    return [v for v, e in zip(values, r["errors"]) if not e]


def _cdf(results: list[dict], samples, title: str, xlabel: str, path: Path) -> None:
    modes = _modes(results)
    cols = min(CDF_COLUMNS, len(modes))
    rows = math.ceil(len(modes) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), sharex=True, sharey=True, squeeze=False)
    for ax in axes.flat[len(modes) :]:
        ax.set_visible(False)
    for ax, mode in zip(axes.flat, modes):
        for r in sorted((r for r in results if r["mode"] == mode), key=_rate_key):
            x = np.sort(np.asarray(samples(r), dtype=float) * 1e3)
            if len(x):  # the curve starts at 0 just left of the smallest sample
                y = np.arange(len(x) + 1) / len(x)
                ax.step(np.concatenate([x[:1], x]), y, where="post", label=_rate_label(r))
        ax.set_title(mode)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("fraction of samples")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _categories(results: list[dict]) -> list[tuple[float, int]]:
    return sorted({_rate_key(r) for r in results})


def _tick(key: tuple[float, int]) -> str:
    rate = "inf" if math.isinf(key[0]) else f"{key[0]:g}"
    return rate + (f"\nc{key[1]}" if key[1] else "")


def _vs_rate(results: list[dict], fig, axes, series) -> None:
    """series: list of (axes, value(result) -> float, ylabel, title)."""
    cats = _categories(results)
    for ax, value, ylabel, title in series:
        for i, mode in enumerate(_modes(results)):
            runs = sorted((r for r in results if r["mode"] == mode), key=_rate_key)
            xs = [cats.index(_rate_key(r)) for r in runs]
            # The colour cycle has 10 colours; past that, the line style tells modes apart.
            ax.plot(xs, [value(r) for r in runs], marker="o", label=mode, linestyle=("-", "--", ":", "-.")[i // 10 % 4])
        ax.set_xticks(range(len(cats)), [_tick(c) for c in cats])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)


def write_all(results: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOT_FILES]
    _cdf(results, lambda r: _ok(r, r["ttfts"]), "TTFT CDF", "TTFT (ms)", paths[0])
    _cdf(results, lambda r: [g for gaps in _ok(r, r["itls"]) for g in gaps], "ITL CDF", "ITL (ms)", paths[1])

    stats = (("median", "median"), ("p90", "p90"), ("p99", "p99"))
    fig, axes = plt.subplots(len(LATENCY_METRICS), len(stats), figsize=(13, 3.2 * len(LATENCY_METRICS)), squeeze=False)
    series = [
        (axes[i][j], lambda r, k=f"{s}_{key}_ms": r[k], f"{name} (ms)", f"{name} {label}")
        for i, (key, name) in enumerate(LATENCY_METRICS)
        for j, (s, label) in enumerate(stats)
    ]
    _vs_rate(results, fig, axes, series)
    fig.suptitle("Latency percentiles vs request rate")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    _vs_rate(
        results,
        fig,
        axes,
        [
            (axes[0][0], lambda r: r["request_throughput"], "requests/s", "Request throughput"),
            (axes[0][1], lambda r: r["output_throughput"], "output tokens/s", "Output token throughput"),
        ],
    )
    fig.tight_layout()
    fig.savefig(paths[3], dpi=100)
    plt.close(fig)
    return paths
