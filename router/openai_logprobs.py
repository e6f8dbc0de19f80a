"""Log probabilities in OpenAI's shapes.

/v1/completions (the legacy shape lm-evaluation-harness and perplexity scripts read):
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``; with
``echo`` the prompt's tokens come first, the first of them with ``null`` (nothing predicts
it). /v1/chat/completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}``.

A token's text is its own bytes decoded as UTF-8 (a token that holds part of a character
shows U+FFFD, as in vLLM); ``bytes`` are the exact bytes, so a client can join them. A
token's ``text_offset`` indexes the returned text: the characters its predecessors' bytes
complete (so tokens that share a character share its offset), a special token the answer's
text leaves out taking none.

vLLM's ``prompt_logprobs``: one entry per prompt token, ``null`` for the first (nothing
predicts it), else ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token
and the most likely alternatives.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

from pdserve.router.text_stream import continuation_anchor
from pdserve.v1 import pdserve_pb2 as pb

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2 style) spells each byte as one printable character: the inverse map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


class TokenTexts:
    """Token id -> (text, bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Decoded after a plain token, as inside a text: SentencePiece decoders drop the space
        # a sequence starts with (" Paris" alone decodes to "Paris").
        self._anchor = continuation_anchor(tokenizer)
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return "", []
        alphabet = _byte_level_alphabet()
        if self.byte_level and all(ch in alphabet for ch in piece):
            raw = bytes(alphabet[ch] for ch in piece)
        elif _BYTE_PIECE.fullmatch(piece):  # SentencePiece's byte fallback spells a byte <0xE9>
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = self._continuation(token_id).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _continuation(self, token_id: int) -> str:
        text = self.tokenizer.decode([*self._anchor, token_id], skip_special_tokens=False)
        if self._anchor and text.startswith(self._anchor_text):
            return text[len(self._anchor_text) :]
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs:
    """One choice's /v1/completions ``logprobs``, built chunk by chunk (offsets run on)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.restart_at(0)

    def restart_at(self, offset: int) -> None:
        """The next token starts at character ``offset`` of the returned text."""
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character's first bytes

    def block(
        self, token_ids: list[int], logprobs: list[pb.TokenLogprob | None], echoed: str | None = None
    ) -> dict[str, Any]:
        """``logprobs[i]`` None: no prediction for that token (the prompt's first). A completion's
        text leaves special tokens out; ``echoed`` (the prompt as returned) holds one where it
        says so (not a BOS the tokenizer added to a text prompt)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs):
            text, raw = self.texts(token_id)
            if echoed is not None and _starts_the_text(echoed, self.offset, text):
                text, raw = text[1:], raw[1:]  # SentencePiece writes no space before a text's first word
            tokens.append(text)
            offsets.append(self.offset)
            if token_id not in self.texts.special or (echoed is not None and echoed.startswith(text, self.offset)):
                self.offset += len(self._utf8.decode(bytes(raw)))
            token_logprobs.append(lp.logprob if lp is not None else None)
            tops.append(
                None
                if lp is None
                else {self.texts(t)[0]: v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} | {text: lp.logprob}
            )
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _starts_the_text(echoed: str, offset: int, text: str) -> bool:
    return text.startswith(" ") and not echoed.startswith(text, offset) and echoed.startswith(text[1:], offset)


def prompt_logprobs(
    texts: TokenTexts, prompt_ids: list[int], logprobs: list[pb.TokenLogprob]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``; ``logprobs[i]`` is for ``prompt_ids[i + 1]``."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], logprobs):
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": texts(t)[0]}
            for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1)
        }
        entry[str(token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": texts(token_id)[0]}
        out.append(entry)
    return out


def merge_blocks(blocks: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not blocks:
        return None
    return {
        key: [v for b in blocks for v in b[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[pb.TokenLogprob]) -> list[dict[str, Any]]:
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        text, raw = texts(token_id)
        top = []
        for t, v in zip(lp.top_token_ids, lp.top_logprobs):
            top_text, top_raw = texts(t)
            top.append({"token": top_text, "logprob": v, "bytes": top_raw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return content
