"""Every KV transport in one place: its name, where it works, and how its pool is made.

Each transport is one module (``kvtransfer/<name>_transport.py``) implementing both halves:
``Sender`` (prefill side: move one unit, tokens [start, end) of one or more layers) and ``Receiver``
(decode side: land the frames that announce units), plus ``unavailable_reason(device)`` and,
for a transport that writes into the decode worker's memory, ``make_pool``. Adding a transport
is that file and one line in ``TRANSPORTS``.

This module imports nothing heavy (no torch, no ucxx): settings and the router read the
names from here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True, slots=True)
class TransportSpec:
    name: str
    module: str  # the module implementing both halves
    same_host_only: bool  # needs both workers on one machine
    one_sided: bool  # the sender writes into the receiver's memory (failed grants are quarantined)
    pool: str | None  # how the decode worker's KV cache must be allocated for it (None: the engine's own)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


TRANSPORTS: tuple[TransportSpec, ...] = (  # best first: negotiation picks the first both sides offer
    TransportSpec(
        "cuda_ipc",
        "pdserve.kvtransfer.cuda_ipc_transport",
        same_host_only=True,
        one_sided=True,
        pool="a dedicated cudaMalloc exported by IPC handle",
    ),
    TransportSpec("ucx", "pdserve.kvtransfer.ucx_transport", same_host_only=False, one_sided=False, pool=None),
    TransportSpec(
        "shm",
        "pdserve.kvtransfer.shm_transport",
        same_host_only=True,
        one_sided=True,
        pool="a POSIX shared-memory segment",
    ),
    TransportSpec("tcp", "pdserve.kvtransfer.tcp_transport", same_host_only=False, one_sided=False, pool=None),
)
TRANSPORT_NAMES: tuple[str, ...] = tuple(t.name for t in TRANSPORTS)
TRANSPORT_CHOICES: tuple[str, ...] = ("auto", *TRANSPORT_NAMES)  # the --kv-transport setting
_BY_NAME = {t.name: t for t in TRANSPORTS}


def get(name: str) -> TransportSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {name!r}") from None


def offered_transports(requested: str, device) -> tuple[str, ...]:
    """The transports this worker offers (``requested``: auto or one name); raises ValueError,
    with the reason, when a forced one is unavailable here."""
    if requested != "auto":
        get(requested)
    offered, reasons = [], {}
    for spec in TRANSPORTS:
        if requested not in ("auto", spec.name):
            continue
        reason = spec.load().unavailable_reason(device)
        if reason is None:
            offered.append(spec.name)
        else:
            reasons[spec.name] = reason
    if requested != "auto" and not offered:
        raise ValueError(f"kv transport {requested!r} is not available here: {reasons[requested]}")
    if requested == "auto" and "ucx" in reasons:
        import logging

        logging.getLogger(__name__).info(
            "KV transfer: UCX unavailable (%s); using the other transports", reasons["ucx"]
        )
    return tuple(offered)


def pool_transport(offered: tuple[str, ...]) -> TransportSpec | None:
    """The transport whose pool the decode worker's cache lives in (the best offered one that needs a pool)."""
    return next((get(name) for name in offered if get(name).pool is not None), None)
