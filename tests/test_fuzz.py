"""Property-based fuzzing (hypothesis) of the public request validation, the KV-transfer frame
decoder and handshake, and a live in-process KV server fed random byte streams.

Properties: bad input is refused with ``InvalidRequest`` naming a real field (public API) or
``ProtocolError``/``HandshakeError``/a dropped connection (KV transfer); nothing else is ever
raised, nothing hangs, no server thread dies, no grant completes from garbage, and every
reserved block is freed exactly once.

Runs on CPU in well under a minute with derandomized (reproducible) examples. Explore more:
``PDSERVE_FUZZ_RANDOM=1 PDSERVE_FUZZ_SCALE=10 pytest tests/test_fuzz.py``.

The cases labelled "was a bug" are regression tests for what this fuzzing found (handshakes
that killed a connection thread, a DONE that was not final, UNKNOWN instead of
INVALID_ARGUMENT, validation cost unbounded by the context).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import math
import operator
import os
import random
import re
import socket
import struct
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field, replace

import grpc
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from pdserve.client import build_request
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.sampling_params import MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.kvtransfer.grants import GrantLedger, GrantState
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, choose, host_id
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.protocol import (
    HEADER, HEADER_SIZE, MAGIC, MAX_CONTROL_PAYLOAD, VERSION, AckStatus, FrameHeader, FrameKind, ProtocolError,
)
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVConnection
from pdserve.router.completions import Completions
from pdserve.router.servicer import RouterService, add_router_service
from pdserve.router.tokenizer import CHAT_ROLES, RouterTokenizer
from pdserve.router.validation import (
    MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_REQUEST_ID_CHARS, MAX_TEMPERATURE, PRIORITY_RANGE, InvalidRequest,
    ValidatedRequest, validate,
)
from pdserve.v1 import pdserve_pb2 as pb

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX, UINT32_MAX = 2**64 - 1, 2**32 - 1

_RANDOM = os.environ.get("PDSERVE_FUZZ_RANDOM") == "1"
_SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))


def fuzz(max_examples: int, deadline_ms: float | None = None, **kw) -> settings:
    """Bounded, reproducible (unless PDSERVE_FUZZ_RANDOM=1), no example database on disk."""
    return settings(
        max_examples=max(1, int(max_examples * _SCALE)), deadline=deadline_ms, derandomize=not _RANDOM,
        database=None, print_blob=_RANDOM,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        **kw,
    )


@pytest.fixture(scope="module")
def tok(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


# =========================================================================================
# 1. Public API: GenerateRequest validation
# =========================================================================================

SPECIAL_STRINGS = [
    "", " ", "\x00", "\n", "\r\n", "\t", "\x7f", "\x1b[31m", "\u200b", "\ufeff", "\u202e", "\ufffd", "\U0010ffff",
    "\U000e0001", "a\u0301\u0301\u0301", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n",
    "{{ raise_exception('boom') }}", "{% for m in messages %}", "\\u0000", "%s%n%x", "🙂", "\ud7ff", "\ue000",
    "user", "x" * MAX_STOP_STRING_CHARS, "x" * (MAX_STOP_STRING_CHARS + 1),
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
    st.sampled_from([0.0, -0.0, 1.0, 100.0, math.nextafter(100.0, math.inf), 5e-324, -5e-324,
                     math.nextafter(1.0, 2.0), math.nan, math.inf, -math.inf, 1e308]),
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
    printable = st.text(st.characters(categories=["L", "M", "N", "P", "S"], include_characters=" "), max_size=MAX_REQUEST_ID_CHARS)
    role = edges_or(["", "User", "USER", " user", "user ", "bot", "developer", "function", "ipython", "system\x00", "usér"],
                    st.sampled_from(CHAT_ROLES), st.text(max_size=12))
    message = st.tuples(role, st.one_of(odd_text(), huge_text(8_000)))
    short_message = st.tuples(role, odd_text())  # 512 long ones would be up to 1M chars: seconds of tokenizing (see the report)
    good_message = st.tuples(st.sampled_from(CHAT_ROLES), odd_text(100))
    nextup, nextdown = (lambda x: math.nextafter(x, math.inf)), (lambda x: math.nextafter(x, -math.inf))
    return {
        "request_id": (edges_or(["", "x" * MAX_REQUEST_ID_CHARS, " ", "é" * MAX_REQUEST_ID_CHARS], printable),
                       edges_or(["x" * (MAX_REQUEST_ID_CHARS + 1), "é" * 10_000, "a\nb", "\x00", "id\u200b", "\u00a0", "\x7f", "\u2028"],
                                odd_text(200), st.text(st.characters(codec="ascii"), min_size=100, max_size=400))),
        "priority": (edges_or([lo, hi, 0], st.integers(lo, hi)),
                     edges_or([lo - 1, hi + 1, INT32_MIN, INT32_MAX], st.integers(INT32_MIN, INT32_MAX))),
        "ttft_budget_ms": (edges_or([None, 5e-324, 1e308], st.floats(min_value=0, exclude_min=True, allow_infinity=False)),
                           edges_or([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf], ANY_FLOAT)),
        "inputs": (st.sampled_from(["prompt", "prompt_token_ids", "messages"]),
                   st.sampled_from(["prompt", "prompt_token_ids", "messages"] * 2 + ["none", "prompt+prompt_token_ids",
                                                                                     "prompt+messages", "prompt_token_ids+messages", "all"])),
        # Well-formed prompts hold a letter (the tokenizer drops some characters, e.g. "\x06", entirely)
        # and leave room for 64 new tokens (the most a well-formed max_tokens asks).
        "prompt": (st.one_of(odd_text(200), huge_text(1_500)).map(lambda t: "x" + t) | st.just("🙂" * ((n - 65) // 2)),
                   edges_or(["", "x" * (MAX_PROMPT_CHARS + 1), "word " * (n + 10), "🙂" * (n // 2), "\x00" * n],
                            odd_text(), huge_text(12_000))),
        "prompt_token_ids": (st.one_of(st.lists(st.integers(0, v - 1), min_size=1, max_size=300),
                                       repeated(st.integers(0, v - 1), n - 300, n - 65)),
                             edges_or([[v], [-1], [INT64_MIN], [INT64_MAX], [0] * n, [1] * (n + 1), [v - 1, v]],
                                      st.lists(token_id, min_size=1, max_size=40), repeated(token_id, 1, 20_000))),
        "messages": (st.builds(lambda some, rest: [*rest[: len(rest) // 2], some, *rest[len(rest) // 2:]],
                               st.tuples(st.sampled_from(CHAT_ROLES), odd_text(100).filter(bool)), st.lists(good_message, max_size=5)),
                     edges_or([[("user", "")], [("system", ""), ("user", "")], [("user", "x")] * (MAX_MESSAGES + 1),
                               [("user", "x" * (MAX_PROMPT_CHARS // 2 + 1))] * 2, [("user", "word " * n)], [("wizard", "x")],
                               [("user", "x"), ("User", "y")]],
                              st.lists(message, min_size=1, max_size=6), repeated(short_message, MAX_MESSAGES - 1, MAX_MESSAGES + 1))),
        "max_tokens": (edges_or([None, 1], st.none() | st.integers(1, 64)),
                       edges_or([0, -1, n - 1, n, n + 1, INT64_MIN, INT64_MAX], st.none() | ANY_INT64)),
        "temperature": (edges_or([None, 0.0, -0.0, MAX_TEMPERATURE], st.floats(0, MAX_TEMPERATURE)),
                        edges_or([nextup(MAX_TEMPERATURE), -5e-324, math.nan, math.inf, -math.inf], st.none() | ANY_FLOAT)),
        "top_p": (edges_or([None, 5e-324, 1.0], st.floats(0, 1, exclude_min=True)),
                  edges_or([0.0, -0.0, nextup(1.0), nextdown(0.0), math.nan, math.inf, -1.0], st.none() | ANY_FLOAT)),
        "top_k": (edges_or([None, 0, v], st.integers(0, v)),
                  edges_or([-1, v + 1, INT64_MIN, INT64_MAX], st.none() | ANY_INT64)),
        "seed": (edges_or([None, 0, MAX_SEED], st.integers(0, MAX_SEED)),
                 edges_or([-1, INT64_MIN], st.none() | ANY_INT64)),
        "stop": (edges_or([[], ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, ["🙂" * MAX_STOP_STRING_CHARS]],
                          st.lists(odd_text(MAX_STOP_STRING_CHARS).filter(lambda x: 0 < len(x) <= MAX_STOP_STRING_CHARS), max_size=MAX_STOP_STRINGS)),
                 edges_or([[""], ["a", ""], ["x" * (MAX_STOP_STRING_CHARS + 1)], ["🙂" * (MAX_STOP_STRING_CHARS + 1)],
                           ["a"] * (MAX_STOP_STRINGS + 1), [""] * 10_000],
                          st.lists(odd_text(300), max_size=20), repeated(st.sampled_from(["a", "", "x" * 257]), 15, 5_000))),
        "stop_token_ids": (edges_or([[], [0] * MAX_STOP_TOKEN_IDS, [v - 1]], st.lists(st.integers(0, v - 1), max_size=MAX_STOP_TOKEN_IDS)),
                           edges_or([[-1], [v], [0] * (MAX_STOP_TOKEN_IDS + 1), [INT64_MIN], list(range(100_000))],
                                    st.lists(token_id, max_size=70), repeated(token_id, 60, 20_000))),
    }


INPUTS = ["prompt", "prompt_token_ids", "messages"]
PARTS = ["request_id", "priority", "ttft_budget_ms", "inputs", *INPUTS, "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
         "stop_token_ids"]
WHICH_ARBITRARY = st.one_of(st.just(frozenset()), st.sampled_from(PARTS).map(lambda p: {p}), st.sets(st.sampled_from(PARTS)))
PART_FIELDS = {
    "request_id": r"request_id", "priority": r"priority", "ttft_budget_ms": r"ttft_budget_ms",
    # A long prompt may leave no room for max_tokens.
    "inputs": r"prompt|prompt_token_ids|messages|messages\[\d+\]\.role|sampling\.max_tokens",
    "prompt": r"prompt|sampling\.max_tokens", "prompt_token_ids": r"prompt_token_ids|sampling\.max_tokens",
    "messages": r"messages|messages\[\d+\]\.role|sampling\.max_tokens",
    "max_tokens": r"sampling\.max_tokens", "temperature": r"sampling\.temperature", "top_p": r"sampling\.top_p",
    "top_k": r"sampling\.top_k", "seed": r"sampling\.seed", "stop": r"sampling\.stop(\[\d+\])?",
    "stop_token_ids": r"sampling\.stop_token_ids",
}


@st.composite
def generate_requests(draw, vocab: int, max_len: int, only: str | None = None) -> pb.GenerateRequest:
    """A GenerateRequest where each part is either well formed or arbitrary: a mix of valid
    requests, requests with one or a few bad parts, and chaos (``only``: just that part arbitrary)."""
    parts = request_parts(vocab, max_len)
    arbitrary = {only} if only else draw(WHICH_ARBITRARY, label="arbitrary parts")

    def pick(name: str):
        good, anything = parts[name]
        return draw(anything if name in arbitrary else good, label=name)

    bad_input = next((name for name in INPUTS if name in arbitrary), None)
    inputs = bad_input if bad_input and "inputs" not in arbitrary else pick("inputs")
    given = INPUTS if inputs == "all" else inputs.split("+")
    values = {name: draw(parts[name][name in arbitrary or "inputs" in arbitrary], label=name) if name in given else None for name in INPUTS}
    sampling = {name: pick(name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")}
    req = build_request(values["prompt"], prompt_token_ids=values["prompt_token_ids"],
                        messages=[{"role": r, "content": c} for r, c in values["messages"] or []],
                        request_id=pick("request_id"), priority=pick("priority"), ignore_eos=draw(st.booleans()), **sampling)
    ttft = pick("ttft_budget_ms")
    if ttft is not None:
        req.ttft_budget_ms = ttft
    # What the router sees is what came over the wire.
    return pb.GenerateRequest.FromString(req.SerializeToString())


FIELD_PATH = re.compile(
    r"(request_id|priority|ttft_budget_ms|prompt|prompt_token_ids|messages|messages\[(?P<msg>\d+)\]\.role"
    r"|sampling\.(max_tokens|temperature|top_p|top_k|seed|stop|stop_token_ids)|sampling\.stop\[(?P<stop>\d+)\])"
)


def given_inputs(req: pb.GenerateRequest) -> list[str]:
    return [name for name, present in (("prompt", req.HasField("prompt")), ("prompt_token_ids", len(req.prompt_token_ids) > 0),
                                       ("messages", len(req.messages) > 0)) if present]


def reference_ids(req: pb.GenerateRequest, tok: RouterTokenizer) -> list[int] | None:
    """The prompt's token ids, straight from the tokenizer; None when the input itself is malformed."""
    given = given_inputs(req)
    if len(given) != 1:
        return None
    if given == ["prompt"]:
        if not req.prompt or len(req.prompt) > MAX_PROMPT_CHARS:
            return None
        return tok.encode(req.prompt)
    if given == ["prompt_token_ids"]:
        ids = list(req.prompt_token_ids)
        return ids if all(0 <= t < tok.vocab_size for t in ids) else None
    msgs = req.messages
    if (len(msgs) > MAX_MESSAGES or any(m.role not in CHAT_ROLES for m in msgs)
            or sum(len(m.content) for m in msgs) > MAX_PROMPT_CHARS or not any(m.content for m in msgs)):
        return None
    return tok.encode_chat([{"role": m.role, "content": m.content} for m in msgs])


def field_is_bad(req: pb.GenerateRequest, name: str, tok: RouterTokenizer) -> bool:
    """An oracle independent of validate(): does ``name`` really break a documented rule?"""
    s, vocab, max_len = req.sampling, tok.vocab_size, tok.max_model_len
    given = given_inputs(req)
    if name == "request_id":
        return len(req.request_id) > MAX_REQUEST_ID_CHARS or not req.request_id.isprintable()
    if name == "priority":
        return not PRIORITY_RANGE[0] <= req.priority <= PRIORITY_RANGE[1]
    if name == "ttft_budget_ms":
        return req.HasField("ttft_budget_ms") and not (math.isfinite(req.ttft_budget_ms) and req.ttft_budget_ms > 0)
    if name in ("prompt", "prompt_token_ids", "messages"):
        if name == "prompt" and not given:
            return True
        if name in given and len(given) > 1:
            return True  # conflicting inputs
        if given != [name]:
            return False
        if name == "messages":
            msgs = req.messages
            if len(msgs) > MAX_MESSAGES or sum(len(m.content) for m in msgs) > MAX_PROMPT_CHARS or not any(m.content for m in msgs):
                return True
        ids = reference_ids(req, tok)
        return ids is None or not 0 < len(ids) < max_len
    if m := re.fullmatch(r"messages\[(\d+)\]\.role", name):
        i = int(m[1])
        return i < len(req.messages) and req.messages[i].role not in CHAT_ROLES
    if name == "sampling.max_tokens":
        if not s.HasField("max_tokens"):
            return False
        ids = reference_ids(req, tok)
        return s.max_tokens < 1 or (ids is not None and s.max_tokens > max_len - len(ids))
    if name == "sampling.temperature":
        return s.HasField("temperature") and not 0 <= s.temperature <= MAX_TEMPERATURE
    if name == "sampling.top_p":
        return s.HasField("top_p") and not 0 < s.top_p <= 1
    if name == "sampling.top_k":
        return s.HasField("top_k") and not 0 <= s.top_k <= vocab
    if name == "sampling.seed":
        return s.HasField("seed") and not 0 <= s.seed <= MAX_SEED
    if name == "sampling.stop":
        return len(s.stop) > MAX_STOP_STRINGS
    if m := re.fullmatch(r"sampling\.stop\[(\d+)\]", name):
        i = int(m[1])
        return i < len(s.stop) and not 0 < len(s.stop[i]) <= MAX_STOP_STRING_CHARS
    if name == "sampling.stop_token_ids":
        return len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in s.stop_token_ids)
    raise AssertionError(f"unknown field path {name!r}")


def check_accepted(req: pb.GenerateRequest, v: ValidatedRequest, tok: RouterTokenizer) -> None:
    vocab, max_len, s = tok.vocab_size, tok.max_model_len, req.sampling
    assert isinstance(v, ValidatedRequest)
    assert v.request_id == req.request_id if req.request_id else re.fullmatch(r"[0-9a-f]{32}", v.request_id)
    assert len(v.request_id) <= MAX_REQUEST_ID_CHARS and v.request_id.isprintable()
    assert PRIORITY_RANGE[0] <= v.priority <= PRIORITY_RANGE[1] and v.priority == req.priority
    if req.HasField("ttft_budget_ms"):
        assert v.ttft_budget_ms == req.ttft_budget_ms and math.isfinite(v.ttft_budget_ms) and v.ttft_budget_ms > 0
    else:
        assert v.ttft_budget_ms is None
    assert len(given_inputs(req)) == 1, given_inputs(req)
    ids = v.prompt_token_ids
    assert 1 <= len(ids) < max_len and all(0 <= t < vocab for t in ids)
    assert ids == reference_ids(req, tok)
    sp = v.sampling
    assert 1 <= sp.max_tokens and len(ids) + sp.max_tokens <= max_len
    assert sp.max_tokens == (s.max_tokens if s.HasField("max_tokens") else min(256, max_len - len(ids)))
    assert 0 <= sp.temperature <= MAX_TEMPERATURE and sp.temperature == (s.temperature if s.HasField("temperature") else 1.0)
    assert 0 < sp.top_p <= 1 and sp.top_p == (s.top_p if s.HasField("top_p") else 1.0)
    assert 0 <= sp.top_k <= vocab and sp.top_k == (s.top_k if s.HasField("top_k") else 0)
    assert sp.seed == (s.seed if s.HasField("seed") else None) and (sp.seed is None or 0 <= sp.seed <= MAX_SEED)
    assert sp.stop == tuple(s.stop) and len(sp.stop) <= MAX_STOP_STRINGS and all(0 < len(x) <= MAX_STOP_STRING_CHARS for x in sp.stop)
    assert sp.stop_token_ids == tuple(s.stop_token_ids) and len(sp.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(0 <= t < vocab for t in sp.stop_token_ids) and sp.ignore_eos == s.ignore_eos


def check_validate(req: pb.GenerateRequest, tok: RouterTokenizer) -> str | None:
    """validate() either accepts with every invariant holding, or names a field that really is bad."""
    try:
        v = validate(req, tok)
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
        assert field_is_bad(req, e.field, tok), f"{e.field} was refused ({e}) but breaks no rule"
        return e.field
    check_accepted(req, v, tok)
    event("accepted")
    return None


@fuzz(300, deadline_ms=2000)
@given(data=st.data())
def test_validate_accepts_or_names_a_bad_field(tok, data):
    req = data.draw(generate_requests(tok.vocab_size, tok.max_model_len), label="request")
    check_validate(req, tok)


@fuzz(500, deadline_ms=2000)
@given(part=st.sampled_from(PARTS), data=st.data())
def test_validate_names_the_one_bad_part(tok, part, data):
    """A well-formed request with one part replaced by anything: refused naming that part, or
    accepted because the value is fine after all."""
    req = data.draw(generate_requests(tok.vocab_size, tok.max_model_len, only=part), label="request")
    field = check_validate(req, tok)
    if field is not None:
        assert re.fullmatch(PART_FIELDS[part], field), f"{part} was corrupted but {field} was named"


def _valid_wire_request() -> bytes:
    req = build_request("Hello there", request_id="r-1", priority=3, max_tokens=8, temperature=0.5, top_p=0.9, top_k=40,
                        seed=7, stop=["\n", "END"], stop_token_ids=[2], ignore_eos=True)
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


@fuzz(200, deadline_ms=2000)
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
    for req, name in ((build_request("x" * (MAX_PROMPT_CHARS + 1)), "prompt"), (build_request("🙂" * (MAX_PROMPT_CHARS + 1)), "prompt"),
                      (build_request(messages=[{"role": "user", "content": "x" * 600_000}] * 2), "messages"),
                      (build_request(messages=[U] * 100_000), "messages")):
        started = time.perf_counter()
        with pytest.raises(InvalidRequest) as err:
            validate(req, tok)
        assert err.value.field == name and time.perf_counter() - started < 0.5


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def test_validate_work_is_bounded_by_the_context(tok):
    def refuse(req: pb.GenerateRequest) -> None:
        with pytest.raises(InvalidRequest):
            validate(req, tok)

    just_over = build_request("🙂" * (tok.max_model_len // 2 + 1))  # 2 tokens each: just past the context
    far_over = build_request("🙂" * MAX_PROMPT_CHARS)  # within every size limit
    small = min(_seconds(lambda: refuse(just_over)) for _ in range(3))
    assert _seconds(lambda: refuse(far_over)) < 20 * small + 0.25


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
    ("messages all empty", lambda: build_request(messages=[{"role": "system", "content": ""}, {"role": "user", "content": ""}]), "messages"),
    ("messages over the char limit", lambda: build_request(messages=[{"role": "user", "content": "x" * 600_000}] * 2), "messages"),
    ("messages over the context", lambda: build_request(messages=[{"role": "user", "content": "word " * 9_000}]), "messages"),
    ("role empty", lambda: build_request(messages=[{"role": "", "content": "hi"}]), "messages[0].role"),
    ("role capitalised", lambda: build_request(messages=[{"role": "User", "content": "hi"}]), "messages[0].role"),
    ("role padded", lambda: build_request(messages=[{"role": " user", "content": "hi"}]), "messages[0].role"),
    ("role developer", lambda: build_request(messages=[{"role": "developer", "content": "hi"}]), "messages[0].role"),
    ("role function", lambda: build_request(messages=[{"role": "function", "content": "hi"}]), "messages[0].role"),
    ("role with NUL", lambda: build_request(messages=[{"role": "user\x00", "content": "hi"}]), "messages[0].role"),
    ("third role unknown", lambda: build_request(messages=[{"role": "system", "content": "s"}, U, {"role": "bot", "content": "x"}]),
     "messages[2].role"),
    # sampling
    ("max_tokens negative", lambda: build_request("hi", max_tokens=-1), "sampling.max_tokens"),
    ("max_tokens int64 min", lambda: build_request("hi", max_tokens=INT64_MIN), "sampling.max_tokens"),
    ("max_tokens int64 max", lambda: build_request("hi", max_tokens=INT64_MAX), "sampling.max_tokens"),
    ("max_tokens == context", lambda: build_request(prompt_token_ids=[1], max_tokens=L), "sampling.max_tokens"),
    ("max_tokens one past room", lambda: build_request(prompt_token_ids=[1] * (L - 1), max_tokens=2), "sampling.max_tokens"),
    ("temperature NaN", lambda: build_request("hi", temperature=math.nan), "sampling.temperature"),
    ("temperature inf", lambda: build_request("hi", temperature=math.inf), "sampling.temperature"),
    ("temperature just above max", lambda: build_request("hi", temperature=math.nextafter(MAX_TEMPERATURE, math.inf)), "sampling.temperature"),
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
    ("stop string too long", lambda: build_request("hi", stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]), "sampling.stop[1]"),
    ("stop string too long in emoji", lambda: build_request("hi", stop=["🙂" * (MAX_STOP_STRING_CHARS + 1)]), "sampling.stop[0]"),
    ("stop_token_ids too many", lambda: build_request("hi", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "sampling.stop_token_ids"),
    ("stop_token_ids 100k", lambda: build_request("hi", stop_token_ids=list(range(100_000))), "sampling.stop_token_ids"),
    ("stop_token_id negative", lambda: build_request("hi", stop_token_ids=[-1]), "sampling.stop_token_ids"),
    ("stop_token_id == vocab", lambda: build_request("hi", stop_token_ids=[5, V]), "sampling.stop_token_ids"),
    # several problems: the request-level one is named first, then inputs, then sampling
    ("bad request_id and no input", lambda: build_request(request_id="\n"), "request_id"),
    ("bad priority and bad temperature", lambda: build_request("hi", priority=1000, temperature=-1.0), "priority"),
    ("no input and bad max_tokens", lambda: build_request(max_tokens=0), "prompt"),
    ("bad role and bad top_p", lambda: build_request(messages=[{"role": "x", "content": "y"}], top_p=2.0), "messages[0].role"),
]


def test_malformed_table_is_big_enough(tok):
    assert len(MALFORMED) >= 30 and len({case for case, _, _ in MALFORMED}) == len(MALFORMED)
    assert (tok.vocab_size, tok.max_model_len) == (V, L)


@pytest.mark.parametrize("build, field", [(b, f) for _, b, f in MALFORMED], ids=[c for c, _, _ in MALFORMED])
def test_malformed_request_names_the_field(tok, build, field):
    req = pb.GenerateRequest.FromString(build().SerializeToString())  # as it arrives over the wire
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as err:
        validate(req, tok)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(field + ": ")
    assert field_is_bad(req, field, tok)
    assert time.perf_counter() - started < 5.0


def test_protobuf_cannot_carry_lone_surrogates():
    """Encodings: a str with a lone surrogate cannot even be put into a request; invalid UTF-8
    on the wire fails to parse (the gRPC status for that is tested below)."""
    for bad in ("\ud800", "ok\udfff"):
        with pytest.raises(UnicodeEncodeError):
            build_request(bad)
        with pytest.raises(UnicodeEncodeError):
            build_request("hi", stop=[bad])
    raw = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    with pytest.raises(Exception) as err:
        pb.GenerateRequest.FromString(raw)
    assert type(err.value).__name__ == "DecodeError"


def test_messages_without_a_chat_template_are_invalid_argument(tok):
    plain = copy.copy(tok)
    plain.has_chat_template = False
    with pytest.raises(InvalidRequest) as err:
        validate(build_request(messages=[U]), plain)
    assert err.value.field == "messages"


async def _generate_status(tok: RouterTokenizer, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """Sends raw request bytes to an in-process Router service (real validation, no workers)."""
    server = grpc.aio.server()
    add_router_service(RouterService(Completions(tok, None, 5.0)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/pdserve.v1.Router/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
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


# =========================================================================================
# 3. KV-transfer frame decoder
# =========================================================================================

KIND_VALUES = [int(k) for k in FrameKind]
_PAYLOAD_LEN_AT = struct.calcsize("<4sBBHQIIIq")


@st.composite
def header_blobs(draw) -> bytes:
    """52-byte blobs that often get past the magic and version checks."""
    magic = draw(st.just(MAGIC) | st.binary(min_size=4, max_size=4))
    version = draw(st.just(VERSION) | st.integers(0, 255))
    kind = draw(st.sampled_from(KIND_VALUES) | st.integers(0, 255))
    blob = bytearray(magic + bytes([version, kind]) + draw(st.binary(min_size=HEADER_SIZE - 6, max_size=HEADER_SIZE - 6)))
    plen = draw(st.none() | st.sampled_from([0, 1, MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1, 2**63, UINT64_MAX]))
    if plen is not None:
        blob[_PAYLOAD_LEN_AT:_PAYLOAD_LEN_AT + 8] = plen.to_bytes(8, "little")
    return bytes(blob)


@fuzz(500)
@given(blob=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE) | header_blobs())
def test_frame_decoder_returns_a_header_or_protocol_error(blob):
    magic, version, kind, flags, tid, layer, start, end, aux, plen, csum = HEADER.unpack(blob)
    acceptable = (magic == MAGIC and version == VERSION and kind in KIND_VALUES
                  and (kind == FrameKind.DATA or plen <= MAX_CONTROL_PAYLOAD))
    try:
        h = FrameHeader.unpack(blob)
    except ProtocolError:
        assert not acceptable
        return
    assert acceptable
    assert isinstance(h.kind, FrameKind) and h.pack() == blob
    assert (h.kind, h.flags, h.transfer_id, h.layer, h.start, h.end, h.aux, h.payload_len, h.checksum) == (
        kind, flags, tid, layer, start, end, aux, plen, csum)


@st.composite
def valid_headers(draw) -> FrameHeader:
    kind = draw(st.sampled_from(FrameKind))
    u32 = st.integers(0, UINT32_MAX)
    return FrameHeader(
        kind, draw(st.integers(0, UINT64_MAX)), draw(u32), draw(u32), draw(u32), draw(st.integers(INT64_MIN, INT64_MAX)),
        draw(st.integers(0, UINT64_MAX if kind is FrameKind.DATA else MAX_CONTROL_PAYLOAD)), draw(st.integers(0, UINT64_MAX)),
        draw(st.integers(0, 2**16 - 1)),
    )


@fuzz(200)
@given(h=valid_headers())
def test_frame_header_round_trip(h):
    blob = h.pack()
    assert len(blob) == HEADER_SIZE and blob[:4] == MAGIC
    assert FrameHeader.unpack(blob) == h
    assert FrameHeader.unpack(memoryview(bytearray(blob))) == h


# =========================================================================================
# 4. KV-transfer handshake: PeerInfo.from_json, check_compatible, negotiation, credentials
# =========================================================================================

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 3, 2, 8, 8, 32
TOKEN_BYTES = 2 * HEADS * DIM * 4
MAX_PAYLOAD = NUM_BLOCKS * BLOCK * TOKEN_BYTES


def peer_dict(**changes) -> dict:
    base = dict(model_fingerprint="fuzz", dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                block_size=BLOCK, transports=["tcp"], host_id=host_id(), role="prefill", extra={}, token_bytes=TOKEN_BYTES)
    return {**base, **changes}


DECODE_INFO = PeerInfo(**{**peer_dict(role="decode"), "transports": ("tcp",)})

json_scalars = st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=8)
PEER_FIELDS = list(peer_dict())


CHANGED_FIELDS = st.sets(st.sampled_from(PEER_FIELDS))
DROP_OR_RETYPE = st.sampled_from(["drop", "retype"])
SAFE_TRANSPORTS = st.lists(st.text(max_size=8), max_size=4) | st.text(max_size=8) | st.none() | st.integers()
ADDED_FIELDS = st.dictionaries(st.text(max_size=12), json_values, max_size=2)


@st.composite
def peer_json_objects(draw, known_bug_free: bool = False) -> dict:
    """JSON objects shaped like a PeerInfo, with fields dropped, retyped or added."""
    obj = peer_dict()
    for name in draw(CHANGED_FIELDS, label="changed"):
        if draw(DROP_OR_RETYPE) == "drop":
            obj.pop(name)
        elif known_bug_free and name == "transports":
            obj[name] = draw(SAFE_TRANSPORTS)
        else:
            obj[name] = draw(json_values)
    obj.update(draw(ADDED_FIELDS, label="added"))
    return obj


def encodings() -> st.SearchStrategy[str]:
    return st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-16-le"])  # json.loads detects each from the first bytes


@fuzz(200)
@given(obj=peer_json_objects(), encoding=encodings())
def test_peer_info_from_any_json_object(obj, encoding):
    data = json.dumps(obj).encode(encoding)
    try:
        info = PeerInfo.from_json(data)
    except HandshakeError:
        return
    assert set(obj) <= set(PEER_FIELDS)
    for name, value in obj.items():
        got = getattr(info, name)
        assert got == (tuple(value) if name == "transports" else value)


@fuzz(300)
@given(data=st.binary(max_size=200) | st.builds(lambda b: b"{" + b, st.binary(max_size=100)))
def test_peer_info_from_random_bytes(data):
    try:
        PeerInfo.from_json(data)
    except HandshakeError:
        pass


@pytest.mark.parametrize("data", [b"0", b"null", b'"peer"', b"[]", b"true", b"[" * 100_000, b'{"a":' * 50_000],
                         ids=["number", "null", "string", "array", "true", "deep-array", "deep-object"])
def test_peer_info_from_json_non_object_is_a_handshake_error(data):
    with pytest.raises(HandshakeError):
        PeerInfo.from_json(data)


@fuzz(200)
@given(obj=peer_json_objects())
def test_check_compatible_negotiation_and_auth_raise_only_handshake_error(obj):
    try:
        remote = PeerInfo.from_json(json.dumps({**peer_dict(), **obj}).encode("utf-8", "surrogatepass"))
    except HandshakeError:
        return
    for local, other in ((DECODE_INFO, remote), (remote, DECODE_INFO)):
        try:
            local.check_compatible(other)
        except HandshakeError as e:
            assert str(e).startswith("KV layout mismatch: ")
        else:
            for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim"):
                assert getattr(local, name) == getattr(other, name)
    try:
        assert choose(DECODE_INFO, remote) == "tcp"
    except HandshakeError as e:
        assert "tcp" not in remote.transports and str(e).startswith("no common KV transport")


MALFORMED_HANDSHAKES = [
    pytest.param(peer_dict(transports=[1]), "was a bug: kvtransfer/negotiate.py:73-75 choose(): ', '.join(remote.transports) raises "
                 "TypeError when the peer lists a non-string transport", id="transports-int"),
    pytest.param(peer_dict(transports=[None, "shm"]), "same as transports-int", id="transports-null"),
    pytest.param(peer_dict(auth_token=5), "was a bug: kvtransfer/server.py:38 check_auth(): peer.auth_token.encode() raises "
                 "AttributeError for a non-string credential", id="auth-token-int"),
    pytest.param(peer_dict(auth_token=None), "same as auth-token-int", id="auth-token-null"),
    pytest.param(peer_dict(auth_token="\ud800"), "was a bug: kvtransfer/server.py:38 check_auth(): a JSON credential holding a lone "
                 "surrogate ('\\ud800') raises UnicodeEncodeError in .encode()", id="auth-token-surrogate"),
]


@pytest.mark.parametrize("obj, why", MALFORMED_HANDSHAKES)
def test_malformed_handshakes_raise_only_handshake_error(obj, why):
    with pytest.raises(HandshakeError):
        remote = PeerInfo.from_json(json.dumps(obj).encode())
        DECODE_INFO.check_compatible(remote)
        choose(DECODE_INFO, replace(remote, host_id="elsewhere", transports=remote.transports or ("x",)))
        raise AssertionError("accepted")


# =========================================================================================
# 5. A live decode side (receiver + KVServer over loopback) fed random streams
# =========================================================================================

class LoopThread:
    """The decode worker's event loop, running in a thread the test drives from outside."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def call(self, fn, *args, timeout: float = 10.0):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def wait(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class DecodeSide:
    """A decode worker's KV side with a 32-block cache and a block ledger that catches double
    frees and frees of blocks that were never reserved (each grant's report frees its blocks:
    there is no engine to take them)."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        layout = KVLayout(LAYERS, HEADS, DIM, BLOCK, torch.float32)
        self.tensor = torch.zeros(layout.shape(NUM_BLOCKS))
        self.cache = KVCacheView(list(self.tensor.unbind(0)), BLOCK, TOKEN_BYTES)
        self.lock = threading.Lock()
        self.free = set(range(NUM_BLOCKS))
        self.reserved: set[int] = set()
        self.ledger_errors: list[str] = []
        self.outcomes: dict[int, object] = {}
        self.receiver = GrantLedger(LAYERS, TOKEN_BYTES, lease_s=30.0, quarantine_s=0.01)
        self.server = KVReceiver(self.receiver, self.cache, DECODE_INFO, "127.0.0.1", 0)
        self.server.start()
        self.address = ("127.0.0.1", self.server.port)
        # A prefill side for the "still serving" check: 16-token blocks (re-blocking), random K/V.
        gen = torch.Generator().manual_seed(0)
        self.src = KVCacheView(list(torch.randn(LAYERS, 4, 16, 2, HEADS, DIM, generator=gen).unbind(0)), 16, TOKEN_BYTES)

    def _free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            for b in block_ids:
                if b not in self.reserved:
                    self.ledger_errors.append(f"block {b} freed but not reserved (double free?)")
                self.reserved.discard(b)
                self.free.add(b)

    def grant(self, num_tokens: int, rng: random.Random, lease_s: float | None = None):
        with self.lock:
            blocks = rng.sample(sorted(self.free), -(-num_tokens // BLOCK))
            self.free -= set(blocks)
            self.reserved |= set(blocks)

        def report(outcome, blocks=blocks) -> None:
            self.outcomes[id(blocks)] = outcome
            self._free_blocks(blocks)

        tid = self.receiver.grant(blocks, num_tokens, 0, report, lease_s=lease_s)
        grant = self.receiver.lookup(tid)
        grant.report_key = id(blocks)
        return grant

    def settle(self, grants) -> None:
        """Ends every grant (failed, expired or complete: each reports once and frees its
        blocks) and waits until every reserved block is back."""
        self.receiver.reap_expired()
        for g in grants:
            self.receiver.fail(g, "fuzz example over")
        deadline = time.monotonic() + 5
        while (self.receiver.num_active or self.reserved) and time.monotonic() < deadline:
            time.sleep(0.005)

    def still_serving(self, rng: random.Random) -> None:
        """A fresh, valid handshake and a full transfer into a fresh grant succeed."""
        n = rng.randint(1, 64)
        grant = self.grant(n, rng)
        src_blocks = rng.sample(range(4), -(-n // 16))
        info = PeerInfo(**{**peer_dict(), "transports": ("tcp",)})
        conn = KVConnection(f"127.0.0.1:{self.server.port}", info, self.src, connect_timeout=5.0)
        try:
            out = conn.open(grant.transfer_id, grant.block_ids, BLOCK, n)
            cut = rng.randint(1, n)
            for start, end in ((0, cut), (cut, n)):
                for layer in range(LAYERS):
                    if start < end:
                        out.send_layer(layer, src_blocks, start, end)
            acked = threading.Event()
            out.finish(11, lambda outcome: acked.set() if outcome.ok else None)
            assert acked.wait(10)
            deadline = time.monotonic() + 10
            while grant.report_key not in self.outcomes and time.monotonic() < deadline:
                time.sleep(0.005)
            result = self.outcomes[grant.report_key]
            assert result.ok and result.first_token_id == 11 and result.transport == "tcp"
            for layer in range(LAYERS):
                got = self.cache.read(layer, self.cache.slots(grant.block_ids, 0, n)).data.tobytes()
                assert got == self.src.read(layer, self.src.slots(src_blocks, 0, n)).data.tobytes()
        finally:
            conn.close()

    def close(self) -> None:
        self.server.stop()
        self.loop.close()


@pytest.fixture(scope="module")
def decode_side():
    side = DecodeSide()
    yield side
    side.close()


class ThreadCrashes:
    """Records exceptions that escape any thread (a dead server thread) while active."""

    def __init__(self) -> None:
        self.crashes: list[str] = []

    def __enter__(self) -> "ThreadCrashes":
        self._previous = threading.excepthook
        threading.excepthook = lambda args: self.crashes.append(
            f"{args.thread.name if args.thread else '?'}: " + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
        return self

    def __exit__(self, *exc) -> None:
        threading.excepthook = self._previous


def kv_conn_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kv-conn")


def wait_conn_threads(limit: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while kv_conn_threads() > limit:
        assert time.monotonic() < deadline, "a KV server connection thread hangs"
        time.sleep(0.002)


# -- what the fuzz client sends -----------------------------------------------------------

@dataclass(frozen=True)
class FrameSpec:
    """One frame to send; ``tid`` is ("grant", i) for a real transfer id, else a raw id."""

    kind: int
    tid: tuple | int
    layer: int
    start: int
    end: int
    plen: tuple  # ("natural", delta) or ("raw", n)
    send: tuple  # ("full",), ("short", k) or ("extra", bytes)
    checksum: str | int  # "correct", "wrong" or a raw value
    aux: int = 0
    flags: int = 0
    magic: bytes = MAGIC
    version: int = VERSION
    seed: int = 0


@st.composite
def frame_specs(draw, sizes: tuple[int, int]) -> FrameSpec:
    """Mostly well-formed DATA/DONE frames for the real grants (landing, refused, corrupted),
    the rest anything at all."""
    shape = draw(st.sampled_from(["data"] * 8 + ["done"] * 3 + ["anything"]), label="shape")
    if shape == "data":
        g = draw(st.sampled_from([0, 0, 1]))
        start = draw(st.sampled_from([None] * 4 + [LAYERS]).flatmap(lambda x: st.integers(0, sizes[g] - 1) if x is None else st.integers(0, 48)))
        end = draw(st.sampled_from([True] * 4 + [False]).flatmap(
            lambda inside: st.integers(start + 1, max(start + 1, sizes[g])) if inside else st.integers(start, start + 16)))
        return FrameSpec(
            FrameKind.DATA, ("grant", g), draw(st.sampled_from(list(range(LAYERS)) * 3 + [LAYERS])), start, end,
            ("natural", draw(st.sampled_from([0] * 8 + [-1, 1, -TOKEN_BYTES, TOKEN_BYTES]))),
            draw(st.sampled_from([("full",)] * 8 + [("short", 1), ("short", 100)])),
            draw(st.sampled_from(["correct"] * 3 + ["wrong"])), seed=draw(st.integers(0, 255)),
        )
    if shape == "done":
        return FrameSpec(
            FrameKind.DONE, draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)), 0, 0, 0,
            ("raw", draw(st.just(0) | st.integers(0, 64) | st.just(MAX_CONTROL_PAYLOAD))), ("full",), 0,
            aux=draw(st.integers(INT64_MIN, INT64_MAX)),
        )
    small = st.integers(0, 20)
    start = draw(small | st.integers(0, UINT32_MAX))
    return FrameSpec(
        kind=draw(st.sampled_from(KIND_VALUES) | st.integers(0, 255)),
        tid=draw(st.sampled_from([("grant", 0), ("grant", 1)]) | st.integers(0, UINT64_MAX)),
        layer=draw(st.integers(0, LAYERS) | st.integers(0, UINT32_MAX)),
        start=start,
        end=draw(small | st.integers(start, min(start + 64, UINT32_MAX)) | st.just(UINT32_MAX) | st.integers(0, UINT32_MAX)),
        plen=draw(st.tuples(st.just("natural"), st.just(0) | st.integers(-TOKEN_BYTES, TOKEN_BYTES))
                  | st.tuples(st.just("raw"), st.integers(0, 300) | st.sampled_from([MAX_CONTROL_PAYLOAD, MAX_CONTROL_PAYLOAD + 1,
                                                                                     MAX_PAYLOAD, MAX_PAYLOAD + 1, UINT64_MAX]))),
        send=draw(st.just(("full",)) | st.tuples(st.just("short"), st.integers(1, 100)) | st.tuples(st.just("extra"), st.binary(min_size=1, max_size=60))),
        checksum=draw(st.just("correct") | st.integers(0, UINT64_MAX)),
        aux=draw(st.integers(INT64_MIN, INT64_MAX)),
        flags=draw(st.just(0) | st.integers(0, 2**16 - 1)),
        magic=draw(st.sampled_from([MAGIC] * 4 + [b"PDKW", b"\x00" * 4])),
        version=draw(st.sampled_from([VERSION] * 4 + [0, 2, 255])),
        seed=draw(st.integers(0, 255)),
    )


def full_transfer(g: int, num_tokens: int, split: int) -> list[FrameSpec]:
    """A correct transfer of grant ``g`` (two chunks per layer) and its DONE."""
    bounds = sorted({0, min(split, num_tokens), num_tokens})
    units = [FrameSpec(FrameKind.DATA, ("grant", g), layer, a, b, ("natural", 0), ("full",), "correct", seed=layer)
             for layer in range(LAYERS) for a, b in zip(bounds, bounds[1:])]
    return units + [FrameSpec(FrameKind.DONE, ("grant", g), 0, 0, 0, ("raw", 0), ("full",), 0, aux=5)]


SEND_CAP = 40_000  # never send more than this for one frame's payload (the server needs EOF instead)


def render(spec: FrameSpec, grant_ids: list[int]) -> bytes:
    tid = grant_ids[spec.tid[1]] if isinstance(spec.tid, tuple) else spec.tid
    natural = max(0, spec.end - spec.start) * TOKEN_BYTES
    plen = natural + spec.plen[1] if spec.plen[0] == "natural" else spec.plen[1]
    plen = min(max(plen, 0), UINT64_MAX)
    body = random.Random(spec.seed).randbytes(min(plen, SEND_CAP))
    csum = {"correct": xxhash.xxh3_64_intdigest(body), "wrong": xxhash.xxh3_64_intdigest(body) ^ 1}.get(spec.checksum, spec.checksum)
    if spec.send[0] == "short":
        body = body[: max(0, len(body) - spec.send[1])]
    elif spec.send[0] == "extra":
        body += spec.send[1]
    return HEADER.pack(spec.magic, spec.version, spec.kind, spec.flags, tid, spec.layer, spec.start, spec.end, spec.aux, plen, csum) + body


@st.composite
def hello_payloads(draw) -> bytes:
    """HELLO payloads from garbage to almost valid (none of the known-bug classes)."""
    how = draw(st.sampled_from(["valid", "object", "object", "bytes"]))
    if how == "valid":
        return json.dumps(peer_dict()).encode()
    if how == "object":
        return json.dumps(draw(peer_json_objects())).encode(draw(encodings()))
    return draw(st.binary(max_size=120))


@dataclass(frozen=True)
class Session:
    mode: str  # "valid": proper handshake first; "hello": a HELLO with a fuzzed payload; "raw": frames straight away
    hello: bytes
    hello_plen_delta: int
    frames: tuple[FrameSpec, ...]
    cut: int | None  # stop sending after this many bytes of the frames
    fail_midway: bool  # the decode worker fails grant 0 while frames arrive
    sizes: tuple[int, int]  # tokens of grant 0 and grant 1 (grant 1's lease is already over)


@st.composite
def sessions(draw) -> Session:
    sizes = draw(st.tuples(st.integers(1, 40), st.integers(1, 16)), label="sizes")
    frames = draw(st.lists(frame_specs(sizes), max_size=10), label="frames")
    if draw(st.integers(0, 3), label="insert a full transfer") == 0:  # a correct transfer amid the garbage
        g = draw(st.sampled_from([0, 1]))
        at = draw(st.integers(0, len(frames)))
        frames[at:at] = full_transfer(g, sizes[g], draw(st.integers(0, sizes[g])))
    return Session(
        mode=draw(st.sampled_from(["valid"] * 5 + ["hello"] * 2 + ["raw"]), label="mode"),
        hello=draw(hello_payloads(), label="hello"),
        hello_plen_delta=draw(st.just(0) | st.integers(-5, 5)),
        frames=tuple(frames),
        cut=draw(st.sampled_from([False] * 3 + [True]).flatmap(lambda c: st.integers(0, 6000) if c else st.none()), label="cut"),
        fail_midway=draw(st.integers(0, 4), label="fail midway") == 0,
        sizes=sizes,
    )


# -- a model of the server: what one connection must do with a byte stream ---------------

@dataclass
class ModelGrant:
    num_tokens: int
    landed: np.ndarray
    state: str = "active"  # active, complete, failed
    corrupted: bool = False
    racy: bool = False  # failed on the loop at a moment the model cannot know


@dataclass
class Outcome:
    stop: str = "eof"  # eof, protocol, refused
    accepted: bool = False
    units_refused: int = 0
    checksum_mismatch: int = 0
    acks: list = field(default_factory=list)
    exact: bool = True  # counts and acks are fully determined


def hello_verdict(payload: bytes) -> bool:
    """Whether the server accepts this HELLO (the checks themselves are fuzzed in section 4)."""
    try:
        remote = PeerInfo.from_json(payload)
        DECODE_INFO.check_compatible(remote)
        choose(DECODE_INFO, remote)
    except HandshakeError:
        return False
    return True


def simulate(stream: bytes, handshaken: bool, grants: dict[int, ModelGrant]) -> Outcome:
    out, pos = Outcome(accepted=handshaken), 0

    def take(n: int) -> bytes | None:
        nonlocal pos
        if pos + n > len(stream):
            return None
        pos += n
        return stream[pos - n:pos]

    def header():
        raw = take(HEADER_SIZE)
        if raw is None:
            return None
        try:
            return FrameHeader.unpack(raw)
        except ProtocolError:
            out.stop = "protocol"
            return None

    if not handshaken:
        h = header()
        if h is None:
            return out
        if h.kind is not FrameKind.HELLO:
            out.stop = "protocol"
            return out
        payload = take(h.payload_len)
        if payload is None:
            return out
        if not hello_verdict(payload):
            out.stop = "refused"
            return out
        out.accepted = True
    while (h := header()) is not None:
        g = grants.get(h.transfer_id)
        if h.kind is FrameKind.DATA:
            if h.payload_len > MAX_PAYLOAD:
                out.stop = "protocol"
                return out
            if g is not None and g.racy:
                out.exact = False
                if take(h.payload_len) is None:
                    return out
                continue
            ok = (g is not None and g.state == "active" and 0 <= h.layer < LAYERS and 0 <= h.start < h.end <= g.num_tokens
                  and h.payload_len == (h.end - h.start) * TOKEN_BYTES and not g.landed[h.layer, h.start:h.end].any())
            if not ok:
                out.units_refused += 1  # refused (and counted) before its payload is read and dropped
                if take(h.payload_len) is None:
                    return out
                continue
            payload = take(h.payload_len)
            if payload is None:
                return out  # the write broke off: nothing landed
            g.landed[h.layer, h.start:h.end] = True
            if xxhash.xxh3_64_intdigest(payload) != h.checksum:
                g.corrupted = True
                out.checksum_mismatch += 1
        elif h.kind is FrameKind.DONE:
            if take(h.payload_len) is None:
                return out
            if g is not None and g.racy:
                out.exact = False
                continue
            if g is None or g.state != "active":
                out.acks.append((h.transfer_id, AckStatus.UNKNOWN_TRANSFER))
                continue
            status = (AckStatus.CHECKSUM_MISMATCH if g.corrupted else AckStatus.INCOMPLETE if not g.landed.all() else AckStatus.OK)
            out.acks.append((h.transfer_id, status))
            g.state = "complete" if status is AckStatus.OK else "failed"
            g.racy = status is not AckStatus.OK  # failed on the loop a little later: racy until then
        elif h.kind is FrameKind.RENEW:  # extends an active grant's lease; nothing else
            if take(h.payload_len) is None:
                return out
        else:  # handshake and decode-to-prefill frames, and one-sided units on a TCP connection
            out.stop = "protocol"
            return out
    return out


def exchange(side: DecodeSide, session: Session, grant_ids: list[int], fail=None) -> tuple[bytes, bytes, str]:
    """Runs one fuzz connection: returns (the frames' bytes as sent, the bytes received, how it ended)."""
    sock = socket.create_connection(side.address, timeout=5.0)
    received, ended = bytearray(), "eof"
    try:
        if session.mode == "valid":
            hello = json.dumps(peer_dict()).encode()
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
        elif session.mode == "hello":
            plen = max(0, len(session.hello) + session.hello_plen_delta)
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=plen).pack() + session.hello)
        if session.mode == "valid":  # wait for HELLO_OK, so frames are parsed as frames
            while len(received) < HEADER_SIZE or len(received) < HEADER_SIZE + FrameHeader.unpack(received[:HEADER_SIZE]).payload_len:
                chunk = sock.recv(65536)
                assert chunk, "the server refused a valid handshake"
                received += chunk
        stream = b"".join(render(f, grant_ids) for f in session.frames)
        if session.cut is not None:
            stream = stream[: session.cut]
        half = len(stream) // 2
        try:
            sock.sendall(stream[:half])
            if fail is not None:
                fail()
            sock.sendall(stream[half:])
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            ended = "send-failed"  # the server hung up first (protocol error)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                ended = "reset"
                break
            except socket.timeout:
                raise AssertionError("the KV server neither answered nor closed the connection within 5 s") from None
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    return stream, bytes(received), ended


def parse_replies(data: bytes) -> list[tuple[FrameHeader, bytes]]:
    frames, pos = [], 0
    while pos + HEADER_SIZE <= len(data):
        h = FrameHeader.unpack(data[pos:pos + HEADER_SIZE])
        if pos + HEADER_SIZE + h.payload_len > len(data):
            break
        frames.append((h, data[pos + HEADER_SIZE:pos + HEADER_SIZE + h.payload_len]))
        pos += HEADER_SIZE + h.payload_len
    return frames


COUNTERS = ("protocol_errors", "handshakes_refused", "units_refused", "checksum_mismatch", "transfers_tcp")


@pytest.mark.timeout(240)
@fuzz(150)
@given(session=sessions())
@example(session=Session("raw", b"", 0, (), None, False, (5, 5)))
@example(session=Session("valid", b"", 0, (FrameSpec(FrameKind.DATA, ("grant", 0), 0, 0, 8, ("raw", 1 << 40), ("full",), 0),), None, False, (8, 8)))
def test_live_kv_server_survives_random_streams(decode_side, session):
    side = decode_side
    rng = random.Random(zlib.crc32(repr(session).encode()))
    baseline_threads = kv_conn_threads()
    ledger_errors = len(side.ledger_errors)
    with ThreadCrashes() as crashes:
        grants = [side.grant(session.sizes[0], rng),
                  side.grant(session.sizes[1], rng, lease_s=1e-6)]  # expired before anything arrives; reaped at the end
        try:
            check_one_connection(side, session, grants, baseline_threads, crashes)
        finally:
            # Every reserved block comes back exactly once (even when the example failed).
            wait_conn_threads(baseline_threads)
            side.settle(grants)
            leaked, side.reserved = set(side.reserved), set()
            side.free |= leaked
        assert side.ledger_errors[ledger_errors:] == []
        assert not leaked and side.receiver.num_active == 0 and not side.receiver.grants, leaked
        # The server still serves a real transfer from a fresh connection.
        side.still_serving(rng)
        wait_conn_threads(baseline_threads)
        assert side.ledger_errors[ledger_errors:] == [] and not side.reserved and len(side.free) == NUM_BLOCKS
        assert not crashes.crashes, crashes.crashes


def check_one_connection(side: DecodeSide, session: Session, grants: list, baseline_threads: int, crashes: ThreadCrashes) -> None:
    g0 = grants[0]
    granted = {b for g in grants for b in g.block_ids}
    before = side.tensor.clone()
    counters = {k: side.receiver.counters[k] for k in COUNTERS}
    model = {g.transfer_id: ModelGrant(g.num_tokens, np.zeros((LAYERS, g.num_tokens), dtype=bool)) for g in grants}
    if session.fail_midway:
        model[g0.transfer_id].racy = True
    fail = (lambda: side.receiver.fail(g0, "cancelled mid-transfer")) if session.fail_midway else None
    stream, received, ended = exchange(side, session, [g.transfer_id for g in grants], fail)
    wait_conn_threads(baseline_threads)
    side.loop.call(lambda: None)  # let the fails that finish() scheduled on the loop run
    note(f"ended={ended} received={len(received)}B grants={[(g.transfer_id, g.block_ids) for g in grants]}")

    handshaken = session.mode == "valid"
    outcome = simulate(stream if handshaken else _hello_prefix(session) + stream, handshaken, model)
    note(f"model: {outcome}")
    event(f"mode={session.mode} stop={outcome.stop} ended={ended}")
    event(f"exact={outcome.exact} refused_units={outcome.units_refused > 0} mismatches={outcome.checksum_mismatch > 0}")
    event(f"acks={sorted({s.name for _, s in outcome.acks})}")
    event(f"landed={sum(int(m.landed.any()) for m in model.values())} complete={sum(m.state == 'complete' for m in model.values())}")
    delta = {k: side.receiver.counters[k] - counters[k] for k in COUNTERS}

    # Nothing crashed, and the connection ended the way the protocol says.
    assert not crashes.crashes, crashes.crashes
    assert delta["protocol_errors"] == (outcome.stop == "protocol"), delta
    assert delta["handshakes_refused"] == (outcome.stop == "refused"), delta
    if outcome.exact:
        assert (delta["units_refused"], delta["checksum_mismatch"]) == (outcome.units_refused, outcome.checksum_mismatch), delta
        assert delta["transfers_tcp"] == sum(m.state == "complete" for m in model.values()), delta

    # What the server answered: well-formed frames, no credential, ACKs as the model predicts.
    replies = parse_replies(received)
    kinds = [h.kind for h, _ in replies]
    if outcome.stop == "refused":
        assert set(kinds) <= {FrameKind.REJECT}
    else:
        assert set(kinds) <= {FrameKind.HELLO_OK, FrameKind.ACK} and kinds.count(FrameKind.HELLO_OK) <= 1
    for h, payload in replies:
        if h.kind is FrameKind.HELLO_OK:
            info = PeerInfo.from_json(payload)
            assert info.proof == "" and info.extra["transport"] == "tcp"
    acks = [(h.transfer_id, AckStatus(h.aux)) for h, _ in replies if h.kind is FrameKind.ACK]
    if outcome.exact:
        assert acks == outcome.acks[: len(acks)], (acks, outcome.acks)
        if ended == "eof" and outcome.stop == "eof":
            assert acks == outcome.acks

    # No grant completed from garbage; what landed is what the model says landed.
    for g in grants:
        m = model[g.transfer_id]
        if g.state is GrantState.COMPLETE:
            assert g.landed.all() and not g.corrupted
        if m.racy:
            continue
        assert g.state.value == m.state, (g.state, m.state)
        if m.state == "active":
            assert np.array_equal(g.landed, m.landed)
    # Nothing was written outside the granted blocks.
    diff = side.tensor.view(torch.int32) != before.view(torch.int32)  # bitwise: garbage K/V holds NaNs
    changed = sorted({int(b) for b in diff.flatten(2).any(2).nonzero()[:, 1]} - granted)
    assert not changed, f"blocks {changed} changed, but only {sorted(granted)} were granted"


def _hello_prefix(session: Session) -> bytes:
    if session.mode != "hello":
        return b""
    plen = max(0, len(session.hello) + session.hello_plen_delta)
    return FrameHeader(FrameKind.HELLO, payload_len=plen).pack() + session.hello


WIRE_MALFORMED_HANDSHAKES = [
    pytest.param(b"0", id="non-object-json"),
    pytest.param(b"[" * 60_000, id="deeply-nested-json"),
    pytest.param(json.dumps(peer_dict(transports=[1])).encode(), id="non-string-transport"),
    pytest.param(json.dumps(peer_dict(auth_token=5)).encode(), id="non-string-credential"),
    pytest.param(json.dumps(peer_dict(auth_token="\ud800")).encode(), id="surrogate-credential"),
    pytest.param(json.dumps({**peer_dict(), "\ud800": 1}).encode(), id="surrogate-in-refusal-reason"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hello", WIRE_MALFORMED_HANDSHAKES)
def test_live_kv_server_refuses_malformed_hellos(decode_side, hello):
    side = decode_side
    before = side.receiver.counters["handshakes_refused"]
    baseline_threads = kv_conn_threads()
    with ThreadCrashes() as crashes:
        sock = socket.create_connection(side.address, timeout=5.0)
        try:
            sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
        wait_conn_threads(baseline_threads)
        side.still_serving(random.Random(0))  # the server survives either way
    assert [h.kind for h, _ in parse_replies(received)] == [FrameKind.REJECT]
    assert side.receiver.counters["handshakes_refused"] == before + 1
    assert not crashes.crashes, crashes.crashes


@pytest.mark.timeout(60)
def test_a_failed_done_is_final(decode_side):
    side = decode_side
    rng = random.Random(1)
    baseline_threads = kv_conn_threads()
    grant = side.grant(8, rng)
    blocked, release = threading.Event(), threading.Event()
    side.loop.loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(10)))  # a busy event loop
    assert blocked.wait(5)

    def data(layer: int) -> bytes:
        return render(FrameSpec(FrameKind.DATA, ("grant", 0), layer, 0, 8, ("natural", 0), ("full",), "correct", seed=layer), [grant.transfer_id])

    done = FrameHeader(FrameKind.DONE, grant.transfer_id).pack()
    sock = socket.create_connection(side.address, timeout=5.0)
    try:
        hello = json.dumps(peer_dict()).encode()
        sock.sendall(FrameHeader(FrameKind.HELLO, payload_len=len(hello)).pack() + hello)
        reply = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(reply.payload_len, socket.MSG_WAITALL)
        sock.sendall(data(0) + data(1) + done)  # layer 2 missing: INCOMPLETE
        first = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.sendall(data(2) + done)
        second = FrameHeader.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
    finally:
        release.set()
        sock.close()
        wait_conn_threads(baseline_threads)
        side.settle([grant])
    assert AckStatus(first.aux) is AckStatus.INCOMPLETE
    assert AckStatus(second.aux) is not AckStatus.OK and grant.state is GrantState.FAILED
