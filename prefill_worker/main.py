"""The prefill worker process: engine thread, KV shipping, gRPC server."""

from __future__ import annotations

import asyncio
import logging

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import pick_device
from pdserve.grpc_server import start_server
from pdserve.metrics import WorkerCollector, start_worker_metrics
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.negotiate import local_transports
from pdserve.kvtransfer.peer import local_peer_info
from pdserve.kvtransfer.sender import KVConnections
from pdserve.kvtransfer.ucx import UcxWorkerThread
from pdserve.prefill_worker.kv_shipper import KVShipper
from pdserve.prefill_worker.servicer import PrefillService
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.security import SecuritySettings, TokenAuth
from pdserve.settings import WorkerSettings
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


async def serve(engine_config: EngineConfig, settings: WorkerSettings, security: SecuritySettings) -> None:
    transports = local_transports(settings.kv_transport, pick_device(engine_config.device))
    engine = await asyncio.to_thread(LLMEngine, engine_config)
    shipper = KVShipper()
    engine.on_forward = shipper.on_forward
    loop = EngineLoop(engine)
    loop.start()

    ucx = UcxWorkerThread() if "ucx" in transports else None
    peer = local_peer_info(engine.model_dir, engine.kv_layout, role="prefill", transports=transports,
                           auth_token=security.cluster_token or "")
    connections = KVConnections(peer, CacheLayers(engine.kv_cache.layers, engine.config.block_size), ucx=ucx)
    service = PrefillService(loop, connections, shipper, ack_timeout_s=settings.kv_lease_s,
                             max_queued_requests=settings.max_queued_requests)
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_PrefillWorkerServicer_to_server(service, s)], ["PrefillWorker"],
        settings.host, settings.port, credentials=security.server_credentials(),
        interceptors=[TokenAuth(security.cluster_token, ["pdserve.v1.PrefillWorker"])],
    )
    public_host = settings.public_host()
    service.address = f"{public_host}:{server.port}"
    metrics_address = start_worker_metrics(
        settings.metrics_port, settings.host, public_host, WorkerCollector("prefill", engine.stats, lambda: service.counters))
    log.info("prefill worker serving on %s (KV transports offered: %s)", service.address, ", ".join(transports))
    announce_ready("prefill", grpc=service.address, metrics=metrics_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    await server.stop(SHUTDOWN_GRACE_S)
    connections.close()
    if ucx is not None:
        ucx.close()
    await loop.stop()
