"""The compose topology on three "hosts": router, prefill and decode each in a network
namespace of their own with their own address, joined by veth pairs to a bridge in a fourth
namespace. Nothing may assume localhost: not the gRPC addresses, not the KV side channel.
The namespaces are made by this test and removed after; no traffic leaves them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pdserve.process import parse_ready

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip(reason="network namespaces need root and iproute2 (ip)", allow_module_level=True)

SUBNET = "10.77.{}.{}"


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def hosts():
    tag = f"{os.getpid() % 10000}"
    net = os.getpid() % 200 + 20
    names = {role: f"pd{tag}{role[0]}" for role in ("router", "prefill", "decode")}
    bridge = f"pd{tag}br"
    addresses = {role: SUBNET.format(net, i + 1) for i, role in enumerate(names)}
    created = []
    try:
        for ns in (*names.values(), bridge):
            ip("netns", "add", ns)
            created.append(ns)
            ip("link", "set", "lo", "up", ns=ns)
        ip("link", "add", "br0", "type", "bridge", ns=bridge)
        ip("link", "set", "br0", "up", ns=bridge)
        for role, ns in names.items():
            inner, outer = f"v{tag}{role[0]}", f"b{tag}{role[0]}"
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", bridge)
            ip("link", "set", outer, "master", "br0", ns=bridge)
            ip("link", "set", outer, "up", ns=bridge)
            ip("addr", "add", f"{addresses[role]}/24", "dev", inner, ns=ns)
            ip("link", "set", inner, "up", ns=ns)
        yield names, addresses
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def start(ns: str, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PDSERVE_CLUSTER_TOKEN": "netns-test",
    }
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def ready(proc: subprocess.Popen) -> dict:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        info = parse_ready(line)
        if info is not None:
            return info
    raise RuntimeError("process exited before it was ready:\n" + "".join(lines[-30:]))


def test_compose_topology_across_namespaces(hosts, hf_reference):
    names, addr = hosts
    common = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--num-threads", "1", "--kv-transport", "tcp")
    procs = []
    try:
        decode = start(
            names["decode"], "decode", "--host", addr["decode"], "--port", "50053", "--kv-port", "50060", *common
        )
        prefill = start(names["prefill"], "prefill", "--host", addr["prefill"], "--port", "50052", *common)
        procs += [decode, prefill]
        d_info, p_info = ready(decode), ready(prefill)
        assert d_info["grpc"] == f"{addr['decode']}:50053" and d_info["kv"] == f"{addr['decode']}:50060"
        router = start(
            names["router"],
            "router",
            "--host",
            addr["router"],
            "--port",
            "50051",
            "--prefill-workers",
            p_info["grpc"],
            "--decode-workers",
            d_info["grpc"],
        )
        procs.append(router)
        ready(router)

        prompt = "The capital of France is"
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                names["router"],
                sys.executable,
                "-m",
                "pdserve.cli",
                "generate",
                "--json",
                "--addr",
                f"{addr['router']}:50051",
                "--max-tokens",
                "12",
                "--temperature",
                "0",
                prompt,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        ids = [t for line in out.stdout.splitlines() for t in json.loads(line)["token_ids"]]
        assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 12)
        # The router's namespace cannot reach the workers through its own loopback.
        probe = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                names["router"],
                sys.executable,
                "-m",
                "pdserve.cli",
                "health",
                "--addr",
                "127.0.0.1:50053",
                "--timeout",
                "2",
            ],
            capture_output=True,
            text=True,
        )
        assert probe.returncode != 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
