"""Structured output: a grammar engine (xgrammar, as vLLM and SGLang use) turns a request's
constraint (a JSON schema, any JSON object, a regex, a list of choices, an EBNF grammar) into
a compiled grammar once, and into a per-sequence matcher that builds each step's token
bitmask; the sampling step applies the masks of the whole batch at once.

A matcher is never shipped between workers: it is rebuilt from the tokens generated so far
(``GrammarState.sync``), so the first token is constrained on the prefill worker, the rest on
the decode worker, and a migrated or preempted request continues in the same grammar state.
Compiling takes milliseconds (cached per constraint); workers compile on a gRPC handler's
thread before a request enters the engine, so a constraint that does not compile is refused
(INVALID_ARGUMENT naming the field) without stalling the engine thread.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from typing import TYPE_CHECKING

import torch

from pdserve.engine.schema_support import CheckTooCostly, skipped_part
from pdserve.request_rules import Constraint, InvalidRequest

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)
COMPILE_THREADS = 2


def constraint_field(c: Constraint) -> str:
    return f"sampling.structured_output.{c.kind}"


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose strings are exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar():
    """xgrammar, imported on the first constraint: with the transformers it imports, it is 0.6 s
    of every worker's start, for a feature most requests do not use."""
    import xgrammar

    return xgrammar


def _engine_message(error: Exception) -> str:
    """xgrammar's errors start with a timestamp and a C++ source location: keep the words."""
    text = str(error).strip()
    return re.sub(r"^\[[0-9:]+\]\s*\S+:\d+:\s*", "", text).splitlines()[0] if text else type(error).__name__


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer (thread-safe; results cached)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get(self) -> xgr.GrammarCompiler:
        with self._lock:  # the tokenizer's vocabulary is read once, on the first constraint
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
            return self._compiler

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """Raises ``InvalidRequest`` naming the field when the grammar engine refuses it, or when
        it allows no first token (``root ::= root``: every token would be masked, and the sampler
        would pick one anyway), or when it is a JSON schema using what the engine would skip."""
        if c.kind == "json_schema" and (problem := _schema_refusal(c.value)):
            raise InvalidRequest(constraint_field(c), problem)
        compiled = self._compile(c)
        xgr = _xgrammar()
        first = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not bool(first.any()):
            raise InvalidRequest(constraint_field(c), "the grammar accepts no string")
        return compiled

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        compiler = self._get()
        try:
            if c.kind == "json_schema":
                return compiler.compile_json_schema(c.value, any_whitespace=False)
            if c.kind == "json_object":  # an object, as OpenAI's JSON mode promises (the builtin takes any value)
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(c.choices))
            if c.kind == "grammar":
                return compiler.compile_grammar(c.value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(
                constraint_field(c), f"the grammar engine cannot compile it: {_engine_message(e)}"
            ) from None
        raise InvalidRequest("sampling.structured_output", f"unknown kind {c.kind!r}")

    def state(self, c: Constraint) -> GrammarState:
        """A matcher for one sequence (the constraint was checked by ``compile`` on admission)."""
        return GrammarState(_xgrammar().GrammarMatcher(self._compile(c)), self.stop_token_ids)


def _schema_refusal(schema_text: str) -> str | None:
    """Why a JSON schema is refused beyond what the grammar engine says, or None."""
    try:
        return _skipped_part(schema_text)
    except CheckTooCostly as e:  # not remembered: under less load the check may finish
        return str(e)
    except Exception:  # never let a schema through unchecked: refused, and the bug logged
        log.exception("structured output: could not check what the grammar engine enforces of a schema")
        return "could not be checked against what the grammar engine enforces"


@functools.lru_cache(maxsize=64)  # every admission asks again (keys: schemas of up to 100k characters)
def _skipped_part(schema_text: str) -> str | None:
    return skipped_part(json.loads(schema_text))


class GrammarState:
    """One sequence's position in its grammar, fed the sequence's output tokens."""

    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.accepted = 0  # output tokens fed so far
        self.broken = False  # a token the grammar refused (cannot happen to masked samples)
        self.dead_end = False  # the grammar allows no token from here: only a stop token is left

    def sync(self, output_token_ids: list[int]) -> None:
        """Feeds the output tokens the matcher has not seen (after a handoff, a migration, a step)."""
        if self.dead_end:  # the stop token that ends the output is not the grammar's
            self.accepted = len(output_token_ids)
            return
        for token in output_token_ids[self.accepted :]:
            if not self.broken and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                log.warning("structured output: token %d is outside the grammar; the rest is unconstrained", token)
                self.broken = True
        self.accepted = len(output_token_ids)

    @property
    def constrains(self) -> bool:
        return not self.broken and not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens the grammar allows next (after a dead end, the stop tokens)."""
        if self.dead_end:
            self._allow_only_stop(bitmask, row)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def end_here(self, bitmask: torch.Tensor, row: int) -> None:
        """The grammar allows no token from here (``root ::= "a" b`` with ``b ::= b``, after the
        "a"): the output ends, with a stop token, rather than with a token outside the grammar
        and unconstrained text after it."""
        if not self.stop_token_ids:  # nothing can end it: unconstrained from here on, as after a refused token
            log.warning(
                "structured output: the grammar allows no token after %d; the rest is unconstrained", self.accepted
            )
            self.broken, bitmask[row] = True, -1
            return
        log.warning("structured output: the grammar allows no token after %d; the output ends there", self.accepted)
        self.dead_end = True
        self._allow_only_stop(bitmask, row)

    def _allow_only_stop(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.stop_token_ids:
            bitmask[row, token >> 5] |= _bit(token & 31)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 bitmask word, as the signed value torch stores."""
    return -(1 << 31) if i == 31 else 1 << i


class BatchMasker:
    """Applies the grammar masks of a step's rows in one call (one per engine: its bitmask
    buffers are reused across steps)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, states: list[tuple[int, GrammarState]]) -> None:
        """Masks (to -inf) in place, for each ``(row, state)``, every token the grammar forbids next."""
        states = [(row, s) for row, s in states if s.constrains]
        if not states:
            return
        xgr = _xgrammar()
        rows, vocab = logits.shape
        key = (1 << max(rows - 1, 0).bit_length(), vocab)  # a few sizes (powers of two), reused
        if key not in self._buffers:
            self._buffers[key] = xgr.allocate_token_bitmask(*key)
        bitmask = self._buffers[key]
        for row, state in states:
            state.fill(bitmask, row)
        # One check for the batch, in numpy: torch's reduction would wake the engine's thread pool.
        allows_nothing = (~bitmask.numpy()[[row for row, _ in states]].any(axis=1)).tolist()
        for (row, state), dead in zip(states, allows_nothing):
            if dead:
                state.end_here(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits,
            bitmask[:rows].to(logits.device, non_blocking=True),
            vocab_size=vocab,
            indices=[row for row, _ in states],
        )
