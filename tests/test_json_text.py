"""Lone UTF-16 surrogates in JSON text (router/json_text.py): found exactly, pairs and escaped
backslashes pass, and the field that holds one is named."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.json_text import has_lone_surrogate_escape, lone_surrogate_path


@pytest.mark.parametrize(
    "text, lone",
    [
        (r'"\ud800"', True),
        (r'"\ude00"', True),
        (r'"\ud83d"', True),
        (r'"\ud83d\ude00"', False),  # a pair: one character
        (r'"a\uDBFF\uDFFF"', False),
        (r'"\ud83d x \ude00"', True),  # not adjacent: two lone halves
        (r'"\ud83d\ud83d\ude00"', True),
        (r'"\\ud800"', False),  # an escaped backslash, then "ud800"
        (r'"\\\ud800"', True),  # an escaped backslash, then a real escape
        (r'"\\\\ud800"', False),
        (r'"\u00e9"', False),
    ],
)
def test_lone_surrogate_escapes(text, lone):
    assert has_lone_surrogate_escape(text) is lone
    assert (lone_surrogate_path({"k": json.loads(text)}) is not None) is lone


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12))
def test_the_text_check_agrees_with_what_utf8_can_hold(value):
    try:
        value.encode("utf-8")
        holdable = True
    except UnicodeEncodeError:
        holdable = False
    assert has_lone_surrogate_escape(json.dumps({"k": [value]})) is not holdable  # every non-ASCII escaped
    if holdable:  # as UTF-8 text, escapes only for control characters
        assert not has_lone_surrogate_escape(json.dumps({"k": [value]}, ensure_ascii=False))


def test_the_field_is_named():
    assert lone_surrogate_path({"messages": [{"role": "user", "content": "\ud800"}]}) == "messages[0].content"
    assert lone_surrogate_path({"a": [[1, "x"], ["ok", "\udc00"]]}) == "a[1][1]"
    assert lone_surrogate_path({"fine": "\U0001f600", "model": "m"}) is None
    assert lone_surrogate_path({"\ud800key": 1}) == "\\ud800key"
