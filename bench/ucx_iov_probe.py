"""Can UCX itself move a fragmented KV unit in place? A probe of UCP's scatter-gather (IOV)
datatype beside one contiguous message, between two processes on this host.

pdserve's UCX transport gathers a fragmented unit into one contiguous buffer and scatters it on
arrival, because ucxx's Python API sends and receives contiguous buffers only. UCP itself takes
IOV lists (``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx`` with ``ucp_dt_make_iov()``); this probe
calls them through ctypes on ucxx's own worker and endpoint handles, to measure what in-place
transfers would give before building them:

    python bench/ucx_iov_probe.py [--sizes-mib 16,64] [--block-bytes 12288] [--repeats 5]
    UCX_TLS=sm,self python bench/ucx_iov_probe.py      # UCX's shared-memory transports only
    python bench/ucx_iov_probe.py --rndv-scheme get_zcopy   # the rendezvous IOV sends need

Modes: ``contiguous`` (one buffer to one buffer: what raw UCX does), ``recv-iov`` (the receiver's
blocks shuffled over a cache twice the payload's size, one IOV entry per block), ``send-iov``
(the same on the sender's side), ``both-iov`` (both). With UCX 1.21's default rendezvous an IOV
send never completes over shared memory (and is refused over TCP); ``--rndv-scheme get_zcopy``
(the receiver reads the sender's pieces) moves it. Each mode runs in a fresh pair of processes; a transfer that
does not complete within ``--deadline-s`` is reported as such and ends its mode. Every
completed transfer is verified (CRC32 of the payload in token order, on both sides).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import multiprocessing
import os
import sys
import time
import zlib

import numpy as np

from pdserve.kvtransfer.ucx_worker import ucx_available, ucx_unavailable_reason  # also quiets UCX's env warnings

MODES = ("contiguous", "recv-iov", "send-iov", "both-iov")
RNDV_SCHEMES = ("", "auto", "get_zcopy", "put_zcopy", "get_ppln", "put_ppln", "am", "rkey_ptr")  # UCX 1.21's
UCP_DATATYPE_IOV = 2  # ucp_dt_make_iov()
UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100  # a returned pointer at or above (uintptr_t)UCS_ERR_LAST is an error status
TAG = 7


class RequestParam(ctypes.Structure):  # ucp_request_param_t (UCP API 1.x)
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class Iov(ctypes.Structure):  # ucp_dt_iov_t
    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def load_ucp() -> ctypes.CDLL:
    import libucx  # the wheel ucxx loads its libucp from

    found = glob.glob(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
    if not found:
        raise RuntimeError(f"no libucp.so.0 in the libucx wheel at {os.path.dirname(libucx.__file__)}")
    ucp = ctypes.CDLL(found[0])
    ptr, size, tag = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    ucp.ucp_tag_send_nbx.restype = ucp.ucp_tag_recv_nbx.restype = ptr  # a request, an error or NULL
    ucp.ucp_tag_send_nbx.argtypes = [ptr, ptr, size, tag, ptr]  # endpoint, buffer, count, tag, param
    ucp.ucp_tag_recv_nbx.argtypes = [ptr, ptr, size, tag, tag, ptr]  # worker, buffer, count, tag, mask, param
    ucp.ucp_request_check_status.restype = ctypes.c_int8  # ucs_status_t is a packed enum
    ucp.ucp_request_check_status.argtypes = [ctypes.c_void_p]
    ucp.ucp_request_free.argtypes = [ctypes.c_void_p]
    ucp.ucp_worker_progress.restype = ctypes.c_uint
    ucp.ucp_worker_progress.argtypes = [ctypes.c_void_p]
    return ucp


def shuffled_blocks(num_blocks: int) -> np.ndarray:
    """Which block of a cache twice the payload's size holds each payload block (the same on both sides)."""
    return np.random.default_rng(num_blocks).permutation(2 * num_blocks)[:num_blocks]


def iov_list(cache: np.ndarray, order: np.ndarray, block_bytes: int):
    entries = (Iov * len(order))()
    for i, block in enumerate(order):
        entries[i].buffer, entries[i].length = cache.ctypes.data + int(block) * block_bytes, block_bytes
    return entries


def wait(ucp, worker: int, request, deadline: float) -> str:
    """Progresses until the request completes: 'ok', 'error <status>' or 'timed out'."""
    if request is None:
        return "ok"  # completed at once
    if request >= 2**64 + UCS_ERR_LAST:
        return f"error {request - 2**64}"
    while (status := ucp.ucp_request_check_status(request)) == UCS_INPROGRESS:
        ucp.ucp_worker_progress(worker)
        if time.monotonic() > deadline:
            return "timed out"
    ucp.ucp_request_free(request)
    return "ok" if status == 0 else f"error {status}"


def run_side(
    role: str, pipe, mode: str, mib: int, block_bytes: int, repeats: int, deadline_s: float, rndv_scheme: str, results
):
    from ucxx._lib import libucxx as ucxx

    ucp = load_ucp()
    context = ucxx.UCXContext({"RNDV_SCHEME": rndv_scheme} if rndv_scheme else {})
    worker = ucxx.UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
    pipe.send(worker.address.tobytes())
    peer = ucxx.UCXAddress.create_from_buffer(pipe.recv())
    endpoint = worker.create_endpoint_from_worker_address(peer, False)  # no error handling: shared memory allowed
    num_blocks = (mib << 20) // block_bytes
    nbytes = num_blocks * block_bytes
    scattered = mode in ("both-iov", "send-iov" if role == "send" else "recv-iov")
    order = shuffled_blocks(num_blocks)
    cache = np.zeros(2 * nbytes if scattered else nbytes, dtype=np.uint8)
    if role == "send":
        cache[:] = np.random.default_rng(1).integers(0, 256, cache.size, dtype=np.uint8)
    entries = iov_list(cache, order, block_bytes) if scattered else None
    param = (
        RequestParam(op_attr_mask=UCP_OP_ATTR_FIELD_DATATYPE, datatype=UCP_DATATYPE_IOV)
        if scattered
        else RequestParam()
    )
    buffer, count = (ctypes.addressof(entries), num_blocks) if scattered else (cache.ctypes.data, nbytes)
    param_ptr = ctypes.byref(param)

    def payload_crc() -> int:
        return zlib.crc32(cache.reshape(-1, block_bytes)[order] if scattered else cache)

    times, outcome = [], "ok"
    for _ in range(repeats):
        if role == "recv":
            cache[:] = 0
            request = ucp.ucp_tag_recv_nbx(worker.handle, buffer, count, TAG, 2**64 - 1, param_ptr)
            pipe.send("posted")
            outcome = wait(ucp, worker.handle, request, time.monotonic() + deadline_s)
            pipe.send(outcome)
            pipe.send(payload_crc() if outcome == "ok" else None)  # after the timed part
        else:
            if pipe.recv() != "posted":
                raise RuntimeError("the receiving side is out of step")
            started = time.perf_counter()
            request = ucp.ucp_tag_send_nbx(endpoint.handle, buffer, count, TAG, param_ptr)
            outcome = wait(ucp, worker.handle, request, time.monotonic() + deadline_s)
            if outcome == "ok" and pipe.poll(deadline_s):
                received = pipe.recv()
                times.append(time.perf_counter() - started)
                if received != "ok" or pipe.recv() != payload_crc():
                    outcome = f"receiver: {received}" if received != "ok" else "bytes differ"
            elif outcome == "ok":
                outcome = "receiver timed out"
        if outcome != "ok":
            break
    if role == "send":
        best = min(times) if times and outcome == "ok" else None
        results.put({"mode": mode, "mib": mib, "outcome": outcome, "gb_s": best and round(nbytes / best / 1e9, 2)})
        results.close()
        results.join_thread()  # the queue's feeder thread must flush before _exit
    os._exit(0)  # a stuck request may still be posted: skip UCX's teardown


def probe(mode: str, mib: int, args: argparse.Namespace) -> dict:
    spawn = multiprocessing.get_context("spawn")
    send_end, recv_end = spawn.Pipe()
    results = spawn.Queue()
    common = (mode, mib, args.block_bytes, args.repeats, args.deadline_s, args.rndv_scheme, results)
    sides = [
        spawn.Process(target=run_side, args=("send", send_end, *common), daemon=True),
        spawn.Process(target=run_side, args=("recv", recv_end, *common), daemon=True),
    ]
    for side in sides:
        side.start()
    send_end.close()  # the sides hold the pipe now: one that dies leaves the other an EOF, not a hang
    recv_end.close()
    try:
        return results.get(timeout=args.deadline_s * (args.repeats + 2) + 30)
    except Exception:  # noqa: BLE001 - a side died or hung past every deadline
        return {"mode": mode, "mib": mib, "outcome": "no result", "gb_s": None}
    finally:
        for side in sides:
            side.join(2)
            if side.is_alive():
                side.kill()


def positive_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive whole MiB separated by commas, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes-mib", type=positive_sizes, default="16,64", help="payload sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=12288,
        help="one IOV entry (default: a bf16 block of 16 tokens of the default model)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="transfers per mode and size; the best is reported")
    parser.add_argument("--deadline-s", type=float, default=10.0, help="how long one transfer may take")
    parser.add_argument("--modes", default=",".join(MODES), help="(default: %(default)s)")
    parser.add_argument(
        "--rndv-scheme",
        choices=RNDV_SCHEMES,
        default="",
        help="UCX's RNDV_SCHEME for both sides (default: UCX's own choice)",
    )
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    if not 0 < args.block_bytes <= min(args.sizes_mib) << 20 or args.repeats <= 0 or args.deadline_s <= 0:
        parser.error("--repeats and --deadline-s must be positive, --block-bytes positive and at most a payload")
    if not ucx_available():
        print(ucx_unavailable_reason(), file=sys.stderr)
        return 1
    for mib in args.sizes_mib:
        for mode in modes:
            setting = {"ucx_tls": os.environ.get("UCX_TLS", "default"), "rndv_scheme": args.rndv_scheme or "default"}
            print(json.dumps({**probe(mode, mib, args), **setting}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
