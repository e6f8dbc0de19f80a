"""What every rank of a parallel worker does alike: set up (model shard, cache), then run steps.

Set-up is a fixed sequence of collectives on the control group, the same on every rank:

1. rank 0 broadcasts the engine settings and the model folder;
2. each rank loads its shard; all report success or the error (rank 0 raises it);
3. all agree on the number of KV blocks (the smallest any rank can hold);
4. on CPU, rank 0 creates the shared segment of every rank's cache and broadcasts its name,
   the others map it; on GPUs each rank allocates its own.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_cache import KVCache, KVLayout, num_blocks_for_budget
from pdserve.engine.loader import load_model, parse_dtype
from pdserve.engine.model import LayerHook
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.groups import RankGroups
from pdserve.engine.parallel.pipeline import PipelineStage
from pdserve.engine.parallel.rank_caches import KVShards, SharedSegment, rank_cache, shard_layout
from pdserve.engine.parallel.sharding import ModelShard
from pdserve.kernels import select_backend

log = logging.getLogger(__name__)


def _broadcast(obj, groups: RankGroups):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=groups.control)
    return box[0]


class RankRuntime:
    def __init__(self, groups: RankGroups, config: EngineConfig | None = None, model_dir: str | None = None) -> None:
        """Rank 0 passes ``config`` and ``model_dir``; the others receive them."""
        self.groups = groups
        settings = _broadcast((dataclasses.asdict(config), model_dir) if groups.rank == 0 else None, groups)
        self.config, self.model_dir = EngineConfig(**settings[0]), settings[1]
        self.model_config = ModelConfig.from_folder(self.model_dir)
        layout = groups.layout
        self.shard = ModelShard(layout, groups.rank, self.model_config)
        self.dtype = parse_dtype(self.config.dtype, groups.device)
        whole = KVLayout.for_model(self.model_config, self.config.block_size, self.dtype, self.config.kv_cache_dtype)
        self.shard_layout = shard_layout(whole, layout.tp)  # every rank's caches as shard layers
        self.local_layout = dataclasses.replace(self.shard_layout, num_layers=len(self.shard.layers))
        self.model = None
        error = None
        try:
            backend = select_backend(groups.device, self.config.attention_backend, self.local_layout.format)
            self.model = load_model(
                self.model_dir, self.dtype, groups.device, backend, self.config.quantization, self.shard
            )
            self.shard.wrap(self.model, groups)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            log.exception("rank %d could not load its shard", groups.rank)
            error = f"rank {groups.rank}: {type(e).__name__}: {e}"
        errors = [None] * layout.world_size
        dist.all_gather_object(errors, error, group=groups.control)
        failed = [e for e in errors if e]
        if failed:
            raise RuntimeError(f"the worker's ranks could not load the model: {'; '.join(failed)}")
        self.pipeline = None
        self.kv_cache: KVCache | None = None
        self.segment: SharedSegment | None = None
        self.shards: KVShards | None = None

    def allocate_cache(self, kv_storage=None) -> None:
        """Steps 3 and 4. ``kv_storage(layout, num_blocks)`` (rank 0, CPU) may supply the shared
        segment: an object with ``tensor`` and ``name`` (the decode worker's shm pool)."""
        groups, layout, device = self.groups, self.groups.layout, self.groups.device
        on_cpu = device.type == "cpu"
        if on_cpu:  # one budget for the whole worker, on the machine's memory
            mine = (
                num_blocks_for_budget(self.shard_layout, self.config.kv_cache_memory, device)
                if groups.rank == 0
                else 2**62
            )
        else:
            mine = num_blocks_for_budget(self.local_layout, self.config.kv_cache_memory, device)
        agreed = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=groups.control)
        num_blocks = int(agreed)
        stage, tp_rank = layout.coords(groups.rank)
        if on_cpu:
            nbytes = self.shard_layout.num_layers * num_blocks * self.shard_layout.block_bytes
            if groups.rank == 0:
                storage = kv_storage(self.shard_layout, num_blocks) if kv_storage else None
                if storage is not None and not isinstance(getattr(storage, "name", None), str):
                    raise ValueError("a parallel worker's KV cache must be shared memory its ranks can map")
                self.segment = None if storage is not None else SharedSegment.create(nbytes)
                name = storage.name if storage is not None else self.segment.name
                everything = (
                    storage.tensor if storage is not None else self.segment.tensor(self.shard_layout, num_blocks)
                )
                _broadcast(name, groups)
            else:
                self.segment = SharedSegment(_broadcast(None, groups), nbytes, create=False)
                everything = self.segment.tensor(self.shard_layout, num_blocks)
            mine_view = rank_cache(everything, layout.tp, tp_rank, self.shard.layers)
            self.shards = KVShards(list(everything.unbind(0)), self.shard_layout, layout.tp)
            self.kv_cache = KVCache(self.local_layout, num_blocks, device, mine_view)
        else:  # each GPU holds its own; the KV handoff of a multi-GPU worker is not wired yet
            self.kv_cache = KVCache(self.local_layout, num_blocks, device)
        if layout.pp > 1:
            self.pipeline = PipelineStage(self.model, self.shard, groups, self.kv_cache.layers, self.dtype)
        dist.barrier(group=groups.control)

    @torch.inference_mode()
    def execute(
        self,
        batch: ForwardBatch,
        num_micro_batches: int,
        layer_hook: LayerHook | None = None,
        report_layers: bool = False,
    ) -> torch.Tensor | None:
        """This rank's part of a step; the logits on rank 0."""
        if self.pipeline is not None:
            return self.pipeline.run(batch, num_micro_batches, layer_hook, report_layers)
        return self.model(batch, self.kv_cache.layers, layer_hook)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
