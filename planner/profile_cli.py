"""``pdserve profile --output FILE``: measures the model on this machine (``measure``) and writes
a profile for ``pdserve simulate`` and ``pdserve plan``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from pdserve.bench import results
from pdserve.config import add_arguments, resolve
from pdserve.engine.engine_config import EngineConfig
from pdserve.planner.fit import robust_fit
from pdserve.planner.measure import (
    DECODE_SHAPES,
    DEEP_PROMPT,
    MIXED_SHAPES,
    PARTS,
    PREFILL_SHAPES,
    PROG,
    EngineProbe,
    measure_kv,
    stack_overheads,
)
from pdserve.planner.profile import Overheads, Profile, TransferCost


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu ({len(os.sched_getaffinity(0))} cores, {name})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure the model on this machine; write a profile (JSON) for pdserve simulate and pdserve plan",
    )
    p.add_argument("--output", "-o", required=True, help="where to write the profile")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)} (default: all)")
    p.add_argument(
        "--degrees", default=None, help="torch thread counts to measure (default: 1 and this machine's cores)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measured shape (default: 3)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_arguments(p.add_argument_group("engine"), EngineConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    try:
        parts = [x.strip() for x in args.parts.split(",") if x.strip()]
        if not parts or any(x not in PARTS for x in parts):
            raise ValueError(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
        if "engine" not in parts:
            raise ValueError("--parts must include engine: the other parts are measured against its step costs")
        try:
            degrees = sorted({int(x) for x in args.degrees.split(",")}) if args.degrees else sorted({1, cores})
        except ValueError:
            raise ValueError(f"--degrees takes comma-separated integers, got {args.degrees!r}") from None
        if any(d < 1 for d in degrees) or args.repeats < 1:
            raise ValueError("--degrees and --repeats must be >= 1")
        results.check_output_file(Path(args.output), "--output")
        engine_config = resolve(EngineConfig, args)
        from pdserve.engine.model_store import resolve_model

        resolve_model(engine_config.model, engine_config.cache_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return write_profile(args, parts, degrees, cores, engine_config)


def write_profile(
    args: argparse.Namespace, parts: list[str], degrees: list[int], cores: int, config: EngineConfig
) -> int:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.registry import offered_transports

    load = os.getloadavg()[0]
    # Room for every measured shape in one step (the stacks keep the configured limits).
    engine = LLMEngine(
        dataclasses.replace(config, max_num_batched_tokens=8 * DEEP_PROMPT, max_num_seqs=128, device="cpu")
    )
    trials = len(PREFILL_SHAPES) + 1 + len(DECODE_SHAPES) + len(MIXED_SHAPES)
    with tqdm(total=trials, desc="engine steps", unit="shape", disable=args.disable_tqdm) as bar:
        samples = EngineProbe(engine, degrees, args.repeats, bar).run()
    steps, errors, outliers = {}, {}, set()
    for degree in degrees:
        steps[degree], errors[degree], dropped = robust_fit([s for s in samples if s.degree == degree])
        outliers.update((s.label, s.degree) for s in dropped)
        if dropped:
            print(f"degree {degree}: set aside as disturbed: {', '.join(s.label for s in dropped)}", file=sys.stderr)
    transports = [t for t in offered_transports("auto", engine.device) if t != "cuda_ipc"]
    kv_bytes = engine.kv_layout.token_bytes * engine.kv_layout.num_layers
    transfers = {t: TransferCost(0.0, 0.0) for t in transports}
    if "kv" in parts:
        print(f"{PROG}: KV transfers over {', '.join(transports)} ...", file=sys.stderr, flush=True)
        transfers = measure_kv(engine, args.repeats, transports)
    capacity = engine.blocks.num_blocks * config.block_size
    model, dtype, max_len = engine.model_dir, str(engine.dtype).removeprefix("torch."), engine.max_model_len
    del engine  # free the model and its cache before stacks start
    overheads, stack_raw = Overheads(), {}
    if "stack" in parts:
        print(f"{PROG}: overheads through real stacks (colocated, then 1P1D) ...", file=sys.stderr, flush=True)
        overheads, stack_raw = stack_overheads(
            config, steps, cores, lambda n: transfers[transports[0]].ms(n * kv_bytes), not args.disable_tqdm
        )
    profile = Profile(
        model=Path(model).name,
        device=machine(),
        parallel="threads",
        steps=steps,
        kv_bytes_per_token=kv_bytes,
        transfers=transfers,
        transport=transports[0],
        overheads=overheads,
        dtype=dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        cores=cores,
        kv_cache_tokens={d: capacity for d in degrees},
        max_model_len=max_len,
        fit_error=errors,
        source=f"{PROG} --parts {','.join(parts)} --repeats {args.repeats}; load average {load:.2f} at start",
        created=datetime.now().isoformat(timespec="seconds"),
        samples=tuple(
            [{**s.to_dict(), "outlier": (s.label, s.degree) in outliers} for s in samples]
            + ([{"stack": stack_raw}] if stack_raw else [])
        ),
    )
    path = profile.save(args.output)
    for degree in degrees:
        c = steps[degree]
        print(
            f"degree {degree}: prefill 512 tokens {c.prefill_alone_ms(512):.0f} ms, "
            f"decode batch 1 {c.decode_step_ms(1, 512):.1f} ms, "
            f"batch 32 {c.decode_step_ms(32, 512):.1f} ms (fit error {errors[degree]:.1%})"
        )
    print(f"overheads: {dataclasses.asdict(overheads)}")
    print(f"profile written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
