"""One KV payload moved by every method side by side (``kv_transfer_bench``'s micro and real
parts, and the profiler's KV cost): a synthetic cache of a given geometry, block ids in order or
shuffled, and the median GB/s of each method over interleaved samples."""

from __future__ import annotations

import gc
import random
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.bench.kv_links import MemcpyLink, RawSocketLink, RawUcxLink, TransportLink, layer_checksums
from pdserve.engine.host_memory import host_zeros
from pdserve.engine.kv_cache import KVLayout
from pdserve.kvtransfer.handshake import PeerInfo, host_id
from pdserve.kvtransfer.integrity import checksum
from pdserve.kvtransfer.layout import KVCacheView

MIB = 1 << 20
MAX_SAMPLE_MULTIPLIER = 8  # small payloads get more samples: repeats x min(8, 64 MiB / size)


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    @property
    def token_bytes(self) -> int:
        return self.layout().token_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def tokens_for(self, nbytes: int) -> int:
        return max(1, round(nbytes / (self.num_layers * self.token_bytes)))


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Position-dependent bytes (a misplaced run shows up), cheap to make for 256 MiB."""
    words = buf.view(np.uint32)
    words[:] = np.arange(words.size, dtype=np.uint32)
    words *= np.uint32(2654435761)
    words ^= np.uint32((seed * 0x9E3779B1) & 0xFFFFFFFF)


def host_view(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).reshape(-1).numpy()


def block_ids(count: int, arrangement: str, seed: int) -> list[int]:
    ids = list(range(count))
    if arrangement == "shuffled":
        random.Random(seed).shuffle(ids)
    return ids


def synthetic_peer(geometry: Geometry, transport: str, role: str) -> PeerInfo:
    return PeerInfo(
        model_fingerprint="kv-transfer-bench",
        dtype=geometry.dtype_name,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        block_size=geometry.block_size,
        transports=(transport,),
        host_id=host_id(),
        role=role,
        token_bytes=geometry.token_bytes,
    )


# -- throughput of one payload, every method ------------------------------------------------------------


def measure_payload(
    label: str,
    geometry: Geometry,
    num_tokens: int,
    samples: int,
    transports: list[str],
    arrangement: str,
    seed: int,
    ucx_pair,
    in_process: bool = False,
) -> dict:
    layout = geometry.layout()
    nblocks = -(-num_tokens // geometry.block_size)
    nbytes = num_tokens * geometry.num_layers * geometry.token_bytes

    src_tensor = host_zeros(layout.shape(nblocks), geometry.dtype)  # as a prefill engine allocates its cache
    fill_pattern(host_view(src_tensor), seed)
    src = KVCacheView(list(src_tensor.unbind(0)), geometry.block_size, geometry.token_bytes)
    src_blocks = block_ids(nblocks, arrangement, seed)
    dst_blocks = block_ids(nblocks, arrangement, seed + 1)
    src_sums = layer_checksums(src, src_blocks, num_tokens)

    flat_src = np.empty(nbytes, dtype=np.uint8)
    fill_pattern(flat_src, seed)
    flat_dst = np.zeros(nbytes, dtype=np.uint8)
    flat_sum = checksum(flat_src)

    links: list = [MemcpyLink(flat_src, flat_dst, flat_sum)]
    try:
        links.append(RawSocketLink(flat_src, flat_dst, flat_sum))
        if "ucx" in transports:
            links.append(RawUcxLink(flat_src, flat_dst, flat_sum, ucx_pair))
        for transport in transports:
            links.append(
                TransportLink(
                    transport,
                    layout,
                    src,
                    src_blocks,
                    dst_blocks,
                    num_tokens,
                    src_sums,
                    synthetic_peer(geometry, transport, "decode"),
                    synthetic_peer(geometry, transport, "prefill"),
                    ucx_pair,
                    in_process,
                )
            )
        for link in links:  # warm-up: connection, page tables, caches; not timed
            link.sample()
        times: dict[str, list[float]] = {link.name: [] for link in links}
        for i in range(samples):
            shift = i % len(links)  # rotate the order so no method always runs first
            for link in links[shift:] + links[:shift]:
                times[link.name].append(link.sample())
    finally:
        for link in links:
            link.close()
        del links
        gc.collect()

    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {
        "label": label,
        "bytes": nbytes,
        "num_tokens": num_tokens,
        "dtype": geometry.dtype_name,
        "num_layers": geometry.num_layers,
        "token_bytes": geometry.token_bytes,
        "block_size": geometry.block_size,
        "block_arrangement": arrangement,
        "samples": samples,
        "seconds_median": seconds,
        "gbps": gbps,
        "gbps_min_max": {name: [nbytes / max(ts) / 1e9, nbytes / min(ts) / 1e9] for name, ts in times.items()},
        "ratios": ratios(gbps),
    }


def ratios(gbps: dict[str, float]) -> dict[str, float]:
    out = {}
    if "tcp" in gbps:
        out["tcp_vs_raw_socket"] = gbps["tcp"] / gbps["raw_socket"]
    if "shm" in gbps:
        out["shm_vs_memcpy"] = gbps["shm"] / gbps["memcpy"]
    if "ucx" in gbps:
        out["ucx_vs_raw_socket"] = gbps["ucx"] / gbps["raw_socket"]
        out["ucx_vs_raw_ucx"] = gbps["ucx"] / gbps["raw_ucx"]
        if "tcp" in gbps:
            out["ucx_vs_tcp"] = gbps["ucx"] / gbps["tcp"]
    return out


def samples_for(nbytes: int, repeats: int) -> int:
    return repeats * min(MAX_SAMPLE_MULTIPLIER, max(1, (64 * MIB) // max(1, nbytes)))
