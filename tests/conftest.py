"""Shared fixtures. Tests run on CPU; Triton kernels run under its interpreter there."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit runs: Triton kernels then execute on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted once."""
    from pdserve.engine.model_store import resolve_model

    return resolve_model(None)


class HFReference:
    """Hugging Face transformers on the same GGUF, fp32: the ground truth for greedy ids."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pdserve.engine.model_store import DEFAULT_MODEL

        gguf = DEFAULT_MODEL.locate()
        self.tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        self.model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        self.model.eval()
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._memo:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt_ids]),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                )
            self._memo[key] = out[0, len(prompt_ids) :].tolist()
        return self._memo[key]


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


# Prompts of several lengths, one of 250+ tokens (texts, so they tokenize the same everywhere).
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "Here is a short story about a robot who learns to paint. Once upon a time,",
    "Summarize the following text in one sentence.\n\n"
    + " ".join(
        f"Paragraph {i}: the committee met on day {i} and discussed the budget, the harbour, the schools and the new library."
        for i in range(12)
    ),
]


@pytest.fixture(autouse=True)
def process_keeps_its_cores():
    """No test may leave this process pinned to fewer cores (every later test would run
    slower, and an OpenMP team squeezed onto one core slows by tens of times); torch's thread
    count, which an in-process engine sets for the whole process, is put back."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == cores, "the test left this process pinned"
