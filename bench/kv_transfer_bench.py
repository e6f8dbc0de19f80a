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
* ``ttft``: a real ``LLMEngine`` (default model, fp32) as the prefill side, its KV connector
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
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdserve.bench.kv_links import (  # noqa: E402
    IO_TIMEOUT_S,
    MemcpyLink,
    RawSocketLink,
    RawUcxLink,
    TransportLink,
    connect,
    decode_side,
    layer_checksums,
)
from pdserve.engine.host_memory import host_zeros  # noqa: E402
from pdserve.engine.kv_cache import KVLayout  # noqa: E402
from pdserve.kvtransfer import registry  # noqa: E402
from pdserve.kvtransfer.handshake import PeerInfo, host_id  # noqa: E402
from pdserve.kvtransfer.integrity import checksum  # noqa: E402
from pdserve.kvtransfer.layout import KVCacheView  # noqa: E402
from pdserve.kvtransfer.ucx_worker import UcxWorker, ucx_available  # noqa: E402
from pdserve.placement import shared_prefill_threads  # noqa: E402

MIB = 1 << 20
ALL_TRANSPORTS = tuple(name for name in registry.TRANSPORT_NAMES if name != "cuda_ipc")  # CPU caches here
MAX_SAMPLE_MULTIPLIER = 8  # small payloads get more samples: repeats x min(8, 64 MiB / size)
MAX_ENGINE_STEPS = 64  # a 1k-token prefill takes one step (two with a smaller token budget)


# -- the machine -------------------------------------------------------------------------------------


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def busy_cpu_seconds() -> float | None:
    """CPU time spent by everything on the machine (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields] + [0] * 8
    # user + nice + system + irq + softirq; idle, iowait and steal (the hypervisor's) are not ours to count
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    return int(fields[7]) / os.sysconf("SC_CLK_TCK") if len(fields) > 7 else None


def own_cpu_seconds() -> float:
    """This process's CPU time and its finished children's (the decode sides)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


class LoadProbe:
    """Load average at start and end, and how much CPU other processes used meanwhile."""

    def __init__(self) -> None:
        self.start_load = loadavg()
        self.start_wall = time.monotonic()
        self.start_busy = busy_cpu_seconds()
        self.start_own = own_cpu_seconds()
        self.start_steal = steal_seconds()

    def report(self) -> dict:
        wall = time.monotonic() - self.start_wall
        cores = os.cpu_count() or 1
        busy = busy_cpu_seconds()
        other = steal = None
        if busy is not None and self.start_busy is not None:
            other = max(0.0, (busy - self.start_busy) - (own_cpu_seconds() - self.start_own))
        if self.start_steal is not None:
            steal = steal_seconds() - self.start_steal
        return {
            "cpu_count": cores,
            "loadavg_start": self.start_load,
            "loadavg_end": loadavg(),
            "wall_s": round(wall, 2),
            "other_cpu_s": None if other is None else round(other, 2),
            "other_cpu_share": None if other is None else round(other / (wall * cores), 3),
            "steal_cpu_s": None if steal is None else round(steal, 2),
            # Load from others at start (1-min average) or CPU they used during the run.
            "other_load_present": bool(
                (self.start_load and self.start_load[0] >= 0.5)
                or (other is not None and other / (wall * cores) >= 0.05)
            ),
        }


# -- payloads ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    @property
    def token_bytes(self) -> int:
        return self.layout().token_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def tokens_for(self, nbytes: int) -> int:
        return max(1, round(nbytes / (self.num_layers * self.token_bytes)))


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Position-dependent bytes (a misplaced run shows up), cheap to make for 256 MiB."""
    words = buf.view(np.uint32)
    words[:] = np.arange(words.size, dtype=np.uint32)
    words *= np.uint32(2654435761)
    words ^= np.uint32((seed * 0x9E3779B1) & 0xFFFFFFFF)


def host_view(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).reshape(-1).numpy()


def block_ids(count: int, arrangement: str, seed: int) -> list[int]:
    ids = list(range(count))
    if arrangement == "shuffled":
        random.Random(seed).shuffle(ids)
    return ids


def synthetic_peer(geometry: Geometry, transport: str, role: str) -> PeerInfo:
    return PeerInfo(
        model_fingerprint="kv-transfer-bench",
        dtype=geometry.dtype_name,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        block_size=geometry.block_size,
        transports=(transport,),
        host_id=host_id(),
        role=role,
        token_bytes=geometry.token_bytes,
    )


# -- throughput of one payload, every method ------------------------------------------------------------


def measure_payload(
    label: str,
    geometry: Geometry,
    num_tokens: int,
    samples: int,
    transports: list[str],
    arrangement: str,
    seed: int,
    ucx_pair,
    in_process: bool = False,
) -> dict:
    layout = geometry.layout()
    nblocks = -(-num_tokens // geometry.block_size)
    nbytes = num_tokens * geometry.num_layers * geometry.token_bytes

    src_tensor = host_zeros(layout.shape(nblocks), geometry.dtype)  # as a prefill engine allocates its cache
    fill_pattern(host_view(src_tensor), seed)
    src = KVCacheView(list(src_tensor.unbind(0)), geometry.block_size, geometry.token_bytes)
    src_blocks = block_ids(nblocks, arrangement, seed)
    dst_blocks = block_ids(nblocks, arrangement, seed + 1)
    src_sums = layer_checksums(src, src_blocks, num_tokens)

    flat_src = np.empty(nbytes, dtype=np.uint8)
    fill_pattern(flat_src, seed)
    flat_dst = np.zeros(nbytes, dtype=np.uint8)
    flat_sum = checksum(flat_src)

    links: list = [MemcpyLink(flat_src, flat_dst, flat_sum)]
    try:
        links.append(RawSocketLink(flat_src, flat_dst, flat_sum))
        if "ucx" in transports:
            links.append(RawUcxLink(flat_src, flat_dst, flat_sum, ucx_pair))
        for transport in transports:
            links.append(
                TransportLink(
                    transport,
                    layout,
                    src,
                    src_blocks,
                    dst_blocks,
                    num_tokens,
                    src_sums,
                    synthetic_peer(geometry, transport, "decode"),
                    synthetic_peer(geometry, transport, "prefill"),
                    ucx_pair,
                    in_process,
                )
            )
        for link in links:  # warm-up: connection, page tables, caches; not timed
            link.sample()
        times: dict[str, list[float]] = {link.name: [] for link in links}
        for i in range(samples):
            shift = i % len(links)  # rotate the order so no method always runs first
            for link in links[shift:] + links[:shift]:
                times[link.name].append(link.sample())
    finally:
        for link in links:
            link.close()
        del links
        gc.collect()

    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {
        "label": label,
        "bytes": nbytes,
        "num_tokens": num_tokens,
        "dtype": geometry.dtype_name,
        "num_layers": geometry.num_layers,
        "token_bytes": geometry.token_bytes,
        "block_size": geometry.block_size,
        "block_arrangement": arrangement,
        "samples": samples,
        "seconds_median": seconds,
        "gbps": gbps,
        "gbps_min_max": {name: [nbytes / max(ts) / 1e9, nbytes / min(ts) / 1e9] for name, ts in times.items()},
        "ratios": ratios(gbps),
    }


def ratios(gbps: dict[str, float]) -> dict[str, float]:
    out = {}
    if "tcp" in gbps:
        out["tcp_vs_raw_socket"] = gbps["tcp"] / gbps["raw_socket"]
    if "shm" in gbps:
        out["shm_vs_memcpy"] = gbps["shm"] / gbps["memcpy"]
    if "ucx" in gbps:
        out["ucx_vs_raw_socket"] = gbps["ucx"] / gbps["raw_socket"]
        out["ucx_vs_raw_ucx"] = gbps["ucx"] / gbps["raw_ucx"]
        if "tcp" in gbps:
            out["ucx_vs_tcp"] = gbps["ucx"] / gbps["tcp"]
    return out


def samples_for(nbytes: int, repeats: int) -> int:
    return repeats * min(MAX_SAMPLE_MULTIPLIER, max(1, (64 * MIB) // max(1, nbytes)))


# -- TTFT: per-layer pipelining vs send-after-prefill ----------------------------------------------------


def measure_ttft(args, transports: list[str], ucx_pair) -> dict:
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.kv_connector import KVSend
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    # No prefix caching: every run must compute its whole prompt (prompts also differ).
    config = EngineConfig(
        dtype="float32", kv_cache_memory="512MiB", enable_prefix_caching=False, num_threads=args.prefill_threads
    )
    engine = LLMEngine(config)
    woken = threading.Event()
    engine.connector.wake = woken.set
    layout, block_size = engine.kv_layout, engine.config.block_size
    src = KVCacheView(engine.kv_cache.layers, block_size, layout.token_bytes)
    geometry = Geometry(layout.num_layers, layout.num_kv_heads, layout.head_dim, block_size, layout.dtype)
    n = args.prompt_tokens
    dst_blocks = list(range(-(-n // block_size)))
    first_only = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # prefill alone ends at the first token
    handed_off = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rng = random.Random(args.seed)
    counter = iter(range(10**9))

    def prefill(mode: str, t: str | None) -> tuple[float, float]:
        """One prompt; (seconds to the first token, seconds to the ACK), its KV checked."""
        rid = f"ttft-{next(counter)}"
        prompt = [rng.randrange(1000, 40000) for _ in range(n)]
        kv = landed = acked = None
        if t is not None:
            decode = decodes[t]
            decode.zero()
            transfer_id, landed = decode.grant(dst_blocks, n)
            kv = KVSend(conns[t].open(transfer_id, dst_blocks, block_size, n), ack_timeout_s=IO_TIMEOUT_S)
            engine.connector.pipelined = mode == "pipelined"
        started = time.perf_counter()
        engine.add_request(rid, prompt, first_only if t is None else handed_off, kv_send=kv)
        first_s = None
        deadline = started + IO_TIMEOUT_S
        while acked is None and time.perf_counter() < deadline:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if first_s is None:
                    first_s = time.perf_counter() - started
                    src_blocks = list(engine.requests[rid].block_table) if t is not None else None
                if out.finished:
                    if out.error is not None:
                        raise RuntimeError(f"ttft {mode} over {t}: {out.error}")
                    acked = time.perf_counter() - started
            if acked is None and first_s is not None:
                woken.wait(0.05)
                woken.clear()
        if acked is None:
            raise RuntimeError(f"ttft {mode} over {t}: no answer within {IO_TIMEOUT_S} s")
        if t is not None:
            landed.wait(f"ttft {mode} over {t}")
            if decodes[t].checksums(dst_blocks, n) != layer_checksums(src, src_blocks, n):
                raise RuntimeError(f"ttft {mode} over {t}: the KV that landed differs from the engine's")
        return first_s, acked

    decodes: dict = {}
    conns: dict = {}
    triples: dict[str, list[dict[str, tuple[float, float]]]] = {t: [] for t in transports}
    try:
        for t in transports:
            ucx_decode, ucx_prefill = ucx_pair if t == "ucx" else (None, None)
            peer = synthetic_peer(geometry, t, "decode")
            decodes[t] = decode_side(t, layout, len(dst_blocks), peer, ucx_decode, args.decode_in_process)
            conns[t] = connect(decodes[t].address, synthetic_peer(geometry, t, "prefill"), src, t, ucx_prefill)
        prefill("none", None)  # the first forward pays one-time costs
        for t in transports:
            prefill("after", t)  # warm each connection
        # Each repeat runs the three modes back to back (in a rotating order) and the figures are
        # medians of the differences within a triple: the machine's drift cancels out.
        for i in range(args.ttft_repeats):
            for t in transports:
                modes = ["none", "pipelined", "after"]
                modes = modes[i % 3 :] + modes[: i % 3]
                triples[t].append({mode: prefill(mode, None if mode == "none" else t) for mode in modes})
    finally:
        for conn in conns.values():
            conn.close()
        for decode in decodes.values():
            decode.close()

    def median_ms(values) -> float:
        return statistics.median(values) * 1e3

    per_transport = {}
    for t, runs in triples.items():
        a = [r["none"][1] for r in runs]
        b = [r["pipelined"][1] for r in runs]
        c = [r["after"][1] for r in runs]
        per_transport[t] = {
            "prefill_ms": median_ms(a),
            "pipelined_ms": median_ms(b),
            "after_prefill_ms": median_ms(c),
            "transfer_ms": median_ms([ci - ai for ai, ci in zip(a, c)]),  # (c) - (a)
            "exposed_pipelined_ms": median_ms([bi - ai for ai, bi in zip(a, b)]),  # (b) - (a): what the handoff adds
            "pipelined_minus_after_ms": median_ms([bi - ci for bi, ci in zip(b, c)]),
            "tail_pipelined_ms": median_ms([r["pipelined"][1] - r["pipelined"][0] for r in runs]),  # first token -> ACK
            "tail_after_prefill_ms": median_ms([r["after"][1] - r["after"][0] for r in runs]),
        }
    all_prefill = [r["none"][1] for runs in triples.values() for r in runs]
    return {
        "model_dir": engine.model_dir,
        "dtype": "float32",
        "prompt_tokens": n,
        "block_size": block_size,
        "transfer_bytes": n * layout.num_layers * layout.token_bytes,
        "repeats": args.ttft_repeats,
        "torch_threads": torch.get_num_threads(),
        "prefill_ms": median_ms(all_prefill) if all_prefill else None,
        "per_transport": per_transport,
        "runs_ms": {
            t: [{mode: [f * 1e3, ack * 1e3] for mode, (f, ack) in r.items()} for r in runs]
            for t, runs in triples.items()
        },
    }


# -- targets, table, main ----------------------------------------------------------------------------------


TARGETS = {  # ratio key -> minimum, at 16 MiB and up
    "ucx_vs_raw_socket": 2.0,
    "ucx_vs_raw_ucx": 0.8,
    "shm_vs_memcpy": 0.5,
    "tcp_vs_raw_socket": 0.9,
}
MAX_HANDOFF_MS = 10.0  # what a real request's handoff may add to TTFT over prefill alone (shm, UCX)


def check_targets(rows: list[dict], ttft: dict | None) -> list[dict]:
    checks = []
    for row in rows:
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
            if t in ("shm", "ucx"):
                checks.append(
                    {
                        "row": f"ttft {t}",
                        "target": f"handoff adds <= {MAX_HANDOFF_MS} ms",
                        "value": r["exposed_pipelined_ms"],
                        "met": r["exposed_pipelined_ms"] <= MAX_HANDOFF_MS,
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
            f"TTFT, {ttft['prompt_tokens']}-token prompt, default model fp32, KV {ttft['transfer_bytes'] / 1e6:.1f} MB, "
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
        or any(s <= 0 for s in args.sizes_mib)
    ):
        parser.error(
            f"bad arguments {bad or ''}: transports are {','.join(ALL_TRANSPORTS)}; parts micro,real,ttft; counts and sizes > 0"
        )

    result = run(args)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
