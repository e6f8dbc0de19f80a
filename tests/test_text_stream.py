"""Incremental detokenization and stop strings on the real tokenizer."""

from __future__ import annotations

import pytest

from pdserve.router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


@pytest.mark.parametrize("text", ["héllo wörld 你好 🙂 done", "naïve café — 東京 ☕️ 🇫🇷!", "plain ascii text"])
def test_multibyte_characters_split_across_tokens(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = tokenizer.text_stream()
    pieces = [stream.push([t]) for t in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert any(p == "" for p in pieces[:-1]) or text == "plain ascii text"


def test_stop_string_spanning_messages_never_leaks(tokenizer):
    ids = tokenizer.encode("The weather today is sunny and warm.")
    stream = tokenizer.text_stream(stop=(" sunny and",))
    emitted = ""
    for t in ids:
        emitted += stream.push([t])
        assert "sunny" not in emitted and not emitted.endswith(" sun")
        if stream.stopped:
            break
    emitted += stream.flush()
    assert stream.stopped
    assert emitted == "The weather today is"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    stream = tokenizer.text_stream(stop=("four", "two"))
    text = stream.push(ids) + stream.flush()
    assert stream.stopped and text == "one "


def test_without_stop_strings_everything_is_emitted(tokenizer):
    ids = tokenizer.encode("Hello, streaming world!")
    stream = tokenizer.text_stream()
    assert "".join(stream.push([t]) for t in ids) == "Hello, streaming world!"
    assert stream.flush() == ""
