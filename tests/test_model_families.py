"""Other LLaMA-family checkpoints against transformers itself.

For each case a tiny random-weight model is built with transformers (Llama tied/untied, with
attention or MLP biases, llama3 and linear RoPE scaling, Qwen2 with q/k/v bias, Mistral with
and without a sliding window, MQA, a sharded save), saved as safetensors, loaded by pdserve,
and compared with transformers on the same weights: next-token logits after a prompt, the
logits of every generated step, and greedy ids, one request at a time and all requests
together under continuous batching with chunked prefill.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import stack_checkpoint
from pdserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 8
PROMPT_LENS = (5, 13, 21)  # the last one spans three KV blocks
MAX_NEW_TOKENS = 12
ATOL = 1e-4

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


# Llama 3.1 style; a short original context so that positions of the tested lengths fall in
# all three bands (kept, blended, slowed by ``factor``).
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class Case:
    id: str
    config_cls: str  # a transformers config class name
    overrides: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None  # set: save in shards (model.safetensors.index.json)
    # Rewrite config.json the way transformers 4.x wrote it (top-level rope_theta, rope_scaling
    # holding the type under this key), as most published checkpoints still have it.
    legacy_rope_key: str | None = None
    # What pdserve must read from the saved config.json.
    expect: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case(
        "llama-tied",
        "LlamaConfig",
        {"tie_word_embeddings": True},
        expect={"tie_word_embeddings": True, "qkv_bias": False, "o_proj_bias": False},
    ),
    Case("llama-untied", "LlamaConfig", {"tie_word_embeddings": False}, expect={"tie_word_embeddings": False}),
    Case(
        "llama-attention-bias",
        "LlamaConfig",
        {"attention_bias": True},
        expect={"qkv_bias": True, "o_proj_bias": True, "mlp_bias": False},
    ),
    Case("llama-mlp-bias", "LlamaConfig", {"mlp_bias": True}, expect={"qkv_bias": False, "mlp_bias": True}),
    Case(
        "llama3-rope-scaling",
        "LlamaConfig",
        {"num_hidden_layers": 3, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},
        expect={"rope_type": "llama3", "rope_theta": 500000.0, "num_layers": 3},
    ),
    Case(
        "llama-linear-rope-scaling",
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        expect={"rope_type": "linear"},
    ),
    Case(
        "llama3-rope-scaling-v4-config",
        "LlamaConfig",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},
        legacy_rope_key="rope_type",
        expect={"rope_type": "llama3", "rope_theta": 500000.0},
    ),
    Case(
        "llama-linear-rope-scaling-v4-config",
        "LlamaConfig",
        {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        legacy_rope_key="type",
        expect={"rope_type": "linear", "rope_theta": 20000.0},
    ),
    Case("llama-mqa", "LlamaConfig", {"num_key_value_heads": 1}, expect={"num_kv_heads": 1}),
    Case(
        "llama-wide-head-dim",
        "LlamaConfig",
        {"head_dim": 32},  # head_dim != hidden / heads
        expect={"head_dim": 32},
    ),
    Case("llama-sharded", "LlamaConfig", {"num_hidden_layers": 3}, max_shard_size="48KB", expect={"num_layers": 3}),
    Case(
        "qwen2-qkv-bias",
        "Qwen2Config",
        {},
        expect={"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "o_proj_bias": False},
    ),
    Case(
        "qwen2-tied-sharded",
        "Qwen2Config",
        {"tie_word_embeddings": True},
        max_shard_size="48KB",
        expect={"architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True},
    ),
    Case(
        "mistral",
        "MistralConfig",
        {"sliding_window": None},
        expect={"architecture": "MistralForCausalLM", "max_position": 512},
    ),
    Case(
        "mistral-sliding-window",
        "MistralConfig",
        {"sliding_window": 256},
        expect={"architecture": "MistralForCausalLM", "max_position": 256},
    ),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is fastest, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Family:
    case: Case
    folder: Path
    hf: Any  # the transformers model, fp32, eval
    prompts: list[list[int]]
    hf_ids: list[list[int]]  # greedy new tokens per prompt
    hf_step_logits: list[torch.Tensor]  # [MAX_NEW_TOKENS, vocab] per prompt


def _randomize(model: torch.nn.Module) -> None:
    """Random weights large enough that logits are well spread (no near-ties for argmax)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def _write_legacy_rope_config(path: Path, type_key: str) -> None:
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or cfg.get("rope_scaling") or {})
    cfg["rope_theta"] = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", None) or rope.pop("type", "default")
    rope.pop("type", None)
    cfg["rope_scaling"] = {type_key: rope_type, **rope} if rope_type != "default" else None
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def family(request, tmp_path_factory) -> Family:
    case: Case = request.param
    torch.manual_seed(CASES.index(case))
    config = getattr(transformers, case.config_cls)(**copy.deepcopy({**COMMON, **case.overrides}))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    _randomize(hf)
    hf.eval()
    folder = tmp_path_factory.mktemp(case.id)
    save_kwargs = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    hf.save_pretrained(folder, **save_kwargs)
    if case.legacy_rope_key:
        _write_legacy_rope_config(folder / "config.json", case.legacy_rope_key)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    # The saved generation config keeps its EOS (pdserve must ignore it via ignore_eos); the
    # reference must not stop on it either.
    hf.generation_config.eos_token_id = None
    hf_ids, hf_step_logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, len(prompt) :].tolist()
            assert len(new) == MAX_NEW_TOKENS
            hf_ids.append(new)
            hf_step_logits.append(torch.stack([step[0] for step in out.logits]).float())
    return Family(case, folder, hf, prompts, hf_ids, hf_step_logits)


def make_engine(folder: Path, **overrides) -> LLMEngine:
    config = EngineConfig(dtype="float32", device="cpu", kv_cache_memory="64MiB", block_size=BLOCK_SIZE, **overrides)
    return LLMEngine(config, model_dir=str(folder))


def next_token_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """pdserve's fp32 logits after ``prompt``: one scheduled prefill run through the model directly."""
    engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    schedule = engine.scheduler.schedule()
    assert [c.seq.request_id for c in schedule.prefills] == ["logits"] and schedule.prefills[0].completes
    logits = engine.model(engine.runner.build_batch(schedule), engine.kv_cache.layers)
    engine.abort("logits")
    assert logits.shape == (1, engine.model_config.vocab_size) and logits.dtype == torch.float32
    return logits[0]


class LogitsRecorder:
    """Wraps the runner's sampler to keep the logits of the last step (rows in sampling order,
    which is the order of ``step()``'s outputs)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.last: torch.Tensor | None = None

    @classmethod
    def install(cls, engine: LLMEngine) -> "LogitsRecorder":
        step = engine.runner.sampling  # the sampling step calls the sampler
        if not isinstance(step.sampler, cls):
            step.sampler = cls(step.sampler)
        return step.sampler

    def __call__(self, logits, params, output_index, **options):
        self.last = logits.clone()
        return self.sampler(logits, params, output_index, **options)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ids and per-step logits for ``prompts``, all added before the first step."""
    recorder = LogitsRecorder.install(engine)
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        assert steps < 200, "engine does not finish"
        for row, out in enumerate(outputs):
            ids[out.request_id].extend(out.new_token_ids)
            logits[out.request_id].append(recorder.last[row])
    keys = [f"r{i}" for i in range(len(prompts))]
    return [ids[k] for k in keys], [torch.stack(logits[k]) for k in keys]


def test_saved_checkpoint_is_read_as_configured(family: Family) -> None:
    case = family.case
    if case.max_shard_size:
        index = json.loads((family.folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (family.folder / "model.safetensors").is_file()
    engine = make_engine(family.folder)
    mc = engine.model_config
    got = {
        "architecture": mc.architecture,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "qkv_bias": mc.qkv_bias,
        "o_proj_bias": mc.o_proj_bias,
        "mlp_bias": mc.mlp_bias,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "num_layers": mc.num_layers,
        "max_position": mc.max_position,
        "rope_theta": mc.rope_theta,
        "rope_type": (mc.rope_scaling or {}).get("rope_type", "default"),
    }
    assert {k: got[k] for k in case.expect} == case.expect
    assert (family.hf.lm_head.weight is family.hf.model.embed_tokens.weight) == mc.tie_word_embeddings
    if case.legacy_rope_key:
        assert "rope_parameters" not in json.loads((family.folder / "config.json").read_text())
    # Every tensor transformers holds is the one pdserve loaded, bit for bit (q/k/v and gate/up
    # stacked; a packed layer gives its weight as loaded).
    ours = engine.model.state_dict()
    head, embedding = ours["lm_head.weight"].data_ptr(), ours["model.embed_tokens.weight"].data_ptr()
    assert (head == embedding) == mc.tie_word_embeddings  # tied: one tensor, even under a packed lm_head
    theirs = stack_checkpoint({k: v for k, v in family.hf.state_dict().items() if not k.endswith("inv_freq")})
    assert theirs.keys() <= ours.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=name)


def test_next_token_logits_match_transformers(family: Family) -> None:
    engine = make_engine(family.folder)
    for prompt in family.prompts:
        with torch.no_grad():
            expected = family.hf(torch.tensor([prompt])).logits[0, -1].float()
        got = next_token_logits(engine, prompt)
        assert expected.std() > 0.5, "degenerate reference logits"
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"prompt of {len(prompt)} tokens")


def test_greedy_ids_match_transformers_one_request_at_a_time(family: Family) -> None:
    engine = make_engine(family.folder)
    for prompt, hf_ids, hf_logits in zip(family.prompts, family.hf_ids, family.hf_step_logits):
        [ids], [logits] = generate(engine, [prompt])
        assert ids == hf_ids, f"prompt of {len(prompt)} tokens"
        # Step 0 is the prefill, the rest are decodes over the paged cache.
        torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0, msg=f"prompt of {len(prompt)} tokens")


def test_greedy_ids_match_transformers_continuous_batching(family: Family) -> None:
    # A small token budget splits the long prompts into chunks that run beside other requests'
    # decodes, so prefill over prior context (paged) and batched decode are both exercised.
    engine = make_engine(family.folder, max_num_batched_tokens=10)
    ids, logits = generate(engine, family.prompts)
    assert ids == family.hf_ids
    for got, expected in zip(logits, family.hf_step_logits):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
