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


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_several_tokens_per_message_stop_where_one_at_a_time_would(tokenizer, batch):
    """Speculative decoding streams several tokens per message: the stop string must end the
    output at the same token (``consumed``) and text as when tokens come one by one."""
    ids = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta")
    stream = tokenizer.text_stream(stop=("delta eps",))
    kept, text = [], ""
    for i in range(0, len(ids), batch):
        text += stream.push(ids[i : i + batch])
        kept += ids[i : i + batch][: stream.consumed]
        if stream.stopped:
            break
    text += stream.flush()
    assert text == "alpha beta gamma "
    assert tokenizer.decode(kept).startswith("alpha beta gamma delta eps")
    assert not tokenizer.decode(kept[:-1]).startswith("alpha beta gamma delta eps")  # the completing token is the last
