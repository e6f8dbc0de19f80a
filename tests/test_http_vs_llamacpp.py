"""The OpenAI-client benchmark against llama.cpp's server: its arguments, the per-server request
body, the exact-length check, its pdserve half against a real `pdserve up` over HTTP, and its
llama.cpp half where that optional server is installed (a skip with the reason elsewhere)."""

from __future__ import annotations

import asyncio
import types

import pytest

from pdserve.bench import http_vs_llamacpp as bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0"], "--concurrency takes comma-separated positive integers"),
        (["--concurrency", "1,x"], "--concurrency takes comma-separated positive integers"),
        (["--rounds", "0"], "--rounds and --num-prompts must be >= 1"),
        (["--input-len", "0"], "--input-len must be >= 1 and --output-len >= 2"),
        (["--output-len", "1"], "--input-len must be >= 1 and --output-len >= 2"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--temperature", "-1"], "--temperature must be in [0, 2] and --top-p in (0, 1]"),
        (["--top-p", "0"], "--temperature must be in [0, 2] and --top-p in (0, 1]"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_each_server_is_asked_for_exact_lengths_its_own_way():
    llama, default, int4 = bench.parse_servers(["", "--quantization int4"])
    assert (llama.label, default.label, int4.label) == ("llama.cpp", "pdserve", "pdserve --quantization int4")
    assert llama.extra_body() == {"logit_bias": {"0": -100.0, "2": -100.0}}
    assert default.extra_body() == int4.extra_body() == default.extra_body(sampled=True) == {"ignore_eos": True}
    # sampling: llama.cpp's own extra samplers off, so both draw from the same distribution
    assert llama.extra_body(sampled=True) == {
        "logit_bias": {"0": -100.0, "2": -100.0},
        "top_k": 0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
    }
    assert int4.command(8000, 2)[-2:] == ["--quantization", "int4"]
    assert "--n_threads" in llama.command(8000, 2)


def _fake_client(texts: list[str], usage: int | None = None):
    async def stream():
        for text in texts:
            yield types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)], usage=None)
        if usage is not None:  # the final chunk of stream_options.include_usage
            yield types.SimpleNamespace(choices=[], usage=types.SimpleNamespace(completion_tokens=usage))

    async def create(**request):
        return stream()

    return types.SimpleNamespace(completions=types.SimpleNamespace(create=create))


def test_a_short_answer_or_an_error_is_a_failed_request_not_a_faster_figure():
    timeline = asyncio.run(bench._one(_fake_client(["a", "", "b", "c"]), "m", "p", 3, {}))
    assert timeline.success and timeline.output_tokens == 3  # empty chunks are not tokens
    assert timeline.end_time == timeline.chunk_times[-1] and timeline.tpot >= 0
    short = asyncio.run(bench._one(_fake_client(["a", "b", "c"]), "m", "p", 4, {}))
    assert not short.success and short.error == "asked for 4 tokens, 3 streamed"


def test_tokens_that_streamed_no_text_are_counted_from_the_servers_usage():
    timeline = asyncio.run(bench._one(_fake_client(["a", "b", "c"], usage=4), "m", "p", 4, {}))
    assert timeline.success and timeline.chunk_tokens == [1, 1, 2]
    short = asyncio.run(bench._one(_fake_client(["a", "b"], usage=3), "m", "p", 4, {}))
    assert short.error == "asked for 4 tokens, 3 streamed"


def test_a_server_without_usage_has_its_text_counted_by_the_tokenizer():
    """llama-cpp-python's server ignores include_usage and streams a multi-byte character's
    tokens as one chunk: the answer's text, tokenized, gives its length."""
    emoji = "\N{GRINNING FACE}"
    assert bench.count_tokens(emoji) > 1  # one chunk, several byte tokens
    chunks = [" Faces", ":", " " + emoji]
    timeline = asyncio.run(
        bench._one(
            _fake_client(chunks), "m", "p", bench.count_tokens("".join(chunks)), {}, tokens_of=bench.count_tokens
        )
    )
    assert timeline.success and timeline.chunk_tokens[:2] == [1, 1] and timeline.chunk_tokens[2] > 1
    # The usage a server does report wins over the count.
    reported = asyncio.run(bench._one(_fake_client(["a", "b"], usage=5), "m", "p", 5, {}, tokens_of=lambda _: 99))
    assert reported.success and reported.output_tokens == 5

    async def refused(**request):
        raise ConnectionError("server went away")

    client = types.SimpleNamespace(completions=types.SimpleNamespace(create=refused))
    failed = asyncio.run(bench._one(client, "m", "p", 4, {}))
    assert failed.error == "ConnectionError: server went away" and not failed.success


def test_every_request_carries_the_runs_sampling():
    sent = []

    async def create(**request):
        sent.append(request)
        return await _fake_client(["a", "b"]).completions.create()

    client = types.SimpleNamespace(completions=types.SimpleNamespace(create=create))
    timeline = asyncio.run(bench._one(client, "m", "p", 2, {"ignore_eos": True}, temperature=0.7, top_p=0.9))
    assert timeline.success
    assert (sent[0]["temperature"], sent[0]["top_p"], sent[0]["extra_body"]) == (0.7, 0.9, {"ignore_eos": True})


@pytest.mark.e2e
def test_pdserve_half_against_a_real_stack_over_http():
    server = bench.Server("pdserve", "pdserve", ("--colocated", "--kv-cache-memory", "256MiB"))
    args = types.SimpleNamespace(threads=2, output_len=6, concurrency=[1, 3], temperature=0.8, top_p=0.9)
    texts = bench.prompts(4, 24)
    rows = bench.measure(server, args, texts[1:], texts[0])
    assert [r["concurrency"] for r in rows] == [1, 3]
    for row in rows:
        assert (row["completed"], row["failed"]) == (3, []), row
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0 and row["output_tok_s"] > 0


@pytest.mark.e2e
def test_llamacpp_half_streams_exact_lengths_when_installed():
    # llama.cpp's server is an optional extra; where it is installed, its end-token bias must
    # give every answer the asked-for length (else the comparison would count short answers).
    pytest.importorskip("llama_cpp.server", reason="llama.cpp's server is optional: pip install 'pdserve[bench]'")
    args = types.SimpleNamespace(threads=2, output_len=6, concurrency=[1, 2], temperature=0.0, top_p=1.0)
    texts = bench.prompts(4, 24)
    rows = bench.measure(bench.Server("llama.cpp", "llama.cpp"), args, texts[1:], texts[0])
    for row in rows:
        assert (row["completed"], row["failed"]) == (3, []), row
        assert row["tpot_p50_ms"] > 0


def test_too_many_prompts_for_the_fixed_text_is_a_clear_error():
    with pytest.raises(ValueError, match="10000 prompts of 256 tokens are more than the fixed text's"):
        bench.prompts(10_000, 256)


def test_a_server_that_exits_at_start_is_named_and_stopped():
    server = bench.Server("pdserve --bogus", "pdserve", ("--no-such-flag",))
    args = types.SimpleNamespace(threads=2, output_len=4, concurrency=[1])
    with pytest.raises(RuntimeError, match="the server exited with code 2 before it answered"):
        bench.measure(server, args, ["x"], "x")
