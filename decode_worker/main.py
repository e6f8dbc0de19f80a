"""The decode worker process: engine thread, KV receiver and server, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch

from pdserve.decode_worker.servicer import DecodeService
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import pick_device
from pdserve.grpc_server import start_server
from pdserve.metrics import WorkerCollector, start_worker_metrics
from pdserve.planner import chunking
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.negotiate import local_transports
from pdserve.kvtransfer.peer import local_peer_info
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.server import KVServer
from pdserve.kvtransfer.shm import SharedKVPool, remove_stale_segments
from pdserve.kvtransfer.ucx import UcxWorkerThread
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.security import SecuritySettings, TokenAuth
from pdserve.settings import WorkerSettings
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0
ONE_SIDED_QUARANTINE_S = 2.0


class _PoolFactory:
    """Puts the KV cache where peers can write into it directly, when a transport needs that."""

    def __init__(self, transports: tuple[str, ...], device: torch.device) -> None:
        self.transports, self.device, self.pool = transports, device, None

    def __call__(self, layout: KVLayout, num_blocks: int) -> torch.Tensor | None:
        if "cuda_ipc" in self.transports:
            from pdserve.kvtransfer.cuda_ipc import CudaIpcPool

            self.pool = CudaIpcPool(layout, num_blocks, self.device)
        elif "shm" in self.transports:
            remove_stale_segments()
            self.pool = SharedKVPool(layout, num_blocks)
        return self.pool.tensor if self.pool else None

    def describe(self) -> dict:
        return self.pool.describe() if self.pool else {}

    def close(self) -> None:
        if self.pool is not None and hasattr(self.pool, "close"):
            self.pool.close()


async def serve(engine_config: EngineConfig, settings: WorkerSettings, security: SecuritySettings) -> None:
    device = pick_device(engine_config.device)
    transports = local_transports(settings.kv_transport, device)
    pools = _PoolFactory(transports, device)
    engine = await asyncio.to_thread(LLMEngine, engine_config, kv_storage=pools)
    chunking.install(engine, settings.profile, settings.slo_tpot_ms)  # before the engine thread starts
    loop = EngineLoop(engine)
    loop.start()
    role = "colocated" if settings.colocated else "decode"
    public_host = settings.public_host()

    one_sided = any(t in transports for t in ("shm", "cuda_ipc"))
    receiver = KVReceiver(
        CacheLayers(engine.kv_cache.layers, engine.config.block_size), asyncio.get_running_loop(),
        engine.free_blocks, lease_s=settings.kv_lease_s, quarantine_s=ONE_SIDED_QUARANTINE_S if one_sided else 0.0,
    )
    ucx = UcxWorkerThread() if "ucx" in transports else None
    extra = {**pools.describe(), **({"ucx_address": ucx.address.hex()} if ucx else {})}
    peer = local_peer_info(engine.model_dir, engine.kv_layout, role=role, transports=transports, extra=extra,
                           auth_token=security.cluster_token or "")
    kv_server = KVServer(receiver, peer, settings.host, settings.kv_port, max_tokens=engine.max_model_len, ucx=ucx)
    kv_server.start()
    kv_address = f"{public_host}:{kv_server.port}"

    service = DecodeService(loop, receiver, kv_address, role, address="", max_queued_requests=settings.max_queued_requests)
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s)], ["DecodeWorker"],
        settings.host, settings.port, credentials=security.server_credentials(),
        interceptors=[TokenAuth(security.cluster_token, ["pdserve.v1.DecodeWorker"])],
    )
    service.address = f"{public_host}:{server.port}"
    reaper = asyncio.create_task(_reap(receiver))
    metrics_address = start_worker_metrics(
        settings.metrics_port, settings.host, public_host, WorkerCollector(role, engine.stats, lambda: receiver.counters))
    log.info("%s worker serving on %s, KV transfer on %s (transports: %s)", role, service.address, kv_address, ", ".join(transports))
    announce_ready(role, grpc=service.address, kv=kv_address, metrics=metrics_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper
    await server.stop(SHUTDOWN_GRACE_S)
    kv_server.stop()
    if ucx is not None:
        ucx.close()
    await loop.stop()
    pools.close()


async def _reap(receiver: KVReceiver) -> None:
    while True:
        await asyncio.sleep(1.0)
        receiver.reap_expired()
