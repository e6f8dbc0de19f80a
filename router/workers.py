"""The router's view of its workers: channels, stubs, load and health."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from pdserve.grpc_server import channel_options
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    channel: grpc.aio.Channel
    prefill_stub: pdserve_pb2_grpc.PrefillWorkerStub | None = None
    decode_stub: pdserve_pb2_grpc.DecodeWorkerStub | None = None
    healthy: bool = True
    inflight: int = 0  # requests this router has on the worker right now
    last_stats: pb.WorkerStats | None = None

    @property
    def load(self) -> float:
        queued = self.last_stats.waiting if self.last_stats else 0
        return self.inflight + queued


@dataclass
class WorkerRegistry:
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)

    @classmethod
    def connect(cls, prefill_addresses: list[str], decode_addresses: list[str]) -> "WorkerRegistry":
        registry = cls()
        for address in prefill_addresses:
            channel = grpc.aio.insecure_channel(address, options=channel_options())
            registry.prefill.append(Worker(address, Role.PREFILL, channel, prefill_stub=pdserve_pb2_grpc.PrefillWorkerStub(channel)))
        for address in decode_addresses:
            channel = grpc.aio.insecure_channel(address, options=channel_options())
            registry.decode.append(Worker(address, Role.DECODE, channel, decode_stub=pdserve_pb2_grpc.DecodeWorkerStub(channel)))
        return registry

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    async def close(self) -> None:
        for worker in self.all():
            await worker.channel.close()
