"""The Hugging Face ``generate`` baseline: the same requests, static batches, for throughput.

Requests go in arrival order in static batches of ``batch_size`` (left-padded); a batch runs
until its longest output is done, which is exactly the cost static batching pays. Every
request is available at the start (like rate ``inf``), so its "send time" is the start of the
run and its TTFT includes waiting for the batches before it. Token times are taken after each
decoding step from inside ``generate`` (a stopping criterion that never stops); they are step
times of the whole batch, so only throughput compares directly with the served modes.
Greedy decoding; ``min_new_tokens`` holds EOS back so each output has exactly its length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from pdserve.bench.metrics import Timeline
from pdserve.bench.workloads import RequestSpec

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class HFConfig:
    model: str | None = None  # as for pdserve: None = the default model
    dtype: str = "float32"
    batch_size: int = 8
    time_limit_s: float = 600.0
    cache_dir: str | None = None
    num_threads: int | None = None
    progress: bool = True
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass(frozen=True, slots=True)
class HFResult:
    timelines: list[Timeline]
    duration: float
    model_dir: str


class _StepClock:
    """A stopping criterion that only records when each decoding step finished."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_model(cfg: HFConfig):
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.loader import parse_dtype
    from pdserve.engine.model_store import resolve_model

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    folder = resolve_model(cfg.model, cfg.cache_dir)
    dtype = parse_dtype(cfg.dtype, torch.device("cpu"))  # "auto" as the engine reads it (its default)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    return model, str(folder)


def _generate(model, batch: list[RequestSpec], temperature: float = 0.0, top_p: float = 1.0) -> list[float]:
    """Runs one static batch; returns the time after each decoding step."""
    import torch
    from transformers import StoppingCriteriaList

    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    width = max(s.prompt_len for s in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, spec in enumerate(batch):  # left padding keeps every prompt's end aligned
        ids[row, width - spec.prompt_len :] = torch.tensor(spec.prompt_token_ids)
        mask[row, width - spec.prompt_len :] = 1
    new = max(s.max_tokens for s in batch)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=temperature > 0,
            # top_k=0: transformers would add its own default of 50, which pdserve's requests do not have
            **({"temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 else {}),
            pad_token_id=pad,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return clock.times


def run_hf(specs: list[RequestSpec], cfg: HFConfig, model=None, model_dir: str = "") -> HFResult:
    if model is None:
        model, model_dir = load_model(cfg)
    _generate(model, [RequestSpec(specs[0].prompt_token_ids[:8], 2)])  # warm-up, not timed
    timelines = [Timeline(prompt_len=s.prompt_len, max_tokens=s.max_tokens) for s in specs]
    bar = tqdm(total=len(specs), desc="hf generate", unit="req", disable=not cfg.progress, leave=False)
    start = time.perf_counter()
    for first in range(0, len(specs), cfg.batch_size):
        batch = specs[first : first + cfg.batch_size]
        rows = timelines[first : first + cfg.batch_size]
        if time.perf_counter() - start > cfg.time_limit_s:
            for t in rows:
                t.error = "not run: the time limit was reached"
            continue
        error = ""
        try:
            steps = _generate(model, batch, cfg.temperature, cfg.top_p)
        except RuntimeError as e:  # e.g. out of memory: the batch fails, the run goes on
            steps, error = [], f"generate failed: {e}"
        for spec, t in zip(batch, rows):
            t.send_time = start
            if len(steps) < spec.max_tokens:
                t.error = error or f"generate stopped after {len(steps)} of {spec.max_tokens} steps"
                continue
            t.chunk_times = steps[: spec.max_tokens]
            t.chunk_tokens = [1] * spec.max_tokens
            t.end_time, t.finish_reason = steps[spec.max_tokens - 1], "length"
        bar.update(len(batch))
    bar.close()
    return HFResult(timelines, time.perf_counter() - start, model_dir)
