"""Which KV transports this process offers, and which one two peers use.

Each side advertises what it can do in the handshake; the prefill side picks the best
common transport and the decode side checks the pick. Order: CUDA IPC (GPUs of one node),
then UCX (RDMA, or shared memory/CMA as UCX decides), then our own shared memory (one host),
then TCP (always there). A forced transport that is not available fails at start.
"""

from __future__ import annotations

import logging

import torch

from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.shm import shm_supported
from pdserve.kvtransfer.ucx import ucx_available, ucx_unavailable_reason

log = logging.getLogger(__name__)

TRANSPORTS = ("cuda_ipc", "ucx", "shm", "tcp")  # best first
SAME_HOST_ONLY = ("cuda_ipc", "shm")


def cuda_ipc_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "CUDA IPC moves KV between GPUs; this worker's cache is on the CPU"
    try:
        import cupy
    except ImportError:
        return False, "CUDA IPC needs cupy: pip install 'pdserve[cuda]'"
    try:
        if not cupy.cuda.is_available():
            return False, "cupy sees no CUDA device"
    except Exception as e:  # noqa: BLE001 - cupy raises CUDARuntimeError and friends
        return False, f"cupy cannot use CUDA: {e}"
    return True, ""


def local_transports(requested: str, device: torch.device) -> tuple[str, ...]:
    """The transports to offer; raises ValueError when a forced one is unavailable."""
    if requested not in ("auto", *TRANSPORTS):
        raise ValueError(f"kv_transport must be auto or one of {', '.join(TRANSPORTS)}, got {requested!r}")
    reasons: dict[str, str] = {}
    offered = []
    ok, reason = cuda_ipc_available(device)
    (offered.append("cuda_ipc") if ok else reasons.__setitem__("cuda_ipc", reason))
    if ucx_available():
        offered.append("ucx")
    else:
        reasons["ucx"] = ucx_unavailable_reason()
    if device.type == "cpu" and shm_supported():
        offered.append("shm")
    else:
        reasons["shm"] = "shared memory needs a CPU KV cache and a writable /dev/shm"
    offered.append("tcp")
    if requested == "auto":
        if "ucx" not in offered:
            log.info("KV transfer: UCX unavailable (%s); using the other transports", reasons["ucx"])
        return tuple(offered)
    if requested not in offered:
        raise ValueError(f"kv transport {requested!r} is not available here: {reasons[requested]}")
    return (requested,)


def choose(local: PeerInfo, remote: PeerInfo) -> str:
    """The best transport both offer (same-host ones only on one host)."""
    same_host = local.host_id == remote.host_id and bool(local.host_id)
    for name in TRANSPORTS:
        if name in local.transports and name in remote.transports and (same_host or name not in SAME_HOST_ONLY):
            return name
    where = "on one host" if same_host else "across hosts"
    raise HandshakeError(
        f"no common KV transport {where}: this side offers {', '.join(local.transports)}, "
        f"the peer offers {', '.join(remote.transports)}"
    )
