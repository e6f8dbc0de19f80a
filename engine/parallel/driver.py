"""Rank 0 of a tensor/pipeline-parallel worker: starts the other ranks and drives every step.

The engine keeps running on rank 0 as at TP 1: its scheduler, block manager and KV connector
see one cache and one model. The driver stands in for the model in the model runner: each call
broadcasts the step's batch to every rank, runs rank 0's share, and returns the logits that
rank 0 samples from. The ranks are started here (one process each, pinned to disjoint cores
when there are enough) unless a launcher such as torchrun started them already (RANK and
WORLD_SIZE in the environment).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model import LayerHook
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.groups import (
    RankGroups,
    destroy_groups,
    init_groups,
    pin_process,
    rank_device,
    split_cores,
)
from pdserve.engine.parallel.layout import ParallelLayout
from pdserve.engine.parallel.rank_runtime import RankRuntime
from pdserve.engine.parallel.step_channel import Message, Op, StepChannel
from pdserve.engine.parallel.supervisor import RankSupervisor, stop_worker
from pdserve.placement import usable_cores

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300.0
HELLO_KEY = "pdserve/rank-started/{}"
DEATH_GRACE_S = 1.0  # after a failed step, how long to look for the rank that died (to name it)


@dataclass
class StepTimes:
    """Rank 0's wall time in steps and in communication (waits for the other ranks included)."""

    steps: int = 0
    seconds: float = 0.0
    comm_seconds: float = 0.0


def launched_externally() -> bool:
    """Whether a launcher (torchrun) started every rank: then none is started here."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "PDSERVE_SPAWNED" not in os.environ


def rank_threads(config: EngineConfig, cores: list[int] | None, world: int) -> int:
    if cores:
        return len(cores)
    return max(1, (config.num_threads or usable_cores()) // world)


class ParallelDriver:
    def __init__(self, config: EngineConfig, model_dir: str, base_device: torch.device, kv_storage=None) -> None:
        self.layout = layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        layout.check(ModelConfig.from_folder(model_dir))  # before any rank starts: a clear error naming the setting
        device = rank_device(base_device, 0)
        self.supervisor: RankSupervisor | None = None
        self.runtime: RankRuntime | None = None
        # This process's cores and torch threads before rank 0 was pinned: close() gives them back
        # (an engine closed in a longer-lived process must not leave it on one core).
        self._unpinned = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        store = None
        if launched_externally():
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != layout.world_size:
                raise ValueError(
                    f"the launcher's WORLD_SIZE {os.environ['WORLD_SIZE']} must equal tensor_parallel_size x "
                    f"pipeline_parallel_size = {layout.world_size}, and RANK 0 must be the worker"
                )
        try:
            if not launched_externally():
                store = self._start_ranks(config, device)
            self.groups: RankGroups = init_groups(layout, 0, device, store)
            self.runtime = RankRuntime(self.groups, config, model_dir)
            self.runtime.allocate_cache(kv_storage)
        except BaseException:
            self._release()  # a failed start leaves this process as it found it
            raise
        self.channel = StepChannel(self.groups.control, device)
        self.times = StepTimes()
        self.on_broken = stop_worker  # what a failed step does (tests replace it)
        if self.supervisor is not None:
            self.supervisor.serving = True
        log.info(
            "parallel worker up: tensor parallel %d x pipeline parallel %d, %d ranks%s",
            layout.tp,
            layout.pp,
            layout.world_size,
            f" (pids {self.supervisor.pids})" if self.supervisor else "",
        )

    def _start_ranks(self, config: EngineConfig, device: torch.device):
        world = self.layout.world_size
        cores = split_cores(sorted(os.sched_getaffinity(0)), world)
        if cores is None:
            log.warning(
                "%d ranks on %d cores: ranks are not pinned (they would not get disjoint cores)",
                world,
                len(os.sched_getaffinity(0)),
            )
        else:
            pin_process(cores[0])
        threads = rank_threads(config, cores[0] if cores else None, world)
        torch.set_num_threads(threads)
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
        )
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "PDSERVE_SPAWNED": "1",
            "GLOO_SOCKET_IFNAME": os.environ["GLOO_SOCKET_IFNAME"],
            "PDSERVE_RANK_LAYOUT": f"{self.layout.tp},{self.layout.pp}",
            "PDSERVE_RANK_DEVICE": str(device),
            "PDSERVE_RANK_THREADS": str(threads),
            "PDSERVE_LOG_LEVEL": logging.getLevelName(logging.getLogger("pdserve").getEffectiveLevel()),
        }
        self.supervisor = RankSupervisor(world, env, cores)
        self.supervisor.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        hellos = [HELLO_KEY.format(rank) for rank in range(1, world)]
        while not store.check(hellos):  # every rank reached us; meanwhile, watch that they are alive
            if self.supervisor.failure:
                raise RuntimeError(self.supervisor.failure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker's ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        return store

    # -- the model runner's model ---------------------------------------------------------------
    def __call__(
        self, batch: ForwardBatch, kv_layers: list[torch.Tensor], layer_hook: LayerHook | None = None
    ) -> torch.Tensor:
        """One step on every rank; ``kv_layers`` is rank 0's cache, which the runtime holds already."""
        started, comm = time.perf_counter(), self.groups.comm.seconds
        op = Op.STEP_SAVING if layer_hook is not None else Op.STEP
        try:
            with self.groups.comm.timed():
                self.channel.send(Message(op, batch, self.layout.pp))
            logits = self.runtime.execute(batch, self.layout.pp, layer_hook)
        except Exception as e:
            self._step_failed(e)
            raise
        self.times.steps += 1
        self.times.seconds += time.perf_counter() - started
        self.times.comm_seconds += self.groups.comm.seconds - comm
        return logits

    def _step_failed(self, error: Exception) -> None:
        """A step that fails leaves the ranks out of step for good (some may wait in a collective
        that never completes): the worker stops, so that the router moves its requests, instead
        of failing them. The rank that died is named when it is seen in time."""
        dead = self.supervisor.wait_for_death(DEATH_GRACE_S) if self.supervisor is not None else None
        if dead is not None:
            self.supervisor.report_death(*dead)
        else:
            self.on_broken(f"a step failed on rank 0 ({type(error).__name__}: {error})")

    @property
    def model(self):
        return self.runtime.model

    @property
    def kv_cache(self):
        return self.runtime.kv_cache

    @property
    def kv_shards(self):
        return self.runtime.shards

    def rank_comm_stats(self) -> list[dict]:
        """Every rank's communication counters (a collective: call between steps)."""
        self.channel.send(Message(Op.STATS))
        stats = [None] * self.layout.world_size
        dist.gather_object(self.groups.comm.snapshot(), stats, dst=0, group=self.groups.control)
        return stats

    def close(self) -> None:
        try:
            self.channel.send(Message(Op.STOP))
        except RuntimeError as e:  # a rank is gone already
            log.info("could not tell every rank to stop: %s", e)
        self._release()

    def _release(self) -> None:
        """Stops the ranks and the process group, and gives this process its cores back."""
        if self.supervisor is not None:
            self.supervisor.close()
        if self.runtime is not None:
            self.runtime.close()
        destroy_groups()
        cores, threads = self._unpinned
        pin_process(cores)
        torch.set_num_threads(threads)
