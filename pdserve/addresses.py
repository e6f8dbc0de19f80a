"""host:port addresses, IPv6 included: one way to write them and one way to read them."""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger(__name__)


def join_host_port(host: str, port: int) -> str:
    """``[::1]:50051`` for an IPv6 host (gRPC and every peer need the brackets), else ``host:port``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def own_address(ipv6: bool = False) -> str:
    """The address other hosts reach this one by: the source address of the default route (a
    UDP "connect" sends nothing), else what the hostname resolves to. A loopback answer is
    warned about: peers elsewhere would dial themselves."""
    family, probe = (socket.AF_INET6, "2001:db8::1") if ipv6 else (socket.AF_INET, "192.0.2.1")  # documentation ranges
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            address = s.getsockname()[0]
    except OSError:  # no route out: what the hostname resolves to (IPv4 if it has no IPv6)
        address = _resolved(socket.gethostname(), socket.AF_INET6 if ipv6 else socket.AF_INET)
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        log.warning(
            "this host's own address is %s (loopback): workers on other hosts cannot reach it; set --advertise-host",
            address,
        )
    return address


def _resolved(name: str, family: int) -> str:
    try:
        return socket.getaddrinfo(name, None, family)[0][4][0]
    except (OSError, IndexError):
        return socket.gethostbyname(name)
