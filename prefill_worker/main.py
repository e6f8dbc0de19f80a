"""The prefill worker process: engine thread, KV sender, gRPC server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from pdserve.addresses import join_host_port
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import pick_device
from pdserve.engine.parallel.rank_caches import handoff_shards
from pdserve.grpc_server import start_server
from pdserve.kvtransfer import registry
from pdserve.kvtransfer.fingerprint import model_fingerprint
from pdserve.kvtransfer.handshake import local_peer_info
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.ucx_worker import UcxWorker
from pdserve.metrics import WorkerCollector, start_worker_metrics
from pdserve.prefill_worker.servicer import PrefillService
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.security import SecuritySettings, TokenAuth, is_loopback
from pdserve.settings import WorkerSettings
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


async def serve(engine_config: EngineConfig, settings: WorkerSettings, security: SecuritySettings) -> None:
    device = pick_device(engine_config.device)
    transports = registry.offered_transports(settings.kv_transport, device)
    # Only the decode pool speculates: a prefill worker samples one token per request.
    engine_config = dataclasses.replace(engine_config, speculative="none")
    loop = await EngineLoop.build(lambda: LLMEngine(engine_config))
    engine = loop.engine

    ucx = UcxWorker(loopback_only=is_loopback(settings.host)) if "ucx" in transports else None
    extra = {}
    for name in transports:  # what the decode side needs to know about us (CUDA IPC: the GPUs we see)
        sender_extra = getattr(registry.get(name).load(), "sender_extra", None)
        extra.update(sender_extra(device) if sender_extra else {})
    fingerprint = await asyncio.to_thread(model_fingerprint, engine.model_dir, engine_config.cache_dir)
    shards = handoff_shards(engine)  # every rank's cache (one, at tensor parallel 1)
    peer = local_peer_info(
        fingerprint,
        engine.kv_layout,
        weights=engine.weights_id,
        role="prefill",
        transports=transports,
        extra=extra,
        tp_size=shards.tp_size,
    )
    cache = KVCacheView(shards.layers, engine.config.block_size, shards.token_bytes)
    security.warn_if_open("prefill", settings.host)
    sender = KVSender(peer, cache, secret=security.cluster_secret, ucx=ucx)
    service = PrefillService(
        loop, sender, lease_s=settings.kv_lease_s, max_queued_requests=settings.max_queued_requests
    )
    public_host = settings.public_host()
    metrics_address = start_worker_metrics(  # first: a taken port fails before the gRPC server runs
        settings.metrics_port,
        settings.host,
        public_host,
        WorkerCollector("prefill", loop.stats, service.counters.snapshot),
    )
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_PrefillWorkerServicer_to_server(service, s)],
        ["PrefillWorker"],
        settings.host,
        settings.port,
        credentials=security.server_credentials(),
        interceptors=[TokenAuth(security.cluster_token, ["pdserve.v1.PrefillWorker"])],
    )
    service.address = join_host_port(public_host, server.port)
    log.info("prefill worker serving on %s (KV transports offered: %s)", service.address, ", ".join(transports))
    announce_ready("prefill", grpc=service.address, metrics=metrics_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    await server.stop(SHUTDOWN_GRACE_S)
    sender.close()
    if ucx is not None:
        ucx.close()
    await loop.stop()
    engine.close()
