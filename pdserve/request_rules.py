"""What a request may ask for: the limits, the defaults and the checks.

The router applies these rules to every public request; the engine applies the ones that
concern it again to whatever reaches a worker (``SamplingParams`` checks itself on creation).
Both call the same functions, so a request is judged the same way, and refused with the same
words, wherever it arrives. Every refusal is an ``InvalidRequest`` naming the request field:
``sampling.top_p: must be in (0, 1], got 1.5``. No torch here: the router imports this.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Protocol, Sequence

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128
PRIORITY_RANGE = (-100, 100)  # lower runs first
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 512

# Sampling defaults follow vLLM/OpenAI: 256 new tokens (or what the context has room for),
# temperature 1, top_p 1, top_k 0 (off).
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (dividing logits by it overflows)
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit)
MAX_N = 16  # choices per request (n, and best_of)
MAX_CONSTRAINT_CHARS = 100_000  # a JSON schema, regex or grammar
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (deeper ones take grammar compilers minutes)
MAX_CHOICES = 256  # strings of a choice constraint
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class InvalidRequest(ValueError):
    """A request field breaks a rule; ``field`` is its path (``sampling.stop[1]``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Constraint:
    """Structured output: the output must be a JSON value matching ``value`` (a JSON Schema
    as text) for ``json_schema``, any JSON object for ``json_object`` (``value`` empty), a
    whole match of the regex ``value``, exactly one of the strings ``choices``, or a string
    of the EBNF grammar ``value`` (rule ``root``)."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()


class Sampling(Protocol):
    """The sampling settings the checks read (``SamplingParams`` has them)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    n: int
    logprobs: int | None
    prompt_logprobs: int | None
    constraint: Constraint | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_CHOICE_DOMAIN = 0x63686F696365  # keeps choice seeds apart from the sampler's per-token seeds


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` of an n > 1 request samples with: choice 0 keeps the request's
    (its tokens equal those of the same request with n = 1), the others derive their own, so
    choices are distinct and each is reproducible on its own (on any worker, after a migration)."""
    if seed is None or index == 0:
        return seed
    import xxhash

    return xxhash.xxh3_64_intdigest(struct.pack("<QQQ", seed, index, _CHOICE_DOMAIN)) & (2**63 - 1)


def default_max_tokens(prompt_len: int, max_model_len: int) -> int:
    """``max_tokens`` when the client sets none: the default, or the room left in the context."""
    return min(DEFAULT_MAX_TOKENS, max_model_len - prompt_len)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")


def check_priority(priority: int) -> None:
    lo, hi = PRIORITY_RANGE
    if not (_is_int(priority) and lo <= priority <= hi):
        raise InvalidRequest("priority", f"{priority} is outside [{lo}, {hi}]")


def check_ttft_budget_ms(budget_ms: float) -> None:
    if not (_is_number(budget_ms) and budget_ms > 0 and math.isfinite(budget_ms)):
        raise InvalidRequest("ttft_budget_ms", f"must be a positive number of milliseconds, got {budget_ms}")


def check_prompt_tokens(
    token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, field: str = "prompt_token_ids"
) -> None:
    """A prompt the model can run: at least one token, every id in the vocabulary, and room
    left in the context for at least one new token."""
    if not token_ids:
        raise InvalidRequest(field, "the prompt holds no tokens")
    check_prompt_length(len(token_ids), max_model_len=max_model_len, field=field)  # before walking millions of ids
    bad = next((t for t in token_ids if not (_is_int(t) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_prompt_length(count: int, *, max_model_len: int, field: str = "prompt_token_ids") -> None:
    """Room left in the context after a prompt of ``count`` tokens. Checked before a list of ids
    is copied or walked: a body of millions of ids must not hold the event loop for seconds."""
    if count >= max_model_len:
        raise InvalidRequest(field, f"{count} tokens leave no room in the model's context of {max_model_len}")


def check_stop_count(count: int, *, field: str = "sampling.stop") -> None:
    """Checked before the strings are walked (as ``check_prompt_length`` is)."""
    if count > MAX_STOP_STRINGS:
        raise InvalidRequest(field, f"{count} stop strings exceed the limit of {MAX_STOP_STRINGS}")


def check_stop_token_id_count(count: int, *, field: str = "sampling.stop_token_ids") -> None:
    """Checked before the ids are walked (as ``check_prompt_length`` is)."""
    if count > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(field, f"{count} ids exceed the limit of {MAX_STOP_TOKEN_IDS}")


def check_message_count(count: int) -> None:
    if count > MAX_MESSAGES:
        raise InvalidRequest("messages", f"{count} messages exceed the limit of {MAX_MESSAGES}")


def check_sampling(
    s: Sampling, *, vocab_size: int | None = None, prompt_len: int | None = None, max_model_len: int | None = None
) -> None:
    """The sampling rules, in field order. ``vocab_size`` adds the vocabulary bounds of
    ``top_k`` and ``stop_token_ids``; ``prompt_len`` with ``max_model_len`` checks that
    ``max_tokens`` new tokens fit in the context after the prompt."""
    if not _is_int(s.max_tokens) or s.max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"must be an integer >= 1, got {s.max_tokens!r}")
    if prompt_len is not None and max_model_len is not None and prompt_len + s.max_tokens > max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"{s.max_tokens} new tokens after a {prompt_len}-token prompt exceed the context of {max_model_len}",
        )
    if not (_is_number(s.temperature) and 0 <= s.temperature <= MAX_TEMPERATURE):  # also refuses NaN
        raise InvalidRequest("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature!r}")
    if not (_is_number(s.top_p) and 0 < s.top_p <= 1):
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {s.top_p!r}")
    if not (_is_int(s.top_k) and 0 <= s.top_k and (vocab_size is None or s.top_k <= vocab_size)):
        bound = f"in [0, {vocab_size}]" if vocab_size is not None else ">= 0"
        raise InvalidRequest("sampling.top_k", f"must be an integer {bound} (0 = off), got {s.top_k!r}")
    if s.seed is not None and not (_is_int(s.seed) and 0 <= s.seed <= MAX_SEED):
        raise InvalidRequest("sampling.seed", f"must be an integer in [0, 2**63), got {s.seed!r}")
    check_stop_count(len(s.stop))
    for i, stop in enumerate(s.stop):
        if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters")
    check_stop_token_id_count(len(s.stop_token_ids))
    bad = next(
        (t for t in s.stop_token_ids if not (_is_int(t) and 0 <= t and (vocab_size is None or t < vocab_size))), None
    )
    if bad is not None:
        where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "the token ids (>= 0)"
        raise InvalidRequest("sampling.stop_token_ids", f"token id {bad!r} is outside {where}")
    if not (_is_int(s.n) and 1 <= s.n <= MAX_N):
        raise InvalidRequest("sampling.n", f"must be an integer in [1, {MAX_N}], got {s.n!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            raise InvalidRequest(f"sampling.{name}", f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    if s.constraint is not None:
        check_constraint(s.constraint)
        if s.ignore_eos:
            raise InvalidRequest(
                "sampling.ignore_eos",
                "cannot be combined with structured output (the grammar decides where the output ends)",
            )


def check_best_of(best_of: int, n: int) -> None:
    """``best_of``: choices generated, of which the ``n`` most likely are returned."""
    if not (_is_int(best_of) and n <= best_of <= MAX_N):
        raise InvalidRequest(
            "sampling.best_of", f"must be an integer in [n, {MAX_N}] = [{n}, {MAX_N}], got {best_of!r}"
        )


def check_choice_count(count: int, *, field: str = "sampling.structured_output.choice") -> None:
    """Checked before the strings are walked (as ``check_prompt_length`` is)."""
    if not 0 < count <= MAX_CHOICES:
        raise InvalidRequest(field, f"must list 1 to {MAX_CHOICES} strings, got {count}")


def check_constraint(c: Constraint) -> None:
    """The shape of a structured-output constraint. Whether a schema, regex or grammar
    compiles is the grammar engine's to say (``engine.structured_output``); a JSON schema must
    at least be JSON describing an object or a boolean schema."""
    field = f"sampling.structured_output.{c.kind}"
    if c.kind not in CONSTRAINT_KINDS:
        raise InvalidRequest(
            "sampling.structured_output", f"unknown kind {c.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}"
        )
    if c.kind == "choice":
        check_choice_count(len(c.choices), field=field)
        if any(not isinstance(x, str) or not x for x in c.choices):
            raise InvalidRequest(field, "every choice must be a non-empty string")
        if sum(map(len, c.choices)) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(field, f"the choices exceed {MAX_CONSTRAINT_CHARS} characters")
        return
    if c.kind == "json_object":
        return
    # A regex of blanks matches blanks; a schema or grammar of blanks says nothing.
    if not isinstance(c.value, str) or not (c.value if c.kind == "regex" else c.value.strip()):
        raise InvalidRequest(field, "must not be empty")
    if len(c.value) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(field, f"{len(c.value)} characters exceed the limit of {MAX_CONSTRAINT_CHARS}")
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.value)
        except ValueError as e:
            raise InvalidRequest(field, f"is not valid JSON: {e}") from None
        except RecursionError:
            schema = None  # nested past the parser's limit: refused just below
        if schema is None or nesting_depth(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(field, f"is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(field, f"must be a JSON object (a schema), got {type(schema).__name__}")
        from jsonschema import SchemaError  # imported on first use: most requests have no schema

        try:
            schema_validator(schema).check_schema(schema)
        except SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            raise InvalidRequest(
                field, f"is not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}"
            ) from None
        except (OverflowError, RecursionError, ValueError) as e:  # a pattern Python's re cannot take
            raise InvalidRequest(field, f"is not a valid JSON Schema: {type(e).__name__}: {e}") from None


def schema_validator(schema: object):
    """The jsonschema validator class of the draft ``schema`` declares. An unknown "$schema" is
    read as the latest draft (jsonschema's own default, without its warning)."""
    from jsonschema import validators

    return validators.validator_for(schema, default=validators.Draft202012Validator)


def nesting_depth(value) -> int:
    """How deeply JSON containers nest in ``value`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
