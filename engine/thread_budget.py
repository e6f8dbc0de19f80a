"""How many torch threads each step runs on.

`pdserve up` splits a machine's cores between its prefill and decode workers, so neither
slows the other down while both compute. But a prefill worker only computes while a decode
worker waits for its KV: the rest of the time its cores idle while the decode worker steps on
its own share. With ``borrow_threads``, a decode step that has no prompt of its own to prefill
and nothing waiting for remote KV runs on that many threads instead; the first reservation
(a prompt headed for a prefill worker) gives them back before the prefill starts, since the
router sends the prompt only once the decode worker has answered with its blocks.

Set on the engine thread, before each forward pass: an OpenMP thread count belongs to the
thread that sets it, and the engine thread is the one that opens the parallel regions. Only
with one decode worker does ``pdserve up`` set it: every prefill then computes for that worker,
so its own queue says when the prefill cores are busy.

A prefill worker that shares every core (``share_cores``) fills them with its own threads:
``fills_cores`` then tells the KV connector to send a prompt's layers after its forward pass
rather than as each is written, since a sending thread would preempt one of the compute
threads and the rest would wait for it at the next layer (measured: 10–52 ms added to a
1024-token prompt's TTFT, against -6 to +12 ms when the layers go after the forward).
"""

from __future__ import annotations

import torch

from pdserve.placement import usable_cores


class ThreadBudget:
    def __init__(self, borrow_threads: int | None, device: torch.device, world_size: int = 1) -> None:
        self.own = torch.get_num_threads()
        # Only a CPU engine of one rank has threads to lend or borrow (parallel ranks pin their own).
        usable = device.type == "cpu" and world_size == 1 and borrow_threads is not None
        self.borrowed = borrow_threads if usable and borrow_threads > self.own else self.own
        self.current = self.own
        self.fills_cores = device.type == "cpu" and self.own >= usable_cores()

    def for_step(self, prefills_here: bool, waiting_for_kv: bool) -> int:
        """Sets and returns the threads of the next forward pass."""
        threads = self.own if prefills_here or waiting_for_kv else self.borrowed
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
        return threads
