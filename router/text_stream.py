"""Incremental detokenization with stop strings.

``tokenizers``' DecodeStream turns ids into text as soon as the bytes form whole characters
(a multi-byte character split across tokens comes out once complete). Stop strings are
matched on the text; the last ``len(longest stop) - 1`` characters are held back, so a stop
string that spans two messages never leaks its first half to the client.

DecodeStream also holds back any text that ends in U+FFFD, since it cannot tell a character
still to complete from a real U+FFFD the model wrote. So while it holds tokens back, stop
strings are matched on a decode of them up to their trailing U+FFFDs, and the end of the stream
releases what it still holds, as a decode of all the ids would show it. A stop string that
ends in U+FFFD itself is caught only once later text (or the end) shows the U+FFFD is real.

The stream starts with the prompt's last tokens as context (their text is not emitted):
SentencePiece decoders (Llama-2, Mistral) drop the space a sequence starts with, so without
it " Paris" after "The capital of France is" would come out as "Paris".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 4  # enough for a decoder to see a continuation
INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's words when a decoder rewrote its past


def continuation_anchor(tokenizer: Tokenizer) -> list[int]:
    """Ids of a plain word: decoded after it, a token reads as inside a text, not at its start."""
    return tokenizer.encode("a", add_special_tokens=False).ids


@dataclass
class TextStream:
    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    text: str = ""
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: bool = False
    consumed: int = 0  # tokens of the last ``push`` that count: up to the one completing a stop string
    context_ids: tuple[int, ...] = ()  # the prompt's ids: the completion continues their text
    _decoder: DecodeStream = field(init=False, repr=False)
    _shown: list[int] = field(init=False, repr=False)  # the last ids whose text is out of the decoder
    _held: list[int] = field(init=False, repr=False)  # ids after them, which the decoder holds back

    def __post_init__(self) -> None:
        context = list(self._context(self.context_ids[-CONTEXT_TOKENS:]))
        self._decoder = self._decoder_after(context)
        self._shown, self._held = context, []
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decoder_after(self, ids) -> DecodeStream:
        decoder = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in ids:
            decoder.step(self.tokenizer, token_id)  # their text is not ours
        return decoder

    def _step(self, token_id: int) -> str | None:
        try:
            return self._decoder.step(self.tokenizer, token_id)
        except Exception as e:
            if INVALID_PREFIX not in str(e):
                raise
        # A byte-fallback decoder (Llama-2, Mistral) turned bytes it had already shown into
        # U+FFFD once they proved no valid UTF-8; the stream cannot go on from there. Start
        # afresh after a plain word (as vLLM restarts it): that text stays as it was sent.
        self._shown, self._held = continuation_anchor(self.tokenizer), []
        self._decoder = self._decoder_after(self._shown)
        return self._decoder.step(self.tokenizer, token_id)

    def _context(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """The longest tail of ``ids`` that decodes to whole characters: a prompt that ends (or
        a tail that starts) inside a multi-byte character gives no context rather than a broken one."""
        while ids and "\ufffd" in self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens):
            ids = ids[1:]
        return ids

    def push(self, token_ids: list[int]) -> str:
        """Feeds new tokens; returns the text that is now safe to emit. Sets ``stopped`` on a stop string."""
        if self.stopped:
            self.consumed = 0
            return ""
        search_from = max(0, len(self.text) - self._hold)
        self.consumed = len(token_ids)
        for n, token_id in enumerate(token_ids, 1):
            piece = self._step(token_id)
            if not piece:
                self._held.append(token_id)
                # Checked token by token, so several tokens in one message (speculative
                # decoding) stop exactly where they would one at a time.
                if self.stop and self._stop_at(self.text + self._held_text().rstrip("\ufffd"), search_from):
                    self.consumed = n
                    return self._emit(len(self.text))
                continue
            self._shown = (self._shown + self._held + [token_id])[-CONTEXT_TOKENS:]
            self._held = []
            if self._stop_at(self.text + piece, search_from):
                self.consumed = n
                return self._emit(len(self.text))
            self.text += piece
        return self._emit(len(self.text) - self._hold)

    def flush(self) -> str:
        """The rest, at the end of the stream: the held-back tail, and what the decoder holds
        (a real U+FFFD, or the bytes of a character the output never completed)."""
        if self._held and not self.stopped:
            search_from, held = max(0, len(self.text) - self._hold), self._held_text()
            if not self._stop_at(self.text + held, search_from):
                self.text += held
            self._held = []
        return self._emit(len(self.text))

    def _stop_at(self, text: str, search_from: int) -> bool:
        """Whether ``text`` has a stop string from ``search_from`` on; if so, ends the stream's
        text before the earliest one."""
        hit = min((i for i in (text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if hit < 0:
            return False
        self.text, self.stopped = text[:hit], True
        return True

    def _held_text(self) -> str:
        """The text of the held ids, decoded after the shown ones."""
        skip = self.skip_special_tokens
        shown = self.tokenizer.decode(self._shown, skip_special_tokens=skip)
        whole = self.tokenizer.decode(self._shown + self._held, skip_special_tokens=skip)
        if whole.startswith(shown):
            return whole[len(shown) :]
        anchor = continuation_anchor(self.tokenizer)  # a decoder that rewrote the shown text
        whole = self.tokenizer.decode(anchor + self._held, skip_special_tokens=skip)
        return whole[len(self.tokenizer.decode(anchor, skip_special_tokens=skip)) :]

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
