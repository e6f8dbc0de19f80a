"""pdserve profile's engine part on the real model, with a few small shapes: every shape is
measured at each degree, the shapes come from the engine's own schedule, and the fit describes
what was measured; its KV part over every transport that works here, on a small layout. (The
full profile takes minutes; its stack part is what the e2e tests of the stack already exercise.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tqdm import tqdm

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.registry import offered_transports
from pdserve.planner import measure
from pdserve.planner.fit import robust_fit
from pdserve.planner.profile import StepShape


@pytest.mark.e2e
def test_engine_probe_measures_each_shape_at_each_degree(model_dir, monkeypatch):
    monkeypatch.setattr(measure, "PREFILL_SHAPES", ((1, 16), (1, 96), (2, 48)))
    monkeypatch.setattr(measure, "DEEP_PROMPT", 128)
    monkeypatch.setattr(measure, "DEEP_CHUNK", 64)
    monkeypatch.setattr(measure, "DECODE_SHAPES", ((1, 32), (4, 64)))
    monkeypatch.setattr(measure, "MIXED_SHAPES", ((2, 32, 24),))
    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_num_batched_tokens=1024),
        model_dir=str(model_dir),
    )
    with tqdm(disable=True) as bar:
        samples = measure.EngineProbe(engine, [1, 2], repeats=1, bar=bar).run()
    shapes = {(s.label, s.degree): s.shape for s in samples}
    for degree in (1, 2):
        assert shapes[("prefill 2x48", degree)] == StepShape.of([], [(0, 48), (0, 48)])
        assert shapes[("prefill chunk 2 of 128", degree)] == StepShape.of([], [(64, 64)])
        # Decodes set up through the handoff seam: the first step is untimed, so contexts are 1 + 1 past the prompt.
        assert shapes[("decode 4x64", degree)] == StepShape.of([66] * 4, [])
        assert shapes[("decode 2x32 + prompt 24", degree)] == StepShape.of([34, 34], [(0, 24)])
    assert len(samples) == 2 * (3 + 2 + 2 + 1) and all(s.ms > 0 for s in samples)
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks  # everything cleaned up
    cost, error, dropped = robust_fit([s for s in samples if s.degree == 1])
    assert cost.base_ms > 0 and error < 1.0 and len(dropped) <= 2


def test_kv_part_fits_a_cost_per_transport(monkeypatch):
    monkeypatch.setattr(measure, "KV_TOKENS", (1024, 8192, 32768))  # 0.5 to 16 MiB: past the fixed costs
    engine = SimpleNamespace(
        model_config=SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=16),
        config=SimpleNamespace(block_size=16),
        dtype=torch.float32,
    )
    transports = [t for t in offered_transports("auto", torch.device("cpu")) if t != "cuda_ipc"]
    costs = measure.measure_kv(engine, 2, transports)
    assert set(costs) == set(transports) and {"tcp", "shm"} <= set(costs)
    for cost in costs.values():  # fitted to what was measured: more bytes take longer
        assert cost.ms_per_mib > 0, costs
