"""The process groups of one worker's ranks, the collectives the model calls, and their timing.

Three kinds of traffic: the step's batch, broadcast by rank 0 to every rank (``control``: gloo
on CPU memory, no time limit, because an idle worker's followers wait for the next step as
long as it takes); a stage's all-reduces and the logits gather (``tp``: gloo on CPU, NCCL on
GPUs); and the activations handed from stage to stage (point to point on the default group).
Every call is timed into ``comm`` so that benchmarks can say what share of a step it costs.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.parallel.layout import ParallelLayout

COLLECTIVE_TIMEOUT_S = 120.0  # a step's collective that waits this long means a peer is stuck
CONTROL_TIMEOUT = timedelta(days=365)  # followers wait for the next step for as long as the worker idles


@dataclass
class CommTimer:
    """Wall time spent inside communication calls (waiting for peers included)."""

    seconds: float = 0.0
    calls: int = 0
    nbytes: int = 0

    @contextmanager
    def timed(self, nbytes: int = 0):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.nbytes += nbytes

    def snapshot(self) -> dict:
        return {"seconds": self.seconds, "calls": self.calls, "bytes": self.nbytes}


@dataclass
class RankGroups:
    layout: ParallelLayout
    rank: int
    device: torch.device
    control: object  # gloo ProcessGroup over every rank
    tp: object | None  # this rank's stage's TP group (None at tp 1)
    comm: CommTimer = field(default_factory=CommTimer)

    @property
    def stage(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    def tp_root(self) -> int:
        """The global rank of tp rank 0 of this stage (where the stage's logits are gathered)."""
        return self.layout.rank_of(self.stage, 0)

    # -- the model's collectives ------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the stage's TP ranks, in place."""
        with self.comm.timed(tensor.numel() * tensor.element_size()):
            dist.all_reduce(tensor, group=self.tp)
        return tensor

    def gather_to_root(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Each TP rank's ``tensor`` (same shape everywhere), on the stage's tp rank 0 only."""
        root = self.tp_root()
        parts = [torch.empty_like(tensor) for _ in range(self.layout.tp)] if self.rank == root else None
        with self.comm.timed(tensor.numel() * tensor.element_size()):
            dist.gather(tensor, parts, dst=root, group=self.tp)
        return parts

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Starts sending to ``dst``; returns the work to wait for before reusing ``tensor``."""
        with self.comm.timed(tensor.numel() * tensor.element_size()):
            return dist.isend(tensor, dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        with self.comm.timed(tensor.numel() * tensor.element_size()):
            dist.recv(tensor, src, tag=tag)
        return tensor

    def wait(self, works: list) -> None:
        with self.comm.timed():
            for work in works:
                work.wait()


def init_groups(layout: ParallelLayout, rank: int, device: torch.device, store=None) -> RankGroups:
    """Joins the worker's process group (``store``: rank 0's TCPStore; None: the torchrun
    environment, MASTER_ADDR/MASTER_PORT) and makes the sub-groups, on every rank alike."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(
        backend, rank=rank, world_size=layout.world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    own_tp = None
    for stage in range(layout.pp):  # every rank creates every group, in the same order
        ranks = [layout.rank_of(stage, r) for r in range(layout.tp)]
        group = dist.new_group(ranks) if layout.tp > 1 else None
        if rank in ranks:
            own_tp = group
    return RankGroups(layout, rank, device, control, own_tp)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(base: torch.device, local_rank: int) -> torch.device:
    """CPU for every rank on CPU; on GPUs, one device per rank from the configured one up."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + local_rank)


def split_cores(cores: list[int], world: int) -> list[list[int]] | None:
    """Disjoint, equal slices of ``cores`` for ``world`` ranks, or None when there are fewer
    cores than ranks (pinning would then stack ranks on some cores and not others)."""
    if len(cores) < world:
        return None
    per = len(cores) // world
    return [cores[r * per : (r + 1) * per] for r in range(world)]


def pin_process(cores: list[int]) -> None:
    """Pins every thread of this process (and the threads it starts later) to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # a thread that just ended
