"""What ``pdserve profile`` measures (``profile_cli`` runs it and writes the profile).

Parts (``--parts``, all by default; a few minutes with a progress bar):

- ``engine``: a real ``LLMEngine`` at each degree (torch threads: 1 and the machine's cores,
  taking turns shape by shape), timing ``step()`` on prompts alone (one and batched, 16 to 2048 tokens), chunks deep into
  a long prompt, decode batches (1 to 64 sequences, contexts 64 to 2048, entering as handed-off
  requests whose K/V "land" at once, so no prefill is needed to set them up) and decode
  batches with a prompt chunk beside them. Each step's exact shape comes from the engine's
  own schedule; the step cost model is fitted to the medians (``fit``).
- ``kv``: one request's KV (this model's layout and dtype) through every transport that
  works here, 128 to 4096 tokens (``bench/kv_payloads.py``, as ``kv_transfer_bench`` measures).
- ``stack``: a real colocated stack and a real 1P1D stack: requests one at a time (TTFT and
  batch-1 ITL) and eight at once (batch-8 ITL). What the engine model and the transfer do
  not explain is the serving overhead: before the first token, on the disaggregated path,
  per step and per streamed sequence.

The raw measurements are kept in the profile beside the fit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import time

from tqdm import tqdm

from pdserve.engine.engine_config import EngineConfig
from pdserve.placement import borrowed_threads, shared_prefill_threads
from pdserve.planner.fit import StepSample
from pdserve.planner.profile import Overheads, StepCost, StepShape, TransferCost

PROG = "pdserve profile"
PARTS = ("engine", "kv", "stack")
PREFILL_SHAPES = (
    (1, 16),
    (1, 64),
    (1, 256),
    (1, 1024),
    (1, 2048),
    (4, 64),
    (8, 128),
    (4, 256),
)  # (prompts, tokens each)
DEEP_PROMPT, DEEP_CHUNK = 2048, 512  # a long prompt in chunks: attention over a growing context
DECODE_SHAPES = (
    (1, 64),
    (1, 512),
    (1, 2048),
    (4, 512),
    (8, 256),
    (8, 1024),
    (16, 512),
    (32, 256),
    (32, 1024),
    (64, 256),
    (64, 512),
)  # (batch, context)
MIXED_SHAPES = ((4, 256, 64), (4, 256, 512), (16, 256, 64), (16, 256, 512), (32, 512, 256))  # (batch, context, prompt)
KV_TOKENS = (128, 1024, 4096)
STACK_PROMPTS = (64, 512)
TOKEN_RANGE = (1000, 40000)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


class StepTimer:
    """Times ``engine.step()`` and records the shape of what it ran (from the engine's own
    schedule: the scheduler's ``schedule`` is wrapped to note each step's output)."""

    def __init__(self, engine) -> None:
        from pdserve.planner.sim_engine import SimEngine

        self.engine, self.shapes = engine, []
        schedule = engine.scheduler.schedule

        def noted():
            out = schedule()
            self.shapes.append(SimEngine.shape(out))
            return out

        engine.scheduler.schedule = noted

    def step(self) -> tuple[StepShape, float]:
        self.shapes.clear()
        started = time.perf_counter()
        self.engine.step()
        ms = (time.perf_counter() - started) * 1e3
        return (self.shapes[0] if self.shapes else StepShape()), ms


class LandsAtOnce:
    """``IncomingKV`` for decode batches set up without a prefill: a grant's K/V "land" as soon as
    it is opened (the blocks keep whatever they hold: the cost of a step does not depend on it)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids = iter(range(1, 10**9))

    def grant(self, block_ids: list[int], num_tokens: int, skip_tokens: int, report) -> int:
        from pdserve.engine.kv_connector import TransferOutcome

        report(TransferOutcome(True, first_token_id=self.rng.randrange(*TOKEN_RANGE), transport="none"))
        return next(self.ids)

    def cancel(self, transfer_id: int, reason: str) -> None:
        pass  # it has reported already


class EngineProbe:
    """Runs the measured shapes on one engine. Every repeat of a shape runs at each degree in
    turn, so load from other tenants of a shared machine hits every degree alike."""

    def __init__(self, engine, degrees: list[int], repeats: int, bar: tqdm) -> None:
        self.engine, self.degrees, self.repeats, self.bar = engine, degrees, repeats, bar
        self.timer, self.rng, self.counter = StepTimer(engine), random.Random(0), iter(range(10**9))
        self.lands = LandsAtOnce(self.rng)

    def run(self) -> list[StepSample]:
        import torch

        trials = [(f"prefill {c}x{n}", lambda c=c, n=n: self._prefill(c, n)) for c, n in PREFILL_SHAPES]
        trials.append(("deep", self._deep))
        trials += [(f"decode {b}x{c}", lambda b=b, c=c: self._decode(b, c)) for b, c in DECODE_SHAPES]
        trials += [
            (f"decode {b}x{c} + prompt {n}", lambda b=b, c=c, n=n: self._mixed(b, c, n)) for b, c, n in MIXED_SHAPES
        ]
        for degree in self.degrees:  # warm-up: kernels, allocator, thread pools
            torch.set_num_threads(degree)
            self._prefill(1, 128)
            self._decode(4, 128)
        runs: dict[tuple[str, int], list[tuple[StepShape, float]]] = {}
        for label, trial in trials:
            for _ in range(self.repeats):
                for degree in self.degrees:
                    torch.set_num_threads(degree)
                    for name, shape, ms in trial():
                        runs.setdefault((name or label, degree), []).append((shape, ms))
            self.bar.update()
        samples = []
        for (label, degree), measured in runs.items():
            shape = measured[len(measured) // 2][0]
            samples.append(StepSample(degree, shape, statistics.median(ms for _, ms in measured), label))
        return samples

    # -- one trial each: set up, time, clean up ----------------------------------------------------
    def _sampling(self, n: int):
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def _add_prompt(self, tokens: int) -> None:
        self.engine.add_request(f"p{next(self.counter)}", _prompt(self.rng, tokens), self._sampling(1))

    def _add_decoding(self, context: int, max_tokens: int = 4) -> None:
        """A request whose prompt K/V come from "elsewhere": the next step reserves its blocks,
        the one after admits it into the running batch."""
        from pdserve.engine.kv_connector import KVReceive

        self.engine.add_request(
            f"d{next(self.counter)}",
            _prompt(self.rng, context),
            self._sampling(max_tokens),
            kv_receive=KVReceive(self.lands),
        )

    def _drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)

    def _timed(self, name: str = "") -> list[tuple[str, StepShape, float]]:
        shape, ms = self.timer.step()
        return [(name, shape, ms)]

    def _prefill(self, count: int, tokens: int):
        for _ in range(count):
            self._add_prompt(tokens)
        out = self._timed()
        self._drain()
        return out

    def _deep(self):
        """A long prompt in chunks: attention over a growing context."""
        config = self.engine.scheduler.config
        self.engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=DEEP_CHUNK)
        try:
            self._add_prompt(DEEP_PROMPT)
            out = [
                t
                for i in range(DEEP_PROMPT // DEEP_CHUNK)
                for t in self._timed(f"prefill chunk {i + 1} of {DEEP_PROMPT}")
            ]
        finally:
            self.engine.scheduler.config = config
            self._drain()
        return out

    def _start_decoding(self, batch: int, context: int) -> None:
        """``batch`` sequences of ``context`` tokens in the running batch, past their first step."""
        for _ in range(batch):
            self._add_decoding(context)
        self.engine.step()  # reserves their blocks (no forward pass)
        self.engine.step()  # untimed: admitted as their K/V landed, the batch's first step
        assert len(self.engine.scheduler.running) == batch, "the decode batch did not start"

    def _decode(self, batch: int, context: int):
        self._start_decoding(batch, context)
        out = self._timed()
        self._drain()
        return out

    def _mixed(self, batch: int, context: int, tokens: int):
        self._start_decoding(batch, context)
        self._add_prompt(tokens)
        out = self._timed()
        self._drain()
        return out


def measure_kv(engine, repeats: int, transports: list[str]) -> dict[str, TransferCost]:
    import numpy as np

    from pdserve.bench.kv_payloads import Geometry, measure_payload
    from pdserve.kvtransfer.ucx_worker import UcxWorker

    mc = engine.model_config
    geometry = Geometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.config.block_size, engine.dtype)
    ucx_pair = (UcxWorker(), UcxWorker()) if "ucx" in transports else None
    points: dict[str, list[tuple[float, float]]] = {t: [] for t in transports}
    try:
        for tokens in KV_TOKENS:
            row = measure_payload(
                f"{tokens} tokens", geometry, tokens, repeats, transports, "contiguous", tokens, ucx_pair
            )
            for t in transports:
                points[t].append((row["bytes"] / 2**20, row["seconds_median"][t] * 1e3))
    finally:
        for u in ucx_pair or ():
            u.close()
    costs = {}
    for t, pts in points.items():
        mib, ms = np.array(pts).T
        slope, intercept = np.polyfit(mib, ms, 1)
        costs[t] = TransferCost(max(0.0, float(intercept)), max(0.0, float(slope)))
    return costs


def _stack_samples(engine_config: EngineConfig, colocated: bool, progress: bool) -> dict:
    """TTFT per prompt length and ITLs at batch 1 and 8, through a real router."""
    from pdserve.bench.client_load import LoadConfig, run_load, warm_up
    from pdserve.bench.workloads import RequestSpec
    from pdserve.launcher import Cluster
    from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

    rng = random.Random(7)
    cluster = Cluster(
        engine_config,
        WorkerSettings(),
        RouterSettings(port=0),  # bound by the router itself: no port for another program to take meanwhile
        ClusterSettings(prefill=0 if colocated else 1, decode=1, colocated=colocated),
        env={"PDSERVE_LOG_LEVEL": os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")},
    )
    try:
        address = cluster.start()

        async def go():
            await warm_up(address, [RequestSpec(tuple(_prompt(rng, 64)), 8) for _ in range(2)], 120)
            one = [RequestSpec(tuple(_prompt(rng, n)), 16) for n in STACK_PROMPTS for _ in range(3)]
            seq = await run_load(one, LoadConfig(address, max_concurrency=1, progress=progress, label="one at a time"))
            eight = [RequestSpec(tuple(_prompt(rng, 32)), 48) for _ in range(8)]
            par = await run_load(eight, LoadConfig(address, progress=progress, label="eight at once"))
            return seq.timelines, par.timelines

        one, eight = asyncio.run(go())
    finally:
        cluster.stop()
    bad = [t.error for t in one + eight if not t.success]
    if bad:
        raise RuntimeError(f"the {'colocated' if colocated else '1P1D'} stack failed requests: {bad[0]}")
    return {
        "ttft": [(t.prompt_len, t.ttft * 1e3) for t in one],
        "itl1": [(t.prompt_len, g * 1e3) for t in one for g in t.itls],
        "itl8": [g * 1e3 for t in eight for g in t.itls],
    }


def stack_overheads(
    engine_config: EngineConfig, steps: dict[int, StepCost], cores: int, transfer_ms, progress: bool
) -> tuple[Overheads, dict]:
    """Overheads from real stacks: what the engine model and the KV transfer leave unexplained."""
    raw, per_stack = {}, []
    for colocated in (True, False):
        # A 1P1D decode worker has half the cores and its decode-only steps borrow the idle prefill
        # worker's (engine/thread_budget.py); the prefill worker, sharing every core, computes the
        # one-at-a-time prompts measured here while the decode worker idles; unless set by hand.
        pools = dict(prefill=0 if colocated else 1, decode=1, colocated=colocated)
        shared = shared_prefill_threads(cores, **pools)
        prefill_degree = engine_config.num_threads or shared or max(1, cores // (1 if colocated else 2))
        borrowed = borrowed_threads(cores, **pools)
        decode_degree = engine_config.num_threads or borrowed or prefill_degree
        cost = steps.get(decode_degree) or steps[min(steps)]
        prefill_cost = steps.get(prefill_degree) or steps[min(steps)]
        s = raw["colocated" if colocated else "1p1d"] = _stack_samples(engine_config, colocated, progress)
        one = statistics.median(ms - cost.decode_step_ms(1, n + 8) for n, ms in s["itl1"])  # step + 1 x seq
        eight = statistics.median(s["itl8"]) - cost.decode_step_ms(8, 8 * 56)  # step + 8 x seq
        seq = max(0.0, (eight - one) / 7)
        per_stack.append((max(0.0, one - seq), seq, prefill_cost, s, colocated))
    step_ms = statistics.mean(p[0] for p in per_stack)
    seq_ms = statistics.mean(p[1] for p in per_stack)
    first, handoff = [], []
    for _, _, cost, s, colocated in per_stack:
        for n, ms in s["ttft"]:
            rest = ms - cost.prefill_alone_ms(n) - step_ms - seq_ms
            (first if colocated else handoff).append(rest - (0 if colocated else transfer_ms(n)))
    first_ms = max(0.0, statistics.median(first))
    return Overheads(
        first_token_ms=first_ms,
        handoff_ms=max(0.0, statistics.median(handoff) - first_ms),
        step_ms=step_ms,
        seq_ms=seq_ms,
    ), raw
