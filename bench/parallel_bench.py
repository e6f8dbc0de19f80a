"""Tensor and pipeline parallel workers: what communication costs per step, and a paper projection.

    python bench/parallel_bench.py measure --layouts 1x1,3x1,1x2,1x3 --batch 4 --prompt-len 64 --decode-steps 16
    python bench/parallel_bench.py paper --prompt-len 2048

``measure`` runs one engine per layout (``TPxPP``) on the same requests and the same cores, in
this process one after the other, and reports rank 0's view of a prefill step and of a decode
step: wall time, time inside communication calls (waiting for the other ranks included: on a
machine with fewer cores than ranks, that wait is mostly the others computing), its share, and
the bytes rank 0 moved. ``paper`` prints, from the models' shapes alone, the all-reduce bytes per
token at each tensor-parallel size and the KV bytes each prefill -> decode layout moves per request.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.engine.parallel.layout import kv_heads_per_rank
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class StepFigures:
    ms: float  # median wall time of the step (engine.step: schedule, forward, sample)
    comm_ms: float  # median time rank 0 spent in communication calls during it
    comm_bytes: float  # median bytes rank 0 sent or received in them

    @property
    def share(self) -> float:
        return self.comm_ms / self.ms if self.ms else 0.0


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """'1x1,3x1' -> [(1, 1), (3, 1)] (TP x PP, each >= 1)."""
    layouts = []
    for item in text.split(","):
        tp, _, pp = item.strip().partition("x")
        try:
            layout = (int(tp), int(pp or 1))
        except ValueError:
            raise ValueError(f"a layout is TPxPP (integers), got {item!r}") from None
        if min(layout) < 1:
            raise ValueError(f"a layout's degrees are >= 1, got {item!r}")
        layouts.append(layout)
    return layouts


def timed_steps(engine: LLMEngine, count: int | None = None) -> list[tuple[float, float, float]]:
    """(seconds, communication seconds, communication bytes) of each step, until ``count`` steps or
    until nothing is left to do."""
    comm = engine.parallel.groups.comm if engine.parallel is not None else None
    out = []
    while engine.has_unfinished() and (count is None or len(out) < count):
        seconds, nbytes = (comm.seconds, comm.nbytes) if comm else (0.0, 0)
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        out.append((elapsed, comm.seconds - seconds if comm else 0.0, comm.nbytes - nbytes if comm else 0))
    return out


def figures(steps: list[tuple[float, float, float]]) -> StepFigures:
    return StepFigures(
        statistics.median(s[0] for s in steps) * 1e3,
        statistics.median(s[1] for s in steps) * 1e3,
        statistics.median(s[2] for s in steps),
    )


def measure(model_dir: str, tp: int, pp: int, args) -> tuple[StepFigures, StepFigures]:
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        kv_cache_memory="256MiB",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_threads=args.threads,
        max_num_batched_tokens=args.batch * args.prompt_len,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config, model_dir=model_dir)
    try:
        rng = random.Random(0)
        sampling = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
        prefill, decode = [], []
        for _ in range(args.rounds):  # the same requests each round: the first round also warms up
            for i in range(args.batch):
                engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(args.prompt_len)], sampling)
            prefill += timed_steps(engine, 1)  # every prompt in one step (the budget holds them all)
            decode += timed_steps(engine)
        return figures(prefill[1:] or prefill), figures(decode[args.decode_steps :] or decode)
    finally:
        engine.close()


def run_measure(args) -> None:
    model_dir = str(resolve_model(args.model))
    print(
        f"batch {args.batch} x {args.prompt_len}-token prompts, {args.decode_steps} decode steps, fp32, "
        f"{args.threads} threads per worker, {os.cpu_count()} cores; medians over {args.rounds - 1} measured rounds"
    )
    print(
        "| layout | ranks | prefill step ms | comm ms (share) | decode step ms | comm ms (share) | comm KiB / decode step |"
    )
    print("|---|---|---|---|---|---|---|")
    for tp, pp in parse_layouts(args.layouts):
        p, d = measure(model_dir, tp, pp, args)
        print(
            f"| TP {tp} x PP {pp} | {tp * pp} | {p.ms:.1f} | {p.comm_ms:.1f} ({p.share:.0%}) | {d.ms:.1f} | "
            f"{d.comm_ms:.1f} ({d.share:.0%}) | {d.comm_bytes / 1024:.0f} |",
            flush=True,
        )


# -- on paper ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    def allreduce_payload_per_token(self) -> int:
        """Bytes all-reduced per token by one TP group: o_proj and down_proj of every layer, and
        the vocabulary-parallel embedding (the logits gather is extra, only for sampled rows)."""
        return (2 * self.layers + 1) * self.hidden * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


SHAPES = (Shape("Llama-3-8B", 32, 4096, 8, 128), Shape("Llama-3-70B", 80, 8192, 8, 128))


def run_paper(args) -> None:
    for shape in SHAPES:
        payload = shape.allreduce_payload_per_token()
        print(
            f"\n{shape.name}: (2 x {shape.layers} + 1) all-reduces x {shape.hidden} x {shape.dtype_bytes} B = "
            f"{payload / 1024:.0f} KiB all-reduced per token"
        )
        print(
            "| TP | all-reduces per step | payload KiB / token | ring: KiB each GPU sends / token | at 450 GB/s per GPU |"
        )
        print("|---|---|---|---|---|")
        for tp in (1, 2, 4, 8):
            wire = 2 * (tp - 1) / tp * payload
            print(
                f"| {tp} | {0 if tp == 1 else 2 * shape.layers + 1} | {0 if tp == 1 else payload / 1024:.0f} | "
                f"{wire / 1024:.0f} | {wire / 450e9 * 1e6:.2f} µs |"
            )
        per_token = shape.kv_bytes_per_token()
        total = per_token * args.prompt_len
        print(
            f"\nKV: 2 x {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} x {shape.dtype_bytes} B = "
            f"{per_token / 1024:.0f} KiB per token; a {args.prompt_len}-token prompt: {total / 2**20:.0f} MiB"
        )
        print("| prefill TP -> decode TP | MiB per request | MiB into each decode rank | units per layer per chunk |")
        print("|---|---|---|---|")
        for src, dst in ((1, 1), (1, 4), (1, 8), (4, 1), (4, 8), (8, 8), (8, 16)):
            heads = kv_heads_per_rank(shape.kv_heads, dst)  # replicated past the KV heads: every copy ships
            per_rank = total * heads / shape.kv_heads
            print(f"| {src} -> {dst} | {per_rank * dst / 2**20:.0f} | {per_rank / 2**20:.0f} | {dst} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--layouts", default="1x1,3x1,1x2,1x3", help="TPxPP, comma separated")
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--prompt-len", type=int, default=64)
    m.add_argument("--decode-steps", type=int, default=16)
    m.add_argument("--rounds", type=int, default=3, help="rounds of the same requests; the first is a warm-up")
    m.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads per worker, split over its ranks")
    m.add_argument("--model", default=None)
    p = sub.add_parser("paper")
    p.add_argument("--prompt-len", type=int, default=2048)
    args = parser.parse_args()
    if args.command == "measure":
        try:
            parse_layouts(args.layouts)
        except ValueError as e:
            parser.error(f"--layouts: {e}")
    run_measure(args) if args.command == "measure" else run_paper(args)


if __name__ == "__main__":
    main()
