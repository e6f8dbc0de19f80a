"""``kv_transfer_bench``'s TTFT part: a real prefill engine's KV connector shipping a prompt to a
decode side per transport, prefill alone vs per-layer pipelining vs send-after-prefill."""

from __future__ import annotations

import random
import statistics
import threading
import time

import torch

from pdserve.bench.kv_links import IO_TIMEOUT_S, connect, decode_side, layer_checksums
from pdserve.bench.kv_payloads import Geometry, synthetic_peer
from pdserve.kvtransfer.layout import KVCacheView


def measure_ttft(args, transports: list[str], ucx_pair) -> dict:
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.kv_connector import KVSend
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    # No prefix caching: every run must compute its whole prompt (prompts also differ).
    config = EngineConfig(
        dtype=args.ttft_dtype, kv_cache_memory="512MiB", enable_prefix_caching=False, num_threads=args.prefill_threads
    )
    engine = LLMEngine(config)
    deployed = "pipelined" if engine.connector.pipelined else "after"  # what a worker with these threads does
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
        "dtype": str(engine.dtype).removeprefix("torch."),
        "prompt_tokens": n,
        "block_size": block_size,
        "transfer_bytes": n * layout.num_layers * layout.token_bytes,
        "repeats": args.ttft_repeats,
        "torch_threads": torch.get_num_threads(),
        "deployed_mode": deployed,
        "prefill_ms": median_ms(all_prefill) if all_prefill else None,
        "per_transport": per_transport,
        "runs_ms": {
            t: [{mode: [f * 1e3, ack * 1e3] for mode, (f, ack) in r.items()} for r in runs]
            for t, runs in triples.items()
        },
    }
