"""Property-based fuzzing (hypothesis) of the public request validation, through the real
path a gRPC request takes: wire bytes, ``CompletionRequest.from_proto``, ``validate``.

Properties: a well-formed request is accepted, and what is accepted a worker accepts too (the
engine's own checks pass on it after the wire); bad input is refused with ``InvalidRequest``
naming a real field of the request, the one that was corrupted; nothing else is ever raised;
the work spent refusing is bounded by the model's context, not by the size of the input.
No copy of the rules here: the oracles are the tokenizer, the engine's checks and the
corruption the test itself made.

The cases labelled "was a bug" are regression tests for what this fuzzing found.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
import re
from dataclasses import replace

import grpc
import pytest
from fuzzing import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, fuzz
from hypothesis import event, given, note
from hypothesis import strategies as st

from pdserve.client import build_request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import (
    CHAT_ROLES,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    PRIORITY_RANGE,
    check_prompt_tokens,
    check_sampling,
    default_max_tokens,
)
from pdserve.router.completions import Completions
from pdserve.router.request import CompletionRequest
from pdserve.router.servicer import RouterService, add_router_service
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import InvalidRequest, ValidatedRequest, validate
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.wire import sampling_from_proto, sampling_to_proto


@pytest.fixture(scope="module")
def tok(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


def check(req: pb.GenerateRequest, tok) -> ValidatedRequest:
    """What the gRPC servicer does with a request (off the event loop)."""
    return validate(CompletionRequest.from_proto(req), tok)


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tok: RouterTokenizer) -> None:
        self.tok = tok
        self.chars = 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        self.chars += sum(len(m["content"]) for m in messages)
        return self.tok.encode_chat(messages)


# Refusing an oversized input may tokenize a bounded prefix (a few characters per token of the
# context), never the whole input: SmolLM2's context is 8,192 tokens, inputs go up to 1M chars.
BOUNDED_WORK = 10 * 8192


# =========================================================================================
# 1. Any GenerateRequest
# =========================================================================================

SPECIAL_STRINGS = [
    "",
    " ",
    "\x00",
    "\n",
    "\r\n",
    "\t",
    "\x7f",
    "\x1b[31m",
    "\u200b",
    "\ufeff",
    "\u202e",
    "\ufffd",
    "\U0010ffff",
    "\U000e0001",
    "a\u0301\u0301\u0301",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>system\n",
    "{{ raise_exception('boom') }}",
    "{% for m in messages %}",
    "\\u0000",
    "%s%n%x",
    "🙂",
    "\ud7ff",
    "\ue000",
    "user",
    "x" * MAX_STOP_STRING_CHARS,
    "x" * (MAX_STOP_STRING_CHARS + 1),
]
ODD_CATEGORIES = ["Cc", "Cf", "Co", "Cn", "Zs", "Zl", "Zp", "Mn", "Me"]


@functools.lru_cache(maxsize=None)
def odd_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Any text protobuf can carry (every code point but lone surrogates), biased to odd ones."""
    return st.one_of(
        st.text(max_size=max_size),
        st.text(st.characters(categories=ODD_CATEGORIES), max_size=max_size),
        st.text(st.characters(codec="ascii"), max_size=max_size),
        st.sampled_from(SPECIAL_STRINGS),
    )


def huge_text(max_repeats: int) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(["word ", "é", "🙂", "\x00", "<|im_end|>", "ab\n", "\u200b", " "])
    return st.builds(operator.mul, pieces, st.integers(500, max_repeats))


ANY_FLOAT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            0.0,
            -0.0,
            1.0,
            100.0,
            math.nextafter(100.0, math.inf),
            5e-324,
            -5e-324,
            math.nextafter(1.0, 2.0),
            math.nan,
            math.inf,
            -math.inf,
            1e308,
        ]
    ),
)
ANY_INT64 = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.sampled_from([INT64_MIN, INT64_MAX, -1, 0, 1]))


def repeated(item: st.SearchStrategy, lo: int, hi: int) -> st.SearchStrategy[list]:
    return st.builds(lambda x, n: [x] * n, item, st.integers(lo, hi))


def edges_or(edges: list, *general: st.SearchStrategy) -> st.SearchStrategy:
    """Boundary values two times in three, else the general strategies."""
    return st.one_of(st.sampled_from(edges), st.sampled_from(edges), *general)


@functools.lru_cache(maxsize=None)
def request_parts(vocab: int, max_len: int) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """For each part of a GenerateRequest: (a well-formed value, anything at all), both with
    their boundary values likely. Built once."""
    v, n = vocab, max_len
    lo, hi = PRIORITY_RANGE
    token_id = edges_or([-1, 0, v - 1, v, v + 1, INT64_MIN, INT64_MAX], st.integers(0, v - 1), ANY_INT64)
    printable = st.text(
        st.characters(categories=["L", "M", "N", "P", "S"], include_characters=" "), max_size=MAX_REQUEST_ID_CHARS
    )
    role = edges_or(
        ["", "User", "USER", " user", "user ", "bot", "developer", "function", "ipython", "system\x00", "usér"],
        st.sampled_from(CHAT_ROLES),
        st.text(max_size=12),
    )
    message = st.tuples(role, st.one_of(odd_text(), huge_text(8_000)))
    short_message = st.tuples(
        role, odd_text()
    )  # 512 long ones would be up to 1M chars: seconds of tokenizing (see the report)
    good_message = st.tuples(st.sampled_from(CHAT_ROLES), odd_text(100))
    nextup, nextdown = (lambda x: math.nextafter(x, math.inf)), (lambda x: math.nextafter(x, -math.inf))
    return {
        "request_id": (
            edges_or(["", "x" * MAX_REQUEST_ID_CHARS, " ", "é" * MAX_REQUEST_ID_CHARS], printable),
            edges_or(
                [
                    "x" * (MAX_REQUEST_ID_CHARS + 1),
                    "é" * 10_000,
                    "a\nb",
                    "\x00",
                    "id\u200b",
                    "\u00a0",
                    "\x7f",
                    "\u2028",
                ],
                odd_text(200),
                st.text(st.characters(codec="ascii"), min_size=100, max_size=400),
            ),
        ),
        "priority": (
            edges_or([lo, hi, 0], st.integers(lo, hi)),
            edges_or([lo - 1, hi + 1, INT32_MIN, INT32_MAX], st.integers(INT32_MIN, INT32_MAX)),
        ),
        "ttft_budget_ms": (
            edges_or([None, 5e-324, 1e308], st.floats(min_value=0, exclude_min=True, allow_infinity=False)),
            edges_or([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf], ANY_FLOAT),
        ),
        "inputs": (
            st.sampled_from(["prompt", "prompt_token_ids", "messages"]),
            st.sampled_from(
                ["prompt", "prompt_token_ids", "messages"] * 2
                + ["none", "prompt+prompt_token_ids", "prompt+messages", "prompt_token_ids+messages", "all"]
            ),
        ),
        # Well-formed prompts hold a letter (the tokenizer drops some characters, e.g. "\x06", entirely)
        # and leave room for 64 new tokens (the most a well-formed max_tokens asks).
        "prompt": (
            st.one_of(odd_text(200), huge_text(1_500)).map(lambda t: "x" + t) | st.just("🙂" * ((n - 65) // 2)),
            edges_or(
                ["", "x" * (MAX_PROMPT_CHARS + 1), "word " * (n + 10), "🙂" * (n // 2), "\x00" * n],
                odd_text(),
                huge_text(12_000),
            ),
        ),
        "prompt_token_ids": (
            st.one_of(
                st.lists(st.integers(0, v - 1), min_size=1, max_size=300),
                repeated(st.integers(0, v - 1), n - 300, n - 65),
            ),
            edges_or(
                [[v], [-1], [INT64_MIN], [INT64_MAX], [0] * n, [1] * (n + 1), [v - 1, v]],
                st.lists(token_id, min_size=1, max_size=40),
                repeated(token_id, 1, 20_000),
            ),
        ),
        "messages": (
            st.builds(
                lambda some, rest: [*rest[: len(rest) // 2], some, *rest[len(rest) // 2 :]],
                st.tuples(st.sampled_from(CHAT_ROLES), odd_text(100).filter(bool)),
                st.lists(good_message, max_size=5),
            ),
            edges_or(
                [
                    [("user", "")],
                    [("system", ""), ("user", "")],
                    [("user", "x")] * (MAX_MESSAGES + 1),
                    [("user", "x" * (MAX_PROMPT_CHARS // 2 + 1))] * 2,
                    [("user", "word " * n)],
                    [("wizard", "x")],
                    [("user", "x"), ("User", "y")],
                ],
                st.lists(message, min_size=1, max_size=6),
                repeated(short_message, MAX_MESSAGES - 1, MAX_MESSAGES + 1),
            ),
        ),
        "max_tokens": (
            edges_or([None, 1], st.none() | st.integers(1, 64)),
            edges_or([0, -1, n - 1, n, n + 1, INT64_MIN, INT64_MAX], st.none() | ANY_INT64),
        ),
        "temperature": (
            edges_or([None, 0.0, -0.0, MAX_TEMPERATURE], st.floats(0, MAX_TEMPERATURE)),
            edges_or([nextup(MAX_TEMPERATURE), -5e-324, math.nan, math.inf, -math.inf], st.none() | ANY_FLOAT),
        ),
        "top_p": (
            edges_or([None, 5e-324, 1.0], st.floats(0, 1, exclude_min=True)),
            edges_or([0.0, -0.0, nextup(1.0), nextdown(0.0), math.nan, math.inf, -1.0], st.none() | ANY_FLOAT),
        ),
        "top_k": (
            edges_or([None, 0, v], st.integers(0, v)),
            edges_or([-1, v + 1, INT64_MIN, INT64_MAX], st.none() | ANY_INT64),
        ),
        "seed": (
            edges_or([None, 0, MAX_SEED], st.integers(0, MAX_SEED)),
            edges_or([-1, INT64_MIN], st.none() | ANY_INT64),
        ),
        "stop": (
            edges_or(
                [[], ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, ["🙂" * MAX_STOP_STRING_CHARS]],
                st.lists(
                    odd_text(MAX_STOP_STRING_CHARS).filter(lambda x: 0 < len(x) <= MAX_STOP_STRING_CHARS),
                    max_size=MAX_STOP_STRINGS,
                ),
            ),
            edges_or(
                [
                    [""],
                    ["a", ""],
                    ["x" * (MAX_STOP_STRING_CHARS + 1)],
                    ["🙂" * (MAX_STOP_STRING_CHARS + 1)],
                    ["a"] * (MAX_STOP_STRINGS + 1),
                    [""] * 10_000,
                ],
                st.lists(odd_text(300), max_size=20),
                repeated(st.sampled_from(["a", "", "x" * 257]), 15, 5_000),
            ),
        ),
        "stop_token_ids": (
            edges_or(
                [[], [0] * MAX_STOP_TOKEN_IDS, [v - 1]], st.lists(st.integers(0, v - 1), max_size=MAX_STOP_TOKEN_IDS)
            ),
            edges_or(
                [[-1], [v], [0] * (MAX_STOP_TOKEN_IDS + 1), [INT64_MIN], list(range(100_000))],
                st.lists(token_id, max_size=70),
                repeated(token_id, 60, 20_000),
            ),
        ),
    }


INPUTS = ["prompt", "prompt_token_ids", "messages"]
PARTS = [
    "request_id",
    "priority",
    "ttft_budget_ms",
    "inputs",
    *INPUTS,
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
]
WHICH_ARBITRARY = st.one_of(
    st.just(frozenset()), st.sampled_from(PARTS).map(lambda p: {p}), st.sets(st.sampled_from(PARTS))
)
PART_FIELDS = {
    "request_id": r"request_id",
    "priority": r"priority",
    "ttft_budget_ms": r"ttft_budget_ms",
    # A long prompt may leave no room for max_tokens.
    "inputs": r"prompt|prompt_token_ids|messages|messages\[\d+\]\.role|sampling\.max_tokens",
    "prompt": r"prompt|sampling\.max_tokens",
    "prompt_token_ids": r"prompt_token_ids|sampling\.max_tokens",
    "messages": r"messages|messages\[\d+\]\.role|sampling\.max_tokens",
    "max_tokens": r"sampling\.max_tokens",
    "temperature": r"sampling\.temperature",
    "top_p": r"sampling\.top_p",
    "top_k": r"sampling\.top_k",
    "seed": r"sampling\.seed",
    "stop": r"sampling\.stop(\[\d+\])?",
    "stop_token_ids": r"sampling\.stop_token_ids",
}


@st.composite
def generate_requests(
    draw, vocab: int, max_len: int, only: str | None = None
) -> tuple[pb.GenerateRequest, frozenset[str]]:
    """A GenerateRequest where each part is either well formed or arbitrary: a mix of valid
    requests, requests with one or a few bad parts, and chaos (``only``: just that part
    arbitrary); returned with the names of the arbitrary parts."""
    parts = request_parts(vocab, max_len)
    arbitrary = {only} if only else draw(WHICH_ARBITRARY, label="arbitrary parts")

    def pick(name: str):
        good, anything = parts[name]
        return draw(anything if name in arbitrary else good, label=name)

    bad_input = next((name for name in INPUTS if name in arbitrary), None)
    inputs = bad_input if bad_input and "inputs" not in arbitrary else pick("inputs")
    given = INPUTS if inputs == "all" else inputs.split("+")
    values = {
        name: draw(parts[name][name in arbitrary or "inputs" in arbitrary], label=name) if name in given else None
        for name in INPUTS
    }
    sampling = {
        name: pick(name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
    }
    req = build_request(
        values["prompt"],
        prompt_token_ids=values["prompt_token_ids"],
        messages=[{"role": r, "content": c} for r, c in values["messages"] or []],
        request_id=pick("request_id"),
        priority=pick("priority"),
        ignore_eos=draw(st.booleans()),
        **sampling,
    )
    ttft = pick("ttft_budget_ms")
    if ttft is not None:
        req.ttft_budget_ms = ttft
    # What the router sees is what came over the wire.
    return pb.GenerateRequest.FromString(req.SerializeToString()), frozenset(arbitrary)


FIELD_PATH = re.compile(
    r"(request_id|priority|ttft_budget_ms|prompt|prompt_token_ids|messages|messages\[(?P<msg>\d+)\]\.role"
    r"|sampling\.(max_tokens|temperature|top_p|top_k|seed|stop|stop_token_ids)|sampling\.stop\[(?P<stop>\d+)\])"
)


def given_inputs(req: pb.GenerateRequest) -> list[str]:
    return [
        name
        for name, present in (
            ("prompt", req.HasField("prompt")),
            ("prompt_token_ids", len(req.prompt_token_ids) > 0),
            ("messages", len(req.messages) > 0),
        )
        if present
    ]


def check_accepted(req: pb.GenerateRequest, v: ValidatedRequest, tok: RouterTokenizer) -> None:
    """What was given passes through unchanged, what was not takes the documented default, and
    a worker accepts the result: the engine's own checks pass on it after the wire."""
    s = req.sampling
    assert isinstance(v, ValidatedRequest)
    assert v.request_id == req.request_id if req.request_id else re.fullmatch(r"[0-9a-f]{32}", v.request_id)
    assert v.priority == req.priority
    assert v.ttft_budget_ms == (req.ttft_budget_ms if req.HasField("ttft_budget_ms") else None)
    (given,) = given_inputs(req)
    ids = v.prompt_token_ids
    if given == "prompt":
        assert ids == tok.encode(req.prompt)
    elif given == "prompt_token_ids":
        assert ids == list(req.prompt_token_ids)
    else:
        assert ids == tok.encode_chat([{"role": m.role, "content": m.content} for m in req.messages])
    sp, defaults = v.sampling, SamplingParams()
    assert sp.max_tokens == (
        s.max_tokens if s.HasField("max_tokens") else default_max_tokens(len(ids), tok.max_model_len)
    )
    for name in ("temperature", "top_p", "top_k", "seed"):
        assert getattr(sp, name) == (getattr(s, name) if s.HasField(name) else getattr(defaults, name)), name
    assert (sp.stop, sp.stop_token_ids, sp.ignore_eos) == (tuple(s.stop), tuple(s.stop_token_ids), s.ignore_eos)
    # Stop strings stay with the router; everything else reaches the worker as it was accepted.
    on_worker = sampling_from_proto(pb.ResolvedSampling.FromString(sampling_to_proto(sp).SerializeToString()))
    assert on_worker == replace(sp, stop=())
    check_prompt_tokens(ids, vocab_size=tok.vocab_size, max_model_len=tok.max_model_len)
    check_sampling(on_worker, vocab_size=tok.vocab_size, prompt_len=len(ids), max_model_len=tok.max_model_len)


def check_validate(req: pb.GenerateRequest, tok: RouterTokenizer) -> str | None:
    """Either accepted (``check_accepted``), or refused naming a real field of this request."""
    try:
        v = check(req, tok)
    except InvalidRequest as e:
        note(f"rejected: {e}")
        event(f"refused: {re.sub(r'[0-9]+', 'i', e.field)}")
        m = FIELD_PATH.fullmatch(e.field)
        assert m, f"{e.field!r} is not a GenerateRequest field path"
        assert str(e).startswith(e.field + ": "), str(e)
        if m["msg"] is not None:
            assert int(m["msg"]) < len(req.messages)
        if m["stop"] is not None:
            assert int(m["stop"]) < len(req.sampling.stop)
        return e.field
    check_accepted(req, v, tok)
    event("accepted")
    return None


@fuzz(300)
@given(data=st.data())
def test_validate_accepts_what_is_well_formed_or_names_a_bad_field(tok, data):
    req, arbitrary = data.draw(generate_requests(tok.vocab_size, tok.max_model_len), label="request")
    field = check_validate(req, tok)
    if not arbitrary:
        assert field is None, f"a well-formed request was refused: {field}"


@fuzz(500)
@given(part=st.sampled_from(PARTS), data=st.data())
def test_validate_names_the_one_bad_part(tok, part, data):
    """A well-formed request with one part replaced by anything: refused naming that part, or
    accepted because the value is fine after all."""
    req, _ = data.draw(generate_requests(tok.vocab_size, tok.max_model_len, only=part), label="request")
    field = check_validate(req, tok)
    if field is not None:
        assert re.fullmatch(PART_FIELDS[part], field), f"{part} was corrupted but {field} was named"


def _valid_wire_request() -> bytes:
    req = build_request(
        "Hello there",
        request_id="r-1",
        priority=3,
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
    )
    req.ttft_budget_ms = 250.0
    return req.SerializeToString()


@st.composite
def wire_bytes(draw) -> bytes:
    """Bytes a client could send as a GenerateRequest: random, or a valid one with bytes flipped/cut/spliced."""
    base = bytearray(_valid_wire_request())
    how = draw(st.sampled_from(["random", "flip", "truncate", "splice"]))
    if how == "random":
        return draw(st.binary(max_size=300))
    if how == "flip":
        for _ in range(draw(st.integers(1, 6))):
            base[draw(st.integers(0, len(base) - 1))] = draw(st.integers(0, 255))
        return bytes(base)
    if how == "truncate":
        return bytes(base[: draw(st.integers(0, len(base)))])
    at = draw(st.integers(0, len(base)))
    return bytes(base[:at]) + draw(st.binary(max_size=40)) + bytes(base[at:])


@fuzz(200)
@given(raw=wire_bytes())
def test_validate_on_arbitrary_wire_bytes(tok, raw):
    """Whatever protobuf manages to parse, validate() handles; what it cannot parse it refuses
    with DecodeError (see test_grpc_refuses_invalid_utf8_as_invalid_argument for the gRPC status)."""
    try:
        req = pb.GenerateRequest.FromString(raw)
    except Exception as e:  # noqa: BLE001
        assert type(e).__name__ == "DecodeError", repr(e)
        return
    check_validate(req, tok)


def test_oversized_input_is_refused_before_tokenizing(tok):
    for req, name in (
        (build_request("x" * (MAX_PROMPT_CHARS + 1)), "prompt"),
        (build_request("🙂" * (MAX_PROMPT_CHARS + 1)), "prompt"),
        (build_request(messages=[{"role": "user", "content": "x" * 600_000}] * 2), "messages"),
        (build_request(messages=[U] * 100_000), "messages"),
    ):
        counting = CountingTokenizer(tok)
        with pytest.raises(InvalidRequest) as err:
            check(req, counting)
        assert err.value.field == name and counting.chars == 0


def test_validate_work_is_bounded_by_the_context(tok):
    """A prompt within every size limit but far past the context is refused after tokenizing a
    bounded prefix of it (was a bug: the whole megabyte was tokenized, seconds per request)."""
    for text in ("🙂" * MAX_PROMPT_CHARS, "word " * (MAX_PROMPT_CHARS // 5)):
        for req in (build_request(text), build_request(messages=[{"role": "user", "content": text}])):
            counting = CountingTokenizer(tok)
            with pytest.raises(InvalidRequest):
                check(req, counting)
            assert counting.chars <= BOUNDED_WORK, counting.chars


# =========================================================================================
# 2. A table of malformed public requests: each one is refused naming the field
# =========================================================================================


def _with(req: pb.GenerateRequest, **fields) -> pb.GenerateRequest:
    for name, value in fields.items():
        setattr(req, name, value)
    return req


V = 49152  # SmolLM2 vocabulary (checked in the test)
L = 8192  # its context
U = {"role": "user", "content": "hi"}
MALFORMED = [
    # request-level fields
    ("request_id too long", lambda: build_request("hi", request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id"),
    ("request_id 10k chars", lambda: build_request("hi", request_id="é" * 10_000), "request_id"),
    ("request_id newline", lambda: build_request("hi", request_id="a\nb"), "request_id"),
    ("request_id NUL", lambda: build_request("hi", request_id="\x00"), "request_id"),
    ("request_id zero-width space", lambda: build_request("hi", request_id="id\u200b"), "request_id"),
    ("request_id DEL", lambda: build_request("hi", request_id="id\x7f"), "request_id"),
    ("request_id bidi override", lambda: build_request("hi", request_id="\u202etxt.exe"), "request_id"),
    ("priority below range", lambda: build_request("hi", priority=PRIORITY_RANGE[0] - 1), "priority"),
    ("priority int32 max", lambda: build_request("hi", priority=INT32_MAX), "priority"),
    ("priority int32 min", lambda: build_request("hi", priority=INT32_MIN), "priority"),
    ("ttft_budget_ms zero", lambda: _with(build_request("hi"), ttft_budget_ms=0.0), "ttft_budget_ms"),
    ("ttft_budget_ms negative", lambda: _with(build_request("hi"), ttft_budget_ms=-5.0), "ttft_budget_ms"),
    ("ttft_budget_ms NaN", lambda: _with(build_request("hi"), ttft_budget_ms=math.nan), "ttft_budget_ms"),
    ("ttft_budget_ms inf", lambda: _with(build_request("hi"), ttft_budget_ms=math.inf), "ttft_budget_ms"),
    # inputs: missing, empty, conflicting, oversized
    ("no input at all", lambda: build_request(max_tokens=4), "prompt"),
    ("prompt set but empty", lambda: build_request(""), "prompt"),
    ("prompt over the char limit", lambda: build_request("x" * (MAX_PROMPT_CHARS + 1)), "prompt"),
    ("prompt emoji over the context", lambda: build_request("🙂" * 5_000), "prompt"),
    ("prompt NULs over the context", lambda: build_request("\x00" * 20_000), "prompt"),
    ("prompt and token ids", lambda: build_request("hi", prompt_token_ids=[1]), "prompt_token_ids"),
    ("empty prompt and token ids", lambda: build_request("", prompt_token_ids=[1]), "prompt_token_ids"),
    ("prompt and messages", lambda: build_request("hi", messages=[U]), "messages"),
    ("token ids and messages", lambda: build_request(prompt_token_ids=[1], messages=[U]), "messages"),
    ("all three inputs", lambda: build_request("hi", prompt_token_ids=[1], messages=[U]), "prompt_token_ids"),
    ("token id == vocab", lambda: build_request(prompt_token_ids=[1, V]), "prompt_token_ids"),
    ("token id int64 min", lambda: build_request(prompt_token_ids=[INT64_MIN]), "prompt_token_ids"),
    ("token id int64 max", lambda: build_request(prompt_token_ids=[INT64_MAX]), "prompt_token_ids"),
    ("token ids fill the context", lambda: build_request(prompt_token_ids=[1] * L), "prompt_token_ids"),
    ("token ids 100k", lambda: build_request(prompt_token_ids=[1] * 100_000), "prompt_token_ids"),
    # chat messages
    ("messages too many", lambda: build_request(messages=[U] * (MAX_MESSAGES + 1)), "messages"),
    (
        "messages all empty",
        lambda: build_request(messages=[{"role": "system", "content": ""}, {"role": "user", "content": ""}]),
        "messages",
    ),
    (
        "messages over the char limit",
        lambda: build_request(messages=[{"role": "user", "content": "x" * 600_000}] * 2),
        "messages",
    ),
    (
        "messages over the context",
        lambda: build_request(messages=[{"role": "user", "content": "word " * 9_000}]),
        "messages",
    ),
    ("role empty", lambda: build_request(messages=[{"role": "", "content": "hi"}]), "messages[0].role"),
    ("role capitalised", lambda: build_request(messages=[{"role": "User", "content": "hi"}]), "messages[0].role"),
    ("role padded", lambda: build_request(messages=[{"role": " user", "content": "hi"}]), "messages[0].role"),
    ("role developer", lambda: build_request(messages=[{"role": "developer", "content": "hi"}]), "messages[0].role"),
    ("role function", lambda: build_request(messages=[{"role": "function", "content": "hi"}]), "messages[0].role"),
    ("role with NUL", lambda: build_request(messages=[{"role": "user\x00", "content": "hi"}]), "messages[0].role"),
    (
        "third role unknown",
        lambda: build_request(messages=[{"role": "system", "content": "s"}, U, {"role": "bot", "content": "x"}]),
        "messages[2].role",
    ),
    # sampling
    ("max_tokens negative", lambda: build_request("hi", max_tokens=-1), "sampling.max_tokens"),
    ("max_tokens int64 min", lambda: build_request("hi", max_tokens=INT64_MIN), "sampling.max_tokens"),
    ("max_tokens int64 max", lambda: build_request("hi", max_tokens=INT64_MAX), "sampling.max_tokens"),
    ("max_tokens == context", lambda: build_request(prompt_token_ids=[1], max_tokens=L), "sampling.max_tokens"),
    (
        "max_tokens one past room",
        lambda: build_request(prompt_token_ids=[1] * (L - 1), max_tokens=2),
        "sampling.max_tokens",
    ),
    ("temperature NaN", lambda: build_request("hi", temperature=math.nan), "sampling.temperature"),
    ("temperature inf", lambda: build_request("hi", temperature=math.inf), "sampling.temperature"),
    (
        "temperature just above max",
        lambda: build_request("hi", temperature=math.nextafter(MAX_TEMPERATURE, math.inf)),
        "sampling.temperature",
    ),
    ("temperature tiny negative", lambda: build_request("hi", temperature=-5e-324), "sampling.temperature"),
    ("top_p NaN", lambda: build_request("hi", top_p=math.nan), "sampling.top_p"),
    ("top_p -inf", lambda: build_request("hi", top_p=-math.inf), "sampling.top_p"),
    ("top_p just above 1", lambda: build_request("hi", top_p=math.nextafter(1.0, 2.0)), "sampling.top_p"),
    ("top_k vocab + 1", lambda: build_request("hi", top_k=V + 1), "sampling.top_k"),
    ("top_k int64 min", lambda: build_request("hi", top_k=INT64_MIN), "sampling.top_k"),
    ("seed int64 min", lambda: build_request("hi", seed=INT64_MIN), "sampling.seed"),
    ("stop 10k strings", lambda: build_request("hi", stop=["x"] * 10_000), "sampling.stop"),
    ("stop 17 empty strings", lambda: build_request("hi", stop=[""] * 17), "sampling.stop"),
    ("stop second empty", lambda: build_request("hi", stop=["a", ""]), "sampling.stop[1]"),
    (
        "stop string too long",
        lambda: build_request("hi", stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]),
        "sampling.stop[1]",
    ),
    (
        "stop string too long in emoji",
        lambda: build_request("hi", stop=["🙂" * (MAX_STOP_STRING_CHARS + 1)]),
        "sampling.stop[0]",
    ),
    (
        "stop_token_ids too many",
        lambda: build_request("hi", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
        "sampling.stop_token_ids",
    ),
    (
        "stop_token_ids 100k",
        lambda: build_request("hi", stop_token_ids=list(range(100_000))),
        "sampling.stop_token_ids",
    ),
    ("stop_token_id negative", lambda: build_request("hi", stop_token_ids=[-1]), "sampling.stop_token_ids"),
    ("stop_token_id == vocab", lambda: build_request("hi", stop_token_ids=[5, V]), "sampling.stop_token_ids"),
    # several problems: the request-level one is named first, then inputs, then sampling
    ("bad request_id and no input", lambda: build_request(request_id="\n"), "request_id"),
    ("bad priority and bad temperature", lambda: build_request("hi", priority=1000, temperature=-1.0), "priority"),
    ("no input and bad max_tokens", lambda: build_request(max_tokens=0), "prompt"),
    (
        "bad role and bad top_p",
        lambda: build_request(messages=[{"role": "x", "content": "y"}], top_p=2.0),
        "messages[0].role",
    ),
]


def test_malformed_table_is_big_enough(tok):
    assert len(MALFORMED) >= 30 and len({case for case, _, _ in MALFORMED}) == len(MALFORMED)
    assert (tok.vocab_size, tok.max_model_len) == (V, L)


@pytest.mark.parametrize("build, field", [(b, f) for _, b, f in MALFORMED], ids=[c for c, _, _ in MALFORMED])
def test_malformed_request_names_the_field(tok, build, field):
    req = pb.GenerateRequest.FromString(build().SerializeToString())  # as it arrives over the wire
    counting = CountingTokenizer(tok)
    with pytest.raises(InvalidRequest) as err:
        check(req, counting)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(field + ": ")
    assert counting.chars <= BOUNDED_WORK, f"tokenized {counting.chars} characters to refuse it"


def test_protobuf_cannot_carry_lone_surrogates():
    """Encodings: a str with a lone surrogate cannot even be put into a request; invalid UTF-8
    on the wire fails to parse (the gRPC status for that is tested below)."""
    for bad in ("\ud800", "ok\udfff"):
        with pytest.raises(ValueError, match="^prompt: .*surrogates"):  # named by the client
            build_request(bad)
        with pytest.raises(ValueError, match="^sampling.stop: .*surrogates"):
            build_request("hi", stop=[bad])
    raw = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    with pytest.raises(Exception) as err:
        pb.GenerateRequest.FromString(raw)
    assert type(err.value).__name__ == "DecodeError"


def test_messages_without_a_chat_template_are_invalid_argument(tok):
    plain = copy.copy(tok)
    plain.has_chat_template = False
    with pytest.raises(InvalidRequest) as err:
        check(build_request(messages=[U]), plain)
    assert err.value.field == "messages"


async def _generate_status(tok: RouterTokenizer, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """Sends raw request bytes to an in-process Router service (real validation, no workers)."""
    server = grpc.aio.server()
    add_router_service(RouterService(Completions(tok, None, 5.0, max_inflight=1)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(
                "/pdserve.v1.Router/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            try:
                async for _ in call(raw, timeout=10):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            return grpc.StatusCode.OK, ""
    finally:
        await server.stop(None)


async def test_grpc_invalid_argument_for_a_malformed_request(tok):
    code, details = await _generate_status(tok, build_request("hi", stop=[""]).SerializeToString())
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sampling.stop[0]:")


async def test_grpc_refuses_invalid_utf8_as_invalid_argument(tok):
    raw = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    code, details = await _generate_status(tok, raw)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)


async def test_grpc_judges_a_prompt_by_its_length_before_its_ids(tok):
    ids = [10**7] * (tok.max_model_len + 10)  # too long, and every id outside the vocabulary
    code, details = await _generate_status(tok, pb.GenerateRequest(prompt_token_ids=ids).SerializeToString())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"prompt_token_ids: {len(ids)} tokens leave no room in the model's context of {tok.max_model_len}"
