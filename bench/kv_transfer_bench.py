"""KV-transfer benchmark: throughput per transport beside memcpy, a raw socket and raw UCX,
and TTFT with per-layer pipelining vs send-after-prefill. Every figure comes from one process run.

    python bench/kv_transfer_bench.py                                   # everything (a few minutes)
    python bench/kv_transfer_bench.py --sizes-mib 1,16 --repeats 3 --parts micro --json out.json

Parts:

* ``micro``: payloads of ``--sizes-mib`` (a synthetic cache of the default model's geometry:
  30 layers, 3 KV heads, head dim 64, fp32, blocks of 16 tokens; the token count is chosen so
  that layers x tokens x token bytes is as close to the size as whole tokens allow). Methods,
  measured interleaved sample by sample, so load on a shared machine hits them alike:
  ``memcpy`` (numpy copyto, one thread), ``raw_socket`` (blocking TCP over loopback: sendall
  from one buffer, a thread doing recv_into into another, then a 1-byte ack), ``raw_ucx`` (the
  payload as one UCX tagged message between two workers; with ucx), and each pdserve transport
  (``tcp``, ``shm``, ``ucx``): one transfer of all layers of all tokens, the real sender and
  receiver, timed from the first ``send_layer`` to the ACK. The receiver runs in a child
  process, as a decode worker does (``--decode-in-process``: in this one, sharing its GIL).
  Every method writes into zeroed memory and every copy is checked (xxh3 of what landed ==
  xxh3 of the source).
* ``real``: the same for the KV of a ``--prompt-tokens`` prompt on the default model's layout,
  in fp32 and bf16.
* ``ttft``: a real ``LLMEngine`` (default model, in the dtype ``pdserve up`` picks here unless
  ``--ttft-dtype`` says otherwise) as the prefill side, its KV connector
  shipping to a decode side per transport (a child process, as above). The engine gets the
  torch threads ``pdserve up`` gives a 1P1D prefill worker here, every core, waiting passively
  (``--prefill-threads``). Per repeat and
  transport, a triple run back to back in a rotating order: (a) prefill alone (to the first
  token), (b) pipelined (layers leave as they are computed) and (c) send-after-prefill, each
  timed from add_request to the decode side's ACK. Differences are taken within a triple,
  then the median; the tails are the ACK time minus the time the first token came out.

GB/s are decimal (1e9 bytes/s); figures are medians over samples.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # as a script only: imported (the profiler, tests), it leaves the environment alone
    # Before pdserve.kvtransfer.ucx imports ucxx: quiet, and on loopback for network transports
    # (same-host UCX endpoints use shared memory / CMA anyway). Like tests/conftest.py.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    # Before torch loads OpenMP: the TTFT part's prefill engine waits as a pdserve up prefill
    # worker does (--share-cores), its threads sleeping while the transfer's threads run. Every
    # process started from here inherits it, so it must not leak into stacks started by an
    # importer (``pdserve profile`` measured its stacks with passive decode workers).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from pdserve.bench.kv_payloads import MIB, Geometry, measure_payload, samples_for  # noqa: E402
from pdserve.bench.kv_ttft import measure_ttft  # noqa: E402
from pdserve.bench.machine_load import LoadProbe  # noqa: E402
from pdserve.kvtransfer import registry  # noqa: E402
from pdserve.kvtransfer.ucx_worker import UcxWorker, ucx_available  # noqa: E402
from pdserve.placement import shared_prefill_threads  # noqa: E402

ALL_TRANSPORTS = tuple(name for name in registry.TRANSPORT_NAMES if name != "cuda_ipc")  # CPU caches here


# -- targets, table, main ----------------------------------------------------------------------------------


TARGETS = {  # ratio key -> minimum, at 16 MiB and up
    "ucx_vs_raw_socket": 2.0,
    "ucx_vs_raw_ucx": 0.8,
    "shm_vs_memcpy": 0.5,
    "tcp_vs_raw_socket": 0.9,
}
MIN_TARGET_BYTES = 15 * MIB  # "16 MiB and up": that payload is whole tokens, a little under 16 MiB
MAX_HANDOFF_MS = 10.0  # what a real request's handoff may add to TTFT over prefill alone (shm, UCX)


def check_targets(rows: list[dict], ttft: dict | None) -> list[dict]:
    checks = []
    for row in rows:
        if row["bytes"] < MIN_TARGET_BYTES:
            continue
        for key, minimum in TARGETS.items():
            if key in row["ratios"]:
                value = row["ratios"][key]
                checks.append(
                    {"row": row["label"], "target": f"{key} >= {minimum}", "value": value, "met": value >= minimum}
                )
    if ttft:
        for t, r in ttft["per_transport"].items():
            checks.append(
                {
                    "row": f"ttft {t}",
                    "target": "pipelined - after prefill <= 0 ms",
                    "value": r["pipelined_minus_after_ms"],
                    "met": r["pipelined_minus_after_ms"] <= 0,
                }
            )
            if t in ("shm", "ucx"):  # in the mode a prefill worker with these threads uses
                added = r["exposed_pipelined_ms" if ttft["deployed_mode"] == "pipelined" else "transfer_ms"]
                checks.append(
                    {
                        "row": f"ttft {t}",
                        "target": f"handoff adds <= {MAX_HANDOFF_MS} ms ({ttft['deployed_mode']}, as deployed)",
                        "value": added,
                        "met": added <= MAX_HANDOFF_MS,
                    }
                )
    return checks


def _fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"KV transfer benchmark  cores={m['cpu_count']}  loadavg {m['loadavg_start']} -> {m['loadavg_end']}  "
        f"other-process CPU {_fmt(m['other_cpu_share'], '.1%')} of the machine  wall {m['wall_s']} s",
    ]
    rows = result.get("micro", []) + result.get("real_request", [])
    if rows:
        names = list(rows[0]["gbps"])
        lines.append("")
        lines.append("GB/s (1e9 B/s), median of samples; blocks " + rows[0]["block_arrangement"])
        head = f"{'payload':<22}{'MB':>8}{'n':>4}" + "".join(f"{k:>11}" for k in names)
        head += f"{'tcp/raw':>9}{'shm/mcpy':>9}{'ucx/raw':>9}{'ucx/rucx':>9}"
        lines.append(head)
        for row in rows:
            r = row["ratios"]
            line = f"{row['label']:<22}{row['bytes'] / 1e6:>8.1f}{row['samples']:>4}"
            line += "".join(f"{row['gbps'][k]:>11.2f}" for k in names)
            line += "".join(
                f"{_fmt(r.get(k)):>9}"
                for k in ("tcp_vs_raw_socket", "shm_vs_memcpy", "ucx_vs_raw_socket", "ucx_vs_raw_ucx")
            )
            lines.append(line)
    ttft = result.get("ttft")
    if ttft:
        lines.append("")
        lines.append(
            f"TTFT, {ttft['prompt_tokens']}-token prompt, default model {ttft['dtype']}, KV {ttft['transfer_bytes'] / 1e6:.1f} MB, "
            f"{ttft['torch_threads']} prefill thread(s), {ttft['repeats']} triples per transport; "
            "medians, differences taken within each triple"
        )
        lines.append(
            f"{'transport':<10}{'(a) alone':>10}{'(b) pipe':>10}{'(c) after':>10}{'b-a':>8}{'c-a':>8}{'b-c':>8}"
            f"{'tail b':>8}{'tail c':>8}"
        )
        for t, r in ttft["per_transport"].items():
            lines.append(
                f"{t:<10}{r['prefill_ms']:>10.1f}{r['pipelined_ms']:>10.1f}{r['after_prefill_ms']:>10.1f}"
                f"{r['exposed_pipelined_ms']:>8.1f}{r['transfer_ms']:>8.1f}{r['pipelined_minus_after_ms']:>8.1f}"
                f"{r['tail_pipelined_ms']:>8.1f}{r['tail_after_prefill_ms']:>8.1f}"
            )
    checks = result.get("targets", [])
    if checks:
        lines.append("")
        lines.append("targets:")
        for c in checks:
            lines.append(f"  {'MET ' if c['met'] else 'MISS'} {c['row']:<22} {c['target']:<32} {_fmt(c['value'])}")
    return "\n".join(lines)


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def run(args) -> dict:
    probe = LoadProbe()
    skipped = {}
    transports = []
    for t in args.transports:
        reason = registry.get(t).load().unavailable_reason(torch.device("cpu"))
        if reason:
            skipped[t] = reason
        else:
            transports.append(t)
    ucx_pair = (UcxWorker(), UcxWorker()) if "ucx" in transports else None
    result: dict = {
        "config": {
            "sizes_mib": args.sizes_mib,
            "repeats": args.repeats,
            "transports": transports,
            "skipped": skipped,
            "parts": args.parts,
            "blocks": args.blocks,
            "prompt_tokens": args.prompt_tokens,
            "ttft_repeats": args.ttft_repeats,
            "ttft_dtype": args.ttft_dtype,
            "decode_in_process": args.decode_in_process,
            "seed": args.seed,
        },
    }
    try:
        if "micro" in args.parts:
            geometry = Geometry()
            result["micro"] = []
            for i, size in enumerate(args.sizes_mib):
                tokens = geometry.tokens_for(int(size * MIB))
                nbytes = tokens * geometry.num_layers * geometry.token_bytes
                result["micro"].append(
                    measure_payload(
                        f"{size:g} MiB",
                        geometry,
                        tokens,
                        samples_for(nbytes, args.repeats),
                        transports,
                        args.blocks,
                        args.seed + 10 * i,
                        ucx_pair,
                        args.decode_in_process,
                    )
                )
                print(f"  measured {size:g} MiB", file=sys.stderr, flush=True)
        if "real" in args.parts:
            model = default_model_geometry()
            result["real_request"] = []
            for j, dtype in enumerate((torch.float32, torch.bfloat16)):
                geometry = Geometry(model.num_layers, model.num_kv_heads, model.head_dim, 16, dtype)
                nbytes = args.prompt_tokens * geometry.num_layers * geometry.token_bytes
                result["real_request"].append(
                    measure_payload(
                        f"{args.prompt_tokens}-tok {geometry.dtype_name}",
                        geometry,
                        args.prompt_tokens,
                        samples_for(nbytes, args.repeats),
                        transports,
                        args.blocks,
                        args.seed + 1000 + j,
                        ucx_pair,
                        args.decode_in_process,
                    )
                )
            print("  measured the real-request payloads", file=sys.stderr, flush=True)
        if "ttft" in args.parts:
            result["ttft"] = measure_ttft(args, transports, ucx_pair)
    finally:
        if ucx_pair:
            for u in ucx_pair:
                u.close()
    result["targets"] = check_targets(result.get("micro", []) + result.get("real_request", []), result.get("ttft"))
    result["machine"] = {
        **probe.report(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "ucx_available": ucx_available(),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
    }
    return result


def default_model_geometry():
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.model_store import resolve_model

    return ModelConfig.from_folder(resolve_model(None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes-mib",
        type=lambda s: parse_list(s, float),
        default=[1, 16, 64, 256],
        help="payload sizes for the micro part (default 1,16,64,256)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed samples per method at >= 64 MiB; smaller payloads get up to 8x more (default 5)",
    )
    parser.add_argument(
        "--transports",
        type=parse_list,
        default=list(ALL_TRANSPORTS),
        help=f"pdserve transports to measure (default {','.join(ALL_TRANSPORTS)}; unavailable ones are skipped with the reason)",
    )
    parser.add_argument(
        "--parts",
        type=parse_list,
        default=["micro", "real", "ttft"],
        help="micro, real (a real request's KV), ttft (needs the default model); default all",
    )
    parser.add_argument(
        "--blocks",
        choices=("contiguous", "shuffled"),
        default="contiguous",
        help="block ids on both sides: contiguous (a fresh cache) or shuffled (a fragmented one)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=1024, help="prompt length of the real request and the TTFT runs"
    )
    parser.add_argument("--ttft-repeats", type=int, default=3, help="TTFT runs per mode and transport (default 3)")
    parser.add_argument(
        "--ttft-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the TTFT part's model and KV dtype (default auto: what pdserve up picks on this machine)",
    )
    parser.add_argument(
        "--prefill-threads",
        type=int,
        default=shared_prefill_threads(os.cpu_count() or 1, prefill=1, decode=1),
        help="torch threads of the TTFT part's prefill engine (default: what pdserve up gives a 1P1D prefill worker here, %(default)s)",
    )
    parser.add_argument(
        "--decode-in-process",
        action="store_true",
        help="run each transport's decode side in this process (default: a child process, as deployed)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    bad = [t for t in args.transports if t not in ALL_TRANSPORTS] + [
        p for p in args.parts if p not in ("micro", "real", "ttft")
    ]
    if (
        bad
        or args.repeats < 1
        or args.ttft_repeats < 1
        or args.prefill_threads < 1
        or args.prompt_tokens < 1
        or not all(s > 0 and math.isfinite(s) for s in args.sizes_mib)
        or not (args.sizes_mib and args.parts and args.transports)
    ):
        parser.error(
            f"bad arguments {bad or ''}: transports are {','.join(ALL_TRANSPORTS)}; parts micro,real,ttft; "
            "counts and sizes finite and > 0; lists not empty"
        )
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: {args.json.parent} is not a folder")

    result = run(args)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
