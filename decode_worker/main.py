"""The decode worker process: engine thread, KV receiver, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.grpc_server import start_server
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.peer import local_peer_info
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.tcp import TcpKVServer
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.settings import WorkerSettings
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.decode_worker.servicer import DecodeService

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


async def serve(engine_config: EngineConfig, settings: WorkerSettings) -> None:
    engine = await asyncio.to_thread(LLMEngine, engine_config)
    loop = EngineLoop(engine)
    loop.start()
    role = "colocated" if settings.colocated else "decode"
    public_host = settings.advertise_host or settings.host

    receiver = KVReceiver(
        CacheLayers(engine.kv_cache.layers, engine.config.block_size), asyncio.get_running_loop(),
        engine.free_blocks, lease_s=settings.kv_lease_s,
    )
    peer = local_peer_info(engine.model_dir, engine.kv_layout, role=role, transports=("tcp",))
    kv_server = TcpKVServer(receiver, peer, settings.host, settings.kv_port, max_tokens=engine.max_model_len)
    kv_server.start()
    kv_address = f"{public_host}:{kv_server.port}"

    service = DecodeService(loop, receiver, kv_address, role, address="")
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s)], ["DecodeWorker"],
        settings.host, settings.port,
    )
    service.address = f"{public_host}:{server.port}"
    reaper = asyncio.create_task(_reap(receiver))
    log.info("%s worker serving on %s, KV transfer on %s", role, service.address, kv_address)
    announce_ready(role, grpc=service.address, kv=kv_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper
    await server.stop(SHUTDOWN_GRACE_S)
    kv_server.stop()
    await loop.stop()


async def _reap(receiver: KVReceiver) -> None:
    while True:
        await asyncio.sleep(1.0)
        receiver.reap_expired()
