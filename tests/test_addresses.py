"""host:port addresses with IPv6 hosts: written with brackets, read back without."""

from __future__ import annotations

import socket

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.addresses import join_host_port, split_host_port
from pdserve.grpc_server import start_server
from pdserve.router.workers import WorkerRegistry


@pytest.mark.parametrize(
    ("host", "written"),
    [
        ("127.0.0.1", "127.0.0.1:7"),
        ("::1", "[::1]:7"),
        ("fe80::1%eth0", "[fe80::1%eth0]:7"),
        ("decode-0", "decode-0:7"),
    ],
)
def test_an_address_is_written_so_it_reads_back(host, written):
    assert join_host_port(host, 7) == written
    assert split_host_port(written) == (host, 7)


@pytest.mark.parametrize("bad", ["", "7", "host:", "host:port", ":7"])
def test_a_malformed_address_is_refused(bad):
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(bad)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
async def test_the_router_reaches_a_worker_on_an_ipv6_address():
    server = await start_server([], [], "::1", 0)
    registry = WorkerRegistry.connect(prefill=[], decode=[f"[::1]:{server.port}"])
    try:
        (worker,) = registry.decode
        assert worker.address == f"[::1]:{server.port}"
        reply = await health_pb2_grpc.HealthStub(worker.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await registry.close()
        await server.stop(0)


async def test_a_second_server_on_a_taken_port_is_refused_not_sharing_it():
    first = await start_server([], [], "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{first.port}"):
            await start_server([], [], "127.0.0.1", first.port)
    finally:
        await first.stop(0)


@pytest.mark.parametrize("spec", ["127.0.0.1:99999", "127.0.0.1:0", "dns:decode:70000"])
def test_a_worker_address_with_a_port_out_of_range_is_refused_at_start(spec):
    from pdserve.router.workers import parse_spec

    with pytest.raises(ValueError, match=r"port must be in \[1, 65535\]"):
        parse_spec(spec)


async def test_a_taken_http_port_is_named():
    from fastapi import FastAPI

    from pdserve.router.http_server import serve_http

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"^--http-port: could not bind 127.0.0.1:{port}: Address already in use"):
            await serve_http(FastAPI(), "127.0.0.1", port)


def test_a_taken_metrics_port_is_named():
    from prometheus_client import CollectorRegistry

    from pdserve.metrics import serve_metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"^--metrics-port: could not bind 127.0.0.1:{port}"):
            serve_metrics("127.0.0.1", port, CollectorRegistry())


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_kv_transfers_reach_a_decode_worker_on_an_ipv6_address():
    from kv_sides import Decode, Prefill, assert_same_tokens

    decode, prefill = Decode("tcp", host="::1"), Prefill("tcp")
    try:
        assert decode.address.startswith("[::1]:")
        conn = prefill.connect(decode.address)
        tid = decode.grant([0, 1], 16)
        assert prefill.ship(conn, tid, [0], [0, 1], 8, 16).ok and decode.outcome(tid).ok
        assert_same_tokens(prefill.layers, [0], decode.layers, [0, 1], 16)
    finally:
        prefill.close()
        decode.close()


def test_a_worker_bound_to_every_interface_advertises_its_route_out_not_loopback(monkeypatch, caplog):
    from pdserve import addresses
    from pdserve.settings import WorkerSettings

    assert WorkerSettings(host="0.0.0.0").public_host() == addresses.own_address()
    assert WorkerSettings(host="0.0.0.0", advertise_host="decode-0.pods").public_host() == "decode-0.pods"

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError("network unreachable")

    monkeypatch.setattr(addresses.socket, "socket", NoRoute)
    monkeypatch.setattr(  # Debian's /etc/hosts
        addresses.socket, "getaddrinfo", lambda name, port, family: [(family, 1, 6, "", ("127.0.1.1", 0))]
    )
    with caplog.at_level("WARNING", logger="pdserve.addresses"):
        assert addresses.own_address() == "127.0.1.1"
    assert "loopback" in caplog.text and "--advertise-host" in caplog.text


@pytest.mark.skipif(not (_has_ipv6_loopback() and socket.has_dualstack_ipv6()), reason="no dual-stack IPv6 here")
def test_a_decode_worker_on_every_ipv6_interface_takes_ipv4_peers_too():
    """As its gRPC server on [::] does: --host :: with an IPv4 --advertise-host must work."""
    from kv_sides import Decode, Prefill

    decode, prefill = Decode("tcp", host="::"), Prefill("tcp")
    try:
        conn = prefill.connect(f"127.0.0.1:{decode.receiver.port}")
        tid = decode.grant([0, 1], 16)
        assert prefill.ship(conn, tid, [0], [0, 1], 8, 16).ok and decode.outcome(tid).ok
    finally:
        prefill.close()
        decode.close()
