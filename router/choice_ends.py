"""n > 1: the choices the router ends while the request's others go on.

Stop strings are matched on the router's text, so no worker knows that a choice has met one.
Whatever runs a request's choices listens here and ends them where they run: a decode worker's
``EndChoices``, or the call of a choice that continues on its own after a migration. Without
this, a stopped choice would keep its batch slot and its blocks until the last choice ended.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


class ChoiceEnds:
    def __init__(self) -> None:
        self.ended: set[int] = set()
        self._listeners: list[Callable[[set[int]], None]] = []

    def end(self, index: int) -> None:
        if index in self.ended:
            return
        self.ended.add(index)
        for listener in list(self._listeners):
            listener({index})

    @contextlib.contextmanager
    def listening(self, listener: Callable[[set[int]], None]) -> Iterator[None]:
        """Calls ``listener`` with the choices ended so far, if any, then with each choice ended
        while the block runs."""
        if self.ended:
            listener(set(self.ended))
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)
