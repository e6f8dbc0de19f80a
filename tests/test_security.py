"""TLS and mTLS on every gRPC port, the cluster credential on internal ports (worker RPCs and
the KV-transfer handshake), and the bearer token on the public API (gRPC and HTTP)."""

from __future__ import annotations

import asyncio
import http.client as http_client
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import PROMPTS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import Stack

from pdserve.client import build_request
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, host_id
from pdserve.kvtransfer.sender import KVConnection
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "public-api-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run([str(ROOT / "scripts" / "make_dev_certs.sh"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def stack(certs):
    s = Stack.up(
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "128MiB",
        "--kv-transport",
        "tcp",
        "--http-port",
        "0",
        "--tls-cert",
        str(certs / "node.crt"),
        "--tls-key",
        str(certs / "node.key"),
        "--tls-ca",
        str(certs / "ca.crt"),
        "--tls-client-auth",
        env={"PDSERVE_API_TOKEN": TOKEN},
    )
    yield s
    s.down()


def mtls(certs: Path, with_cert: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (certs / "ca.crt").read_bytes(),
        (certs / "node.key").read_bytes() if with_cert else None,
        (certs / "node.crt").read_bytes() if with_cert else None,
    )


async def generate(address, credentials, metadata=(), max_tokens=8):
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        return [
            m
            async for m in stub.Generate(
                build_request(PROMPTS[0], max_tokens=max_tokens, temperature=0), timeout=60, metadata=metadata
            )
        ]


def process(stack: Stack, role: str) -> dict:
    return next(p for p in stack.processes if p["role"] == role)


async def test_mtls_and_token_serve(stack, certs, hf_reference):
    messages = await generate(stack.address, mtls(certs), (("authorization", f"Bearer {TOKEN}"),))
    ids = [t for m in messages for t in m.token_ids]
    assert ids == hf_reference.greedy(hf_reference.tokenizer(PROMPTS[0]).input_ids, 8)


@pytest.mark.parametrize("how", ["plaintext", "tls-without-client-cert"])
async def test_clients_without_tls_or_client_cert_are_refused(stack, certs, how):
    credentials = None if how == "plaintext" else mtls(certs, with_cert=False)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stack.address, credentials, (("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_public_api_requires_the_bearer_token(stack, certs, token):
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stack.address, mtls(certs), metadata)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


def https_context(certs: Path, with_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if with_cert:
        context.load_cert_chain(certs / "node.crt", certs / "node.key")
    return context


def test_http_api_is_https_and_requires_the_bearer_token(stack, certs):
    """The router's TLS settings apply to its HTTP port too: the bearer token never crosses the
    network in clear, and with --tls-client-auth the HTTP client needs a certificate as well."""
    http = process(stack, "router")["http"]
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"https://{http}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30, context=https_context(certs))
    assert err.value.code == 401 and json.loads(err.value.read())["error"]["code"] == "invalid_api_key"
    request.add_header("Authorization", f"Bearer {TOKEN}")
    reply = json.loads(urllib.request.urlopen(request, timeout=60, context=https_context(certs)).read())
    assert reply["usage"]["completion_tokens"] == 2
    for refused in (
        urllib.request.Request(f"http://{http}/v1/completions", data=body, headers=dict(request.header_items())),
        request,
    ):
        context = None if refused.type == "http" else https_context(certs, with_cert=False)
        with pytest.raises((OSError, http_client.HTTPException)):
            urllib.request.urlopen(refused, timeout=30, context=context)  # plain HTTP; TLS without a client cert


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_internal_grpc_ports_refuse_peers_without_the_cluster_credential(stack, certs, role):
    address = process(stack, role)["grpc"]
    async with grpc.aio.secure_channel(address, mtls(certs)) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
        stub_cls = pdserve_pb2_grpc.PrefillWorkerStub if role == "prefill" else pdserve_pb2_grpc.DecodeWorkerStub
        stub = stub_cls(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStats(pb.StatsRequest(), timeout=10, metadata=(("authorization", "Bearer guess"),))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        if role == "decode":
            call = stub.Decode(pb.DecodeRequest(request_id="x", token_ids=[1, 2, 3]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_kv_port_refuses_an_unauthenticated_peer(stack):
    kv_address = process(stack, "decode")["kv"]
    stats = await cluster_stats_with_token(stack)
    decode = next(w for w in stats.workers if w.role == "decode")
    fake = PeerInfo(
        model_fingerprint="x",
        dtype="float32",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        transports=("tcp",),
        host_id=host_id(),
    )
    with pytest.raises(
        HandshakeError, match="unauthenticated"
    ):  # refused in the handshake, before the cache is touched
        KVConnection(kv_address, fake, cache=None, secret=b"not-the-cluster-token")
    after = await cluster_stats_with_token(stack)
    decode_after = next(w for w in after.workers if w.role == "decode")
    assert decode_after.counters["kv_handshakes_refused"] == decode.counters.get("kv_handshakes_refused", 0) + 1
    assert decode_after.reserved_transfers == 0
    deadline = time.monotonic() + 60  # earlier tests' requests may still be handing their blocks back
    while decode_after.blocks_free != decode_after.blocks_total:
        assert time.monotonic() < deadline, f"blocks held: {decode_after}"
        await asyncio.sleep(0.2)
        decode_after = next(w for w in (await cluster_stats_with_token(stack)).workers if w.role == "decode")


async def cluster_stats_with_token(stack: Stack) -> pb.ClusterStats:
    certs = Path(stack.proc.args[stack.proc.args.index("--tls-ca") + 1]).parent
    async with grpc.aio.secure_channel(stack.address, mtls(certs)) as channel:
        return await pdserve_pb2_grpc.RouterStub(channel).GetClusterStats(
            pb.ClusterStatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )


def test_pdserve_health_and_generate_speak_tls_from_flags_or_the_servers_variables(stack, certs):
    """A container's healthcheck runs `pdserve health` beside a worker whose PDSERVE_TLS_*
    variables turned TLS on: it probes over (m)TLS with them. A certificate without its key is
    a clear error, not an abort in gRPC's core."""
    address = process(stack, "decode")["grpc"]
    tls = {
        "PDSERVE_TLS_CERT": certs / "node.crt",
        "PDSERVE_TLS_KEY": certs / "node.key",
        "PDSERVE_TLS_CA": certs / "ca.crt",
    }

    def pdserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_TLS_")}
        return subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *args],
            env={**clean, **{k: str(v) for k, v in (env or {}).items()}},
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert pdserve("health", "--addr", address, env=tls).returncode == 0
    flags = [
        "--tls-ca",
        str(certs / "ca.crt"),
        "--tls-cert",
        str(certs / "node.crt"),
        "--tls-key",
        str(certs / "node.key"),
    ]
    assert pdserve("health", "--addr", address, *flags).returncode == 0
    assert pdserve("health", "--addr", address, "--timeout", "5").returncode == 1  # plaintext: refused
    half = pdserve(
        "generate",
        "--addr",
        stack.address,
        "--tls-ca",
        str(certs / "ca.crt"),
        "--tls-cert",
        str(certs / "node.crt"),
        "Hi",
    )
    assert half.returncode == 2 and "tls_cert and tls_key go together" in half.stderr


def test_up_refuses_a_certificate_without_a_ca(certs):
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.launcher import Cluster
    from pdserve.security import SecuritySettings
    from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings

    security = SecuritySettings(tls_cert=str(certs / "node.crt"), tls_key=str(certs / "node.key"))
    with pytest.raises(ValueError, match="tls_cert: pdserve up needs tls_ca too"):
        Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings(), security)
    # A CA alone would have the router speak TLS to workers that serve plaintext: nothing works.
    security = SecuritySettings(tls_ca=str(certs / "ca.crt"))
    with pytest.raises(ValueError, match="tls_ca: pdserve up needs tls_cert and tls_key too"):
        Cluster(EngineConfig(), WorkerSettings(), RouterSettings(), ClusterSettings(), security)


def test_a_key_or_certificate_that_cannot_serve_is_refused_by_its_name(certs, tmp_path):
    """Not gRPC's later "could not bind": the field, at start-up, before the model loads."""
    from pdserve.security import SecuritySettings

    other = tmp_path / "other"
    subprocess.run([str(ROOT / "scripts" / "make_dev_certs.sh"), str(other)], check=True, capture_output=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", certs / "node.key", "-aes256", "-passout", "pass:x", "-out", encrypted], check=True
    )
    cert, key = str(certs / "node.crt"), str(certs / "node.key")
    cases = [
        ((cert, str(other / "node.key"), None), "tls_key: .* is not the private key of tls_cert"),
        ((key, cert, None), "tls_cert: .* holds no PEM certificate"),
        ((cert, str(junk), None), "tls_key: .* is not an unencrypted PEM private key"),
        ((cert, str(encrypted), None), "tls_key: .* is not an unencrypted PEM private key"),
        ((cert, key, str(junk)), "tls_ca: .* holds no PEM certificate"),
    ]
    for (tls_cert, tls_key, tls_ca), words in cases:
        with pytest.raises(ValueError, match=words):
            SecuritySettings(tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
    assert SecuritySettings(tls_cert=cert, tls_key=key, tls_ca=str(certs / "ca.crt")).tls
    # What gRPC serves, OpenSSL's default policy aside: an RSA-1024 key, a SHA-1 signature.
    weak_key, weak_cert = tmp_path / "weak.key", tmp_path / "weak.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:1024", "-sha1", "-nodes", "-subj", "/CN=localhost", "-days", "1"]
        + ["-keyout", weak_key, "-out", weak_cert],
        check=True,
        capture_output=True,
    )
    assert SecuritySettings(tls_cert=str(weak_cert), tls_key=str(weak_key)).tls
    router = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--port", "0", "--decode-workers", "127.0.0.1:5"]
        + ["--tls-cert", cert, "--tls-key", str(other / "node.key")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert router.returncode == 2 and "is not the private key of tls_cert" in router.stderr, router.stderr
    assert "could not bind" not in router.stderr


@pytest.mark.parametrize("token", ["tok\n", " token", "toké", "\x00"])
def test_tokens_that_cannot_travel_in_a_header_are_refused_without_repeating_them(token):
    from pdserve.security import SecuritySettings

    for name in ("cluster_token", "api_token"):
        with pytest.raises(ValueError) as err:
            SecuritySettings(**{name: token})
        assert str(err.value) == f"{name}: must be printable ASCII, without line breaks or spaces at either end"
    assert SecuritySettings(cluster_token="A-b_c.9~!", api_token="my token").cluster_secret == b"A-b_c.9~!"


def test_a_worker_open_to_other_hosts_without_a_cluster_token_says_so(caplog):
    from pdserve.security import SecuritySettings

    SecuritySettings().warn_if_open("decode", "127.0.0.1")
    SecuritySettings(cluster_token="t").warn_if_open("decode", "0.0.0.0")
    assert not caplog.records
    SecuritySettings().warn_if_open("decode", "0.0.0.0")
    assert "decode worker on 0.0.0.0 without a cluster token" in caplog.text


def test_an_empty_token_is_refused_not_taken_as_no_token():
    """`api_token: ""` in a config file turned authentication off without a word."""
    from pdserve.config import resolve
    from pdserve.security import SecuritySettings

    for name in ("cluster_token", "api_token"):
        with pytest.raises(ValueError, match=f"{name}: must not be empty"):
            resolve(SecuritySettings, None, env={}, file={name: ""})
    assert resolve(SecuritySettings, None, env={"PDSERVE_API_TOKEN": ""}, file={}).api_token is None  # unset


def test_a_malformed_secret_in_a_file_is_not_repeated_in_the_error():
    from pdserve.config import resolve
    from pdserve.security import SecuritySettings

    with pytest.raises(ValueError) as err:
        resolve(SecuritySettings, None, env={}, file={"api_token": ["sk-very-secret", "x"]})
    assert "api_token" in str(err.value) and "sk-very-secret" not in str(err.value)


def test_the_bearer_scheme_is_case_insensitive():
    from pdserve.security import bearer_ok

    assert bearer_ok("t0k", "Bearer t0k") and bearer_ok("t0k", "bearer t0k") and bearer_ok("t0k", "BEARER t0k")
    assert not any(bearer_ok("t0k", h) for h in (None, "", "Bearer", "Bearer t0K", "Basic t0k", "Bearert0k"))
