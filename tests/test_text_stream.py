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


REPLACEMENT_TOKEN = 24211  # a whole token of SmolLM2's vocabulary that is U+FFFD itself
O_THEN_LEAD_BYTE = 10003  # Cyrillic "о" and the first byte of a character still to come


def streamed(stream, ids) -> str:
    return "".join(stream.push([t]) for t in ids) + stream.flush()


@pytest.mark.parametrize("tail", [[], [2]], ids=["end", "eos"])
def test_a_real_replacement_character_at_the_end_is_not_lost(tokenizer, tail):
    """The decoder holds back text ending in U+FFFD; the end of the stream releases it."""
    assert tokenizer.decode([REPLACEMENT_TOKEN]) == "\ufffd"
    ids = tokenizer.encode("Repeat exactly: ") + [REPLACEMENT_TOKEN] * 3 + tail
    assert streamed(tokenizer.text_stream(), ids) == tokenizer.decode(ids) == "Repeat exactly: \ufffd\ufffd\ufffd"


def test_a_character_cut_off_by_the_end_of_the_output_reads_as_a_full_decode_does(tokenizer):
    ids = tokenizer.encode("flowers 🌸")
    cut = ids[:-1]  # the emoji's last byte never comes
    assert tokenizer.decode(cut).endswith("\ufffd")
    assert streamed(tokenizer.text_stream(), cut) == tokenizer.decode(cut)


def test_a_stop_string_inside_a_held_back_token_stops_at_that_token(tokenizer):
    stream = tokenizer.text_stream(stop=("о",))
    text = stream.push(tokenizer.encode("Hi ") + [O_THEN_LEAD_BYTE] + tokenizer.encode(" more"))
    assert stream.stopped and stream.consumed == len(tokenizer.encode("Hi ")) + 1
    assert text + stream.flush() == "Hi "


def test_a_stop_string_of_a_real_replacement_character_is_caught_by_the_next_text(tokenizer):
    ids = tokenizer.encode("a") + [REPLACEMENT_TOKEN] + tokenizer.encode(" b c")
    stream = tokenizer.text_stream(stop=("\ufffd",))
    assert streamed(stream, ids[:2]) == "a" and stream.stopped  # at the end of the output
    stream = tokenizer.text_stream(stop=("\ufffd",))
    text = "".join(stream.push([t]) for t in ids[:3])
    assert stream.stopped and stream.consumed == 1 and text == "a"  # the token after it shows it real


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


def _sentencepiece_tokenizer(decoder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁of": 3, "▁France": 4, "▁is": 5, "▁Paris": 6, ".": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoder
    return tok


def _sentencepiece_decoders():
    from tokenizers import decoders

    return {
        "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="first"),  # GGUF llama vocabularies
        "replace+strip": decoders.Sequence(  # Llama-2 and Mistral tokenizer.json files
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ),
    }


@pytest.mark.parametrize("decoder", ["metaspace", "replace+strip"])
def test_a_completion_keeps_its_leading_space_with_sentencepiece_decoders(decoder):
    from pdserve.router.openai_logprobs import TokenTexts
    from pdserve.router.text_stream import TextStream

    tok = _sentencepiece_tokenizer(_sentencepiece_decoders()[decoder])
    prompt, completion = [1, 2, 3, 4, 5], [6, 7]  # "The capital of France is" + " Paris."
    stream = TextStream(tok, context_ids=tuple(prompt))
    assert stream.push(completion) + stream.flush() == " Paris."
    assert tok.decode(prompt) + " Paris." == tok.decode(prompt + completion)  # as the whole decodes
    texts = TokenTexts(tok)  # logprobs' per-token texts add up to the same text
    assert [texts(t)[0] for t in completion] == [" Paris", "."]


def test_a_prompt_ending_inside_a_character_gives_no_context(tokenizer):
    ids = tokenizer.encode("Hello 你好 world")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))  # mid-character
    stream = tokenizer.text_stream(prompt_ids=ids[:cut])
    pieces = [stream.push([t]) for t in ids[cut:]] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids[cut:])  # the completion's own text, no prompt repeated


def test_a_prompt_as_context_changes_nothing_for_a_byte_level_tokenizer(tokenizer):
    prompt, completion = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris. It is")
    stream = tokenizer.text_stream(prompt_ids=prompt)
    assert "".join([stream.push([t]) for t in completion] + [stream.flush()]) == " Paris. It is"


def _byte_fallback_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁model": 2, "<0x6E>": 3, "<0x8E>": 4, "<0xE9>": 5, "<0xBE>": 6, "<0x8D>": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = _sentencepiece_decoders()["replace+strip"]
    return tok


def test_a_byte_fallback_decoder_that_rewrites_its_past_does_not_fail_the_stream():
    """'n' (a byte) shows at once; the stray byte after it turns both into U+FFFD in a whole
    decode, which DecodeStream refuses as an invalid prefix. The stream goes on."""
    from pdserve.router.text_stream import TextStream

    tok = _byte_fallback_tokenizer()
    stream = TextStream(tok, context_ids=(1,))
    text = "".join(stream.push([t]) for t in (3, 4, 2)) + stream.flush()
    assert text == "n model"  # what was sent stays sent; the word after it keeps its space


def test_logprobs_give_a_byte_fallback_token_its_byte_and_an_echo_its_first_word():
    from pdserve.router.openai_logprobs import CompletionLogprobs, TokenTexts

    texts = TokenTexts(_byte_fallback_tokenizer())
    pieces = [texts(t) for t in (5, 6, 7)]  # 龍, one byte each
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == "龍"

    tok = _sentencepiece_tokenizer(_sentencepiece_decoders()["metaspace"])
    prompt = [1, 2, 3, 4, 5]
    echoed = tok.decode(prompt)  # "The capital of France is": no space before its first word
    block = CompletionLogprobs(TokenTexts(tok)).block(prompt, [None] * len(prompt), echoed=echoed)
    assert "".join(block["tokens"]) == echoed
    assert block["text_offset"] == [0, 3, 11, 14, 21]  # each token where its text starts in the echo
