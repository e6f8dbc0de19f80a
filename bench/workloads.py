"""Benchmark workloads: what each request sends (prompt token ids) and how many tokens it asks for.

Everything is generated locally from a seed; nothing is downloaded. Prompts travel as token
ids so the server and the Hugging Face baseline see exactly the same input, and the input
length of each request is known without asking the server.

Workloads
- ``random``: input and output lengths uniform in the given ranges; token ids uniform in
  [1000, 40000), a range of ordinary word pieces in the default model's vocabulary (49152),
  away from the special tokens at the bottom.
- ``sharegpt``: a synthetic stand-in for the long-tailed lengths of ShareGPT conversations.
  Input lengths ~ LogNormal(mu=5.0, sigma=1.0) (median e^5 ~ 148 tokens, mean ~ 245),
  output lengths ~ LogNormal(mu=4.8, sigma=0.9) (median ~ 122, mean ~ 183), both rounded and
  clipped to the given ranges (default input [4, 1024], output [4, 512]); like vLLM's
  ShareGPT filter, a pair whose total exceeds 2048 tokens has its output shortened. These
  parameters give the dataset's general shape (many short turns, a long tail); they are not
  fitted to it.
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens of (seeded,
  English-word) text; each request = one system prompt (exactly the same ``prefix_len`` token
  ids for every user of that prompt) + its own user question ("User i asks: ..."), whose
  length is in the input range (default 16-64 tokens). "8 system prompts x 16 users" is
  ``--num-prefixes 8 --num-prompts 128``: the users are split as evenly as possible (sizes
  differ by at most one when num_prompts is not a multiple) and their order is a seeded
  shuffle, so requests of one system prompt do not arrive at a fixed stride (with an even
  number of prompts in strict rotation, round-robin routing over 2 workers would send every
  system prompt to the same worker by accident and look as cache-friendly as kv_aware).
  Exercises prefix caching and cache-aware routing.
- ``mixed``: a bimodal mix of interactive and document-sized requests, token ids as in
  ``random``. A fraction ``long_fraction`` (default 0.2; exactly round(fraction * N)
  requests, at seeded random positions) are long: input uniform in ``long_input_len``
  (default 1024-2048) and output in ``long_output_len`` (default 128-256), the input clipped
  so input + output fit the model context (``MAX_MODEL_LEN`` = 8192, the default model's).
  The rest are short: input in the input range (default 32-128), output in the output range
  (default 16-64); ``--input-len``/``--output-len`` set the short class. Results split TTFT
  by prompt length (``--short-threshold``, default 256 tokens), so keep the short input range
  below the threshold and the long one above it.
- ``extractive``: answers that repeat the prompt's text (what speculative decoding's n-gram
  lookup is for): a passage of Python's own documentation (``pydoc_data.topics``, on every
  machine; its text follows the Python version) of about the input length (default 160-400
  tokens), with a seeded instruction to repeat it word for word, to fix the typos seeded into
  it, or to rewrite it one sentence per line; the model's chat template when it has one.
  Output lengths default to 64-128 (the answer is mostly the passage).
- ``jsonl``: the user's own prompts, one JSON object per line: ``{"prompt": "..."}`` or
  ``{"prompt_token_ids": [...]}``, optionally ``"output_len"`` (or ``"max_tokens"``); lines
  without one draw an output length from the output range.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

WORKLOADS = ("random", "sharegpt", "shared-prefix", "mixed", "extractive", "jsonl")
TOKEN_ID_RANGE = (1000, 40000)
SHAREGPT_INPUT = (5.0, 1.0)  # lognormal (mu, sigma) of input lengths
SHAREGPT_OUTPUT = (4.8, 0.9)  # lognormal (mu, sigma) of output lengths
SHAREGPT_MAX_TOTAL = 2048
DEFAULT_INPUT_LEN = {
    "random": (32, 256),
    "sharegpt": (4, 1024),
    "shared-prefix": (16, 64),
    "mixed": (32, 128),
    "extractive": (160, 400),
    "jsonl": (1, 1),
}
DEFAULT_OUTPUT_LEN = {
    "random": (16, 64),
    "sharegpt": (4, 512),
    "shared-prefix": (16, 64),
    "mixed": (16, 64),
    "extractive": (64, 128),
    "jsonl": (16, 64),
}
EXTRACTIVE_TASKS = (
    "Repeat the following passage exactly, word for word.",
    "The following passage contains a few typos. Write out the corrected passage in full.",
    "Rewrite the following passage with each sentence on its own line.",
)
MIXED_LONG_FRACTION = 0.2
MIXED_LONG_INPUT = (1024, 2048)
MIXED_LONG_OUTPUT = (128, 256)
MAX_MODEL_LEN = 8192  # context of the default model (SmolLM2-135M); long mixed prompts are clipped to fit

log = logging.getLogger(__name__)

# Word list for readable shared-prefix text (any text works for caching; words keep it realistic).
_WORDS = (
    "the a of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find long down day did get come "
    "made may part assistant policy customer answer question helpful careful precise support order account"
).split()


class WorkloadError(ValueError):
    """Bad workload input (unknown name, bad range, malformed JSONL line)."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: tuple[int, int] | None = None  # None: the workload's default range
    output_len: tuple[int, int] | None = None
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 256  # shared-prefix: tokens per system prompt
    path: str | None = None  # jsonl: the file
    long_fraction: float = MIXED_LONG_FRACTION  # mixed: share of long requests
    long_input_len: tuple[int, int] = MIXED_LONG_INPUT  # mixed: input range of the long requests
    long_output_len: tuple[int, int] = MIXED_LONG_OUTPUT  # mixed: output range of the long requests

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise WorkloadError(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}")
        if self.num_prompts < 1:
            raise WorkloadError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        ranges = (
            ("--input-len", self.input_len),
            ("--output-len", self.output_len),
            ("--long-input-len", self.long_input_len),
            ("--long-output-len", self.long_output_len),
        )
        for label, rng in ranges:
            if rng is not None and not (1 <= rng[0] <= rng[1]):
                raise WorkloadError(f"{label} must be N or LO:HI with 1 <= LO <= HI, got {rng[0]}:{rng[1]}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise WorkloadError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_output_len[1] >= MAX_MODEL_LEN:
            raise WorkloadError(
                f"--long-output-len must leave room for a prompt in the context of {MAX_MODEL_LEN} tokens"
            )
        if self.num_prefixes < 1 or self.prefix_len < 1:
            raise WorkloadError("--num-prefixes and --prefix-len must be >= 1")
        if self.name == "jsonl" and not self.path:
            raise WorkloadError("the jsonl workload needs --dataset-path FILE")

    def input_range(self) -> tuple[int, int]:
        return self.input_len or DEFAULT_INPUT_LEN[self.name]

    def output_range(self) -> tuple[int, int]:
        return self.output_len or DEFAULT_OUTPUT_LEN[self.name]


def parse_range(text: str) -> tuple[int, int]:
    """'N' -> (N, N); 'LO:HI' -> (LO, HI)."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise WorkloadError(f"length range must be N or LO:HI (integers), got {text!r}") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise WorkloadError(f"length range must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return values[0], values[1]


def build(cfg: WorkloadConfig, tokenizer: Callable[[], Tokenizer]) -> list[RequestSpec]:
    """The requests of a workload; ``tokenizer`` is called only by workloads that hold text."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.name == "random":
        return _random(cfg, rng)
    if cfg.name == "sharegpt":
        return _sharegpt(cfg, rng)
    if cfg.name == "shared-prefix":
        return _shared_prefix(cfg, rng, tokenizer())
    if cfg.name == "mixed":
        return _mixed(cfg, rng)
    if cfg.name == "extractive":
        return _extractive(cfg, rng, tokenizer())
    return load_jsonl(Path(cfg.path or ""), cfg, rng, tokenizer)


def warmup_specs(specs: list[RequestSpec], n: int, seed: int) -> list[RequestSpec]:
    """Same lengths as the first requests but fresh token ids, so warm-up never fills the
    prefix cache with the prompts that are then measured."""
    rng = np.random.default_rng(seed + 10_007)
    out = []
    for i in range(n):
        src = specs[i % len(specs)]
        out.append(RequestSpec(_random_ids(rng, src.prompt_len), src.max_tokens))
    return out


def variant(specs: list[RequestSpec], k: int) -> list[RequestSpec]:
    """Variant ``k`` of a workload: the same lengths and the same sharing structure, but no
    full KV block in common with any other variant, so each run of a sweep starts with a
    cold prefix cache instead of finding the previous run's prompts cached.

    In each prompt the first token whose id lies in [TOKEN_ID_RANGE[0], M] (M: the largest id
    in the workload, so every id stays one the model knows) is shifted by k, cyclically in
    that range. Prompts equal up to a point stay equal up to that point (a system prompt is
    still shared by its users); block hashes chain from the first token, so when that token
    is the first of the prompt (every synthetic workload) every full block changes; in a
    JSONL prompt that starts with special tokens, the blocks before it stay as they were.
    ``k = 0`` returns the workload as it is.
    """
    lo = TOKEN_ID_RANGE[0]
    hi = max((t for s in specs for t in s.prompt_token_ids), default=0) + 1
    if k == 0 or hi - lo < 2:
        return list(specs)
    shift = k % (hi - lo) or 1
    out = []
    for s in specs:
        ids = list(s.prompt_token_ids)
        p = next((i for i, t in enumerate(ids) if lo <= t < hi), None)
        if p is not None:
            ids[p] = lo + (ids[p] - lo + shift) % (hi - lo)
        out.append(RequestSpec(tuple(ids), s.max_tokens))
    return out


def _random_ids(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(*TOKEN_ID_RANGE, size=n))


def _random(cfg: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    (ilo, ihi), (olo, ohi) = cfg.input_range(), cfg.output_range()
    ins = rng.integers(ilo, ihi + 1, size=cfg.num_prompts)
    outs = rng.integers(olo, ohi + 1, size=cfg.num_prompts)
    return [RequestSpec(_random_ids(rng, int(i)), int(o)) for i, o in zip(ins, outs)]


def _sharegpt(cfg: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    (ilo, ihi), (olo, ohi) = cfg.input_range(), cfg.output_range()
    ins = np.clip(np.rint(rng.lognormal(*SHAREGPT_INPUT, size=cfg.num_prompts)), ilo, ihi).astype(int)
    outs = np.clip(np.rint(rng.lognormal(*SHAREGPT_OUTPUT, size=cfg.num_prompts)), olo, ohi).astype(int)
    specs = []
    for i, o in zip(ins, outs):
        o = max(1, min(int(o), SHAREGPT_MAX_TOTAL - int(i)))
        specs.append(RequestSpec(_random_ids(rng, int(i)), o))
    return specs


def _text_ids(rng: np.random.Generator, tok: Tokenizer, head: str, n: int) -> list[int]:
    """Exactly n token ids of seeded English-word text that starts with ``head``."""
    ids = tok.encode(head, add_special_tokens=False)
    while len(ids) < n:
        words = rng.choice(_WORDS, size=max(16, n - len(ids)))
        ids += tok.encode(" " + " ".join(words), add_special_tokens=False)
    return ids[:n]


def _shared_prefix(cfg: WorkloadConfig, rng: np.random.Generator, tok: Tokenizer) -> list[RequestSpec]:
    (ilo, ihi), (olo, ohi) = cfg.input_range(), cfg.output_range()
    prefixes = [
        _text_ids(rng, tok, f"System: you are assistant {k}. Rules:", cfg.prefix_len) for k in range(cfg.num_prefixes)
    ]
    groups = rng.permutation(np.arange(cfg.num_prompts) % cfg.num_prefixes)  # even split, shuffled order
    specs = []
    for i, g in enumerate(groups):
        question = _text_ids(rng, tok, f"\nUser {i} asks:", int(rng.integers(ilo, ihi + 1)))
        specs.append(RequestSpec(tuple(prefixes[int(g)] + question), int(rng.integers(olo, ohi + 1))))
    return specs


def prefix_groups(specs: list[RequestSpec], prefix_len: int) -> list[int]:
    """Which system prompt each request of a shared-prefix workload uses (0, 1, ... in order of
    first appearance)."""
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(s.prompt_token_ids[:prefix_len], len(seen)) for s in specs]


def _mixed(cfg: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    (ilo, ihi), (olo, ohi) = cfg.input_range(), cfg.output_range()
    (long_ilo, long_ihi), (long_olo, long_ohi) = cfg.long_input_len, cfg.long_output_len
    n_long = int(round(cfg.long_fraction * cfg.num_prompts))
    is_long = np.zeros(cfg.num_prompts, dtype=bool)
    is_long[rng.choice(cfg.num_prompts, size=n_long, replace=False)] = True
    specs = []
    for long in is_long:
        if long:
            out = int(rng.integers(long_olo, long_ohi + 1))
            n_in = min(int(rng.integers(long_ilo, long_ihi + 1)), MAX_MODEL_LEN - out)
        else:
            out = int(rng.integers(olo, ohi + 1))
            n_in = int(rng.integers(ilo, ihi + 1))
        specs.append(RequestSpec(_random_ids(rng, n_in), out))
    return specs


def _prose_paragraphs() -> list[str]:
    """The prose of Python's topic help, one string per paragraph (code and headings left out)."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.strip("\n").split("\n")
            if not lines[0] or lines[0][0].isspace() or any(set(line) <= set("*=-") for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) > 80 and text[-1] in ".:":
                paragraphs.append(text)
    return paragraphs


def _with_typos(rng: np.random.Generator, text: str, count: int) -> str:
    words = text.split(" ")
    for i in rng.choice(len(words), size=min(count, len(words)), replace=False):
        w = words[i]
        if len(w) > 3 and w.isalpha():
            j = int(rng.integers(1, len(w) - 2))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]  # two letters swapped
    return " ".join(words)


def _extractive(cfg: WorkloadConfig, rng: np.random.Generator, tok: Tokenizer) -> list[RequestSpec]:
    (ilo, ihi), (olo, ohi) = cfg.input_range(), cfg.output_range()
    paragraphs = _prose_paragraphs()
    template = getattr(tok, "apply_chat_template", None) if getattr(tok, "chat_template", None) else None
    specs = []
    for _ in range(cfg.num_prompts):
        target = int(rng.integers(ilo, ihi + 1))
        start = int(rng.integers(len(paragraphs)))
        passage, n = [], 0
        while n < target:
            paragraph = paragraphs[(start + len(passage)) % len(paragraphs)]
            passage.append(paragraph)
            n += len(tok.encode(paragraph, add_special_tokens=False))
        task = int(rng.integers(len(EXTRACTIVE_TASKS)))
        text = "\n\n".join(passage)
        if task == 1:
            text = _with_typos(rng, text, max(2, len(text) // 300))
        message = f"{EXTRACTIVE_TASKS[task]}\n\n{text}"
        if template is not None:
            ids = template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(f"{message}\n\nAnswer:\n", add_special_tokens=True)
        specs.append(RequestSpec(tuple(ids), int(rng.integers(olo, ohi + 1))))
    return specs


def load_jsonl(
    path: Path, cfg: WorkloadConfig, rng: np.random.Generator, tokenizer: Callable[[], Tokenizer]
) -> list[RequestSpec]:
    """The first ``num_prompts`` requests of a JSONL file, the file over again if it is shorter
    (as vLLM's benchmark oversamples); errors name the line number."""
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file")
    olo, ohi = cfg.output_range()
    tok: Tokenizer | None = None
    specs: list[RequestSpec] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(specs) >= cfg.num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{path}:{lineno}: expected a JSON object")
            if "prompt_token_ids" in obj:
                ids = obj["prompt_token_ids"]
                if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
                    raise WorkloadError(f"{path}:{lineno}: prompt_token_ids must be a non-empty list of ints >= 0")
            elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
                tok = tok or tokenizer()
                ids = tok.encode(obj["prompt"], add_special_tokens=True)
            else:
                raise WorkloadError(f"{path}:{lineno}: needs a non-empty string 'prompt' or a 'prompt_token_ids' list")
            out = obj.get("output_len", obj.get("max_tokens"))
            if out is None:
                out = int(rng.integers(olo, ohi + 1))
            if not isinstance(out, int) or isinstance(out, bool) or out < 1:
                raise WorkloadError(f"{path}:{lineno}: output_len must be an integer >= 1, got {out!r}")
            specs.append(RequestSpec(tuple(ids), out))
    if not specs:
        raise WorkloadError(f"{path}: no prompts in the file")
    if len(specs) < cfg.num_prompts:
        log.warning("%s holds %d prompts; sending them over again to make %d", path, len(specs), cfg.num_prompts)
        specs = [specs[i % len(specs)] for i in range(cfg.num_prompts)]
    return specs
