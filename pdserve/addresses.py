"""host:port addresses, IPv6 included: one way to write them and one way to read them."""

from __future__ import annotations


def join_host_port(host: str, port: int) -> str:
    """``[::1]:50051`` for an IPv6 host (gRPC and every peer need the brackets), else ``host:port``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
