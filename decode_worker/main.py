"""The decode worker process: engine thread (its cache in the chosen transport's pool), KV
receiver, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.addresses import join_host_port
from pdserve.decode_worker.servicer import DecodeService
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import pick_device
from pdserve.engine.parallel.rank_caches import handoff_shards
from pdserve.grpc_server import start_server
from pdserve.kvtransfer import registry
from pdserve.kvtransfer.fingerprint import model_fingerprint
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.handshake import local_peer_info
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.transport_api import PoolUnavailable
from pdserve.kvtransfer.ucx_worker import UcxWorker
from pdserve.metrics import WorkerCollector, start_worker_metrics
from pdserve.planner import chunking
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.security import SecuritySettings, TokenAuth, is_loopback
from pdserve.settings import WorkerSettings
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0
ONE_SIDED_QUARANTINE_S = 2.0  # a failed grant's blocks wait this long before reuse when peers write into them
LEASE_CHECK_S = 0.25


async def serve(engine_config: EngineConfig, settings: WorkerSettings, security: SecuritySettings) -> None:
    device = pick_device(engine_config.device)
    transports = registry.offered_transports(settings.kv_transport, device)
    pool_spec, pools = registry.pool_transport(transports), []

    def kv_storage(layout, num_blocks: int):
        if pool_spec is None:
            return None
        try:
            pools.append(pool_spec.load().make_pool(layout, num_blocks, device))
        except PoolUnavailable as e:
            if settings.kv_transport == pool_spec.name:
                raise ValueError(f"--kv-transport {pool_spec.name}: {e}") from None
            log.warning("KV transport %s not offered: %s", pool_spec.name, e)
            return None  # the engine's own memory
        return pools[0]

    def build() -> LLMEngine:
        engine = LLMEngine(engine_config, kv_storage=kv_storage)
        chunking.install(engine, settings.profile, settings.slo_tpot_ms)  # before its first step
        return engine

    loop = await EngineLoop.build(build)
    if pool_spec is not None and not pools:
        transports = tuple(t for t in transports if t != pool_spec.name)
    engine = loop.engine
    role = "colocated" if settings.colocated else "decode"
    public_host = settings.public_host()

    shards = handoff_shards(engine)  # every rank's cache (one, at tensor parallel 1): units land in their heads
    one_sided = any(registry.get(t).one_sided for t in transports)
    ledger = GrantLedger(
        shards.layout.num_layers,
        shards.token_bytes,
        lease_s=settings.kv_lease_s,
        quarantine_s=ONE_SIDED_QUARANTINE_S if one_sided else 0.0,
    )
    ucx = UcxWorker(loopback_only=is_loopback(settings.host)) if "ucx" in transports else None
    fingerprint = await asyncio.to_thread(model_fingerprint, engine.model_dir, engine_config.cache_dir)
    peer = local_peer_info(
        fingerprint,
        engine.kv_layout,
        weights=engine.weights_id,
        role=role,
        transports=transports,
        extra=pools[0].describe() if pools else {},
        tp_size=shards.tp_size,
    )
    cache = KVCacheView(shards.layers, engine.config.block_size, shards.token_bytes)
    security.warn_if_open("decode", settings.host)
    receiver = KVReceiver(
        ledger,
        cache,
        peer,
        settings.host,
        settings.kv_port,
        ucx=ucx,
        secret=security.cluster_secret,
    )
    receiver.start()
    kv_address = join_host_port(public_host, receiver.port)

    service = DecodeService(
        loop, ledger, kv_address, role, address="", max_queued_requests=settings.max_queued_requests
    )
    metrics_address = start_worker_metrics(  # first: a taken port fails before the gRPC server runs
        settings.metrics_port, settings.host, public_host, WorkerCollector(role, loop.stats, ledger.counters.snapshot)
    )
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s)],
        ["DecodeWorker"],
        settings.host,
        settings.port,
        credentials=security.server_credentials(),
        interceptors=[TokenAuth(security.cluster_token, ["pdserve.v1.DecodeWorker"])],
    )
    service.address = join_host_port(public_host, server.port)
    reaper = asyncio.create_task(_expire_leases(ledger))
    log.info(
        "%s worker serving on %s, KV transfer on %s (transports: %s)",
        role,
        service.address,
        kv_address,
        ", ".join(transports),
    )
    announce_ready(role, grpc=service.address, kv=kv_address, metrics=metrics_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper
    await server.stop(SHUTDOWN_GRACE_S)
    receiver.stop()
    if ucx is not None:
        ucx.close()
    await loop.stop()
    engine.close()
    for pool in pools:
        pool.close()


async def _expire_leases(ledger: GrantLedger) -> None:
    while True:
        await asyncio.sleep(LEASE_CHECK_S)
        ledger.reap_expired()
