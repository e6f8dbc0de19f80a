"""The prefill side's connections to decode workers, one per address, reopened when broken."""

from __future__ import annotations

import logging
import threading

from pdserve.kvtransfer.client import KVConnection
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.peer import PeerInfo

log = logging.getLogger(__name__)


class KVConnections:
    def __init__(self, local: PeerInfo, cache: CacheLayers, ucx=None, faults: FaultPlan | None = None) -> None:
        self.local = local
        self.cache = cache
        self.ucx = ucx
        self.faults = faults or FaultPlan.from_env()
        self._conns: dict[str, KVConnection] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> KVConnection:
        """A live, handshaken connection (blocking; run it off the event loop). Raises HandshakeError or OSError."""
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and conn.broken is None:
                return conn
            if conn is not None:
                log.info("KV connection to %s was lost (%s); reconnecting", address, conn.broken)
            conn = KVConnection(address, self.local, self.cache, ucx=self.ucx, faults=self.faults)
            self._conns[address] = conn
            log.info("KV connection to %s open (transport %s)", address, conn.name)
            return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
