"""JSON text that no Unicode string can hold: a lone UTF-16 surrogate escape (\\ud800 alone is
legal JSON, but no UTF-8 text, tokenizer or protobuf string can carry it). Found exactly in the
text (cheap), then located in the parsed body to name the field."""

from __future__ import annotations

import re

# \uD800 to \uDFFF: the only way JSON text spells a surrogate (unless its backslash is itself
# escaped, as in \\uD800); a high one followed at once by a low one is a pair, one character.
_SURROGATE_ESCAPE = re.compile(r"\\u([dD][89a-fA-F][0-9a-fA-F]{2})")


def has_lone_surrogate_escape(text: str) -> bool:
    high_ends = -1  # where the escape of a high surrogate awaiting its low one ends
    for m in _SURROGATE_ESCAPE.finditer(text):
        start = backslash = m.start()
        while backslash > 0 and text[backslash - 1] == "\\":
            backslash -= 1
        if (start - backslash) % 2:
            continue  # an escaped backslash, then the letter u
        low = int(m[1], 16) >= 0xDC00
        if low and start != high_ends or not low and high_ends >= 0:
            return True
        high_ends = -1 if low else m.end()
    return high_ends >= 0


def lone_surrogate_path(data: dict) -> str | None:
    """Where the first string (or key) holding a lone surrogate is, e.g. ``messages[0].content``."""
    stack: list[tuple[tuple, dict | list]] = [((), data)]
    while stack:
        path, container = stack.pop()
        for key, item in container.items() if isinstance(container, dict) else enumerate(container):
            if isinstance(key, str) and not _encodable(key):
                return _path((*path, key.encode("utf-8", "backslashreplace").decode()))
            if isinstance(item, str):
                if not _encodable(item):
                    return _path((*path, key))
            elif isinstance(item, (dict, list)):
                stack.append(((*path, key), item))
    return None


def _path(parts: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(parts))


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
