"""A follower rank of a parallel worker: loads its shard, then runs whatever rank 0 broadcasts.

Started by the worker (``python -m pdserve.engine.parallel.rank_main``, with the torchrun-style
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or by torchrun itself
running the worker's own command line (``pdserve prefill|decode`` calls ``follow`` on ranks
above 0). It exits when rank 0 says STOP, and with an error when rank 0 goes away.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.parallel.driver import HELLO_KEY, STARTUP_TIMEOUT_S
from pdserve.engine.parallel.groups import destroy_groups, init_groups, pin_process, rank_device
from pdserve.engine.parallel.layout import ParallelLayout
from pdserve.engine.parallel.rank_runtime import RankRuntime
from pdserve.engine.parallel.step_channel import Op, StepChannel

log = logging.getLogger("pdserve.engine.parallel.rank_main")  # not __main__: it runs as one


def follow(layout: ParallelLayout, base_device: torch.device) -> int:
    """Runs this process as rank ``RANK`` (> 0) until rank 0 says STOP; returns the exit code."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if int(os.environ["WORLD_SIZE"]) != layout.world_size:
        raise ValueError(
            f"WORLD_SIZE {os.environ['WORLD_SIZE']} must equal tensor_parallel_size x pipeline_parallel_size "
            f"= {layout.world_size}"
        )
    store = None
    if os.environ.get("PDSERVE_SPAWNED"):
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            layout.world_size,
            is_master=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        store.set(HELLO_KEY.format(rank), str(os.getpid()))
    device = rank_device(base_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_groups(layout, rank, device, store)
    runtime = RankRuntime(groups)
    runtime.allocate_cache()
    channel = StepChannel(groups.control, device)
    log.info("rank %d (stage %d, tp rank %d) ready on %s", rank, groups.stage, groups.tp_rank, device)
    while True:
        message = channel.receive()
        if message.op is Op.STOP:
            break
        if message.op is Op.STATS:
            dist.gather_object(groups.comm.snapshot(), None, dst=0, group=groups.control)
            continue
        runtime.execute(message.batch, message.num_micro_batches, report_layers=message.op is Op.STEP_SAVING)
    runtime.close()
    destroy_groups()
    return 0


def follow_launcher(config) -> int | None:
    """Under a launcher such as torchrun, a rank above 0 running the worker's command line
    follows instead (returns its exit code); None for the worker itself."""
    from pdserve.engine.loader import pick_device
    from pdserve.engine.parallel.driver import launched_externally

    if not launched_externally() or int(os.environ["RANK"]) == 0:
        return None
    return follow(
        ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size), pick_device(config.device)
    )


def main() -> int:
    from pdserve.process import setup_logging

    setup_logging()
    cores = os.environ.get("PDSERVE_RANK_CORES", "")
    if cores:
        pin_process([int(c) for c in cores.split(",")])
    if os.environ.get("PDSERVE_RANK_THREADS"):
        torch.set_num_threads(int(os.environ["PDSERVE_RANK_THREADS"]))
    tp, pp = (int(x) for x in os.environ["PDSERVE_RANK_LAYOUT"].split(","))
    try:
        return follow(ParallelLayout(tp, pp), torch.device(os.environ.get("PDSERVE_RANK_DEVICE", "cpu")))
    except Exception:  # noqa: BLE001 - rank 0's supervisor sees the exit and takes the worker down
        log.exception("rank %s failed", os.environ.get("RANK"))
        return 1


if __name__ == "__main__":
    sys.exit(main())
