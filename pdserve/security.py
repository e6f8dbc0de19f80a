"""TLS/mTLS for every gRPC port, a cluster credential for internal ports, a bearer token for
the public API.

Internal services (the workers' gRPC and the KV-transfer port) require the cluster token:
gRPC calls carry it as ``authorization: Bearer <token>``, the KV handshake carries it in the
peer info, and both are checked before anything is reserved or written. Health checking and
reflection stay open so orchestrators can probe. ``pdserve up`` makes up a random cluster
token for its children when none is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from pdserve.config import resolve, setting

log = logging.getLogger(__name__)
AUTH_KEY = "authorization"
# What an HTTP/gRPC header value carries as it is: printable ASCII, no space at either end.
_TOKEN = re.compile(r"([\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?)?")


@dataclass(frozen=True)
class SecuritySettings:
    tls_cert: str | None = setting(None, "PEM certificate of this process (enables TLS on its gRPC ports)")
    tls_key: str | None = setting(None, "PEM private key for --tls-cert")
    tls_ca: str | None = setting(
        None, "PEM CA bundle: verifies peers' certificates (and clients' with --tls-client-auth)"
    )
    tls_client_auth: bool = setting(False, "mTLS: require client certificates signed by --tls-ca")
    cluster_token: str | None = setting(
        None, "shared secret every internal port requires (worker RPCs, KV transfer)", secret=True
    )
    api_token: str | None = setting(None, "bearer token the public API requires (router)", secret=True)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_auth and not (self.tls_ca and self.tls_cert):
            raise ValueError("tls_client_auth needs tls_ca, tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a file")
        self._check_pem()
        for name in SECRET_SETTINGS:  # its value is never repeated in the message
            value = getattr(self, name)
            if value == "":  # an empty token would turn the check off: leave the setting out for that
                raise ValueError(f"{name}: must not be empty (leave it unset for no token)")
            if value is not None and not _TOKEN.fullmatch(value):
                raise ValueError(f"{name}: must be printable ASCII, without line breaks or spaces at either end")

    def _check_pem(self) -> None:
        """gRPC takes a bad certificate or key without a word and fails the bind later ("could
        not bind"); judged here, each by its name."""
        for name in ("tls_cert", "tls_ca"):
            path = getattr(self, name)
            if path:
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
                except ssl.SSLError:
                    raise ValueError(f"{name}: {path} holds no PEM certificate") from None
        if not self.tls_cert:
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL's policy on key sizes and digests is not gRPC's
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key, password=b"")
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(
                    f"tls_key: {self.tls_key} is not the private key of tls_cert {self.tls_cert}"
                ) from None
            if e.reason is None:  # OpenSSL's "PEM lib": the key could not be read
                raise ValueError(
                    f"tls_key: {self.tls_key} is not an unencrypted PEM private key (gRPC takes no passphrase)"
                ) from None
            raise ValueError(f"tls_cert, tls_key: {self.tls_cert} with {self.tls_key}: {e.reason}") from None

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        ca = Path(self.tls_ca).read_bytes() if self.tls_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())],
            root_certificates=ca if self.tls_client_auth else None,
            require_client_auth=self.tls_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """For calls to other pdserve servers: TLS when a CA is configured (a router may serve
        TLS in front of plaintext workers on a private network); our certificate for mTLS."""
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.tls_ca).read_bytes(),
            private_key=Path(self.tls_key).read_bytes() if self.tls_key else None,
            certificate_chain=Path(self.tls_cert).read_bytes() if self.tls_cert else None,
        )

    def cluster_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_KEY, f"Bearer {self.cluster_token}"),) if self.cluster_token else ()

    @property
    def cluster_secret(self) -> bytes | None:
        """The cluster token as the KV handshake's HMAC key."""
        return self.cluster_token.encode() if self.cluster_token else None

    def warn_if_open(self, role: str, host: str) -> None:
        """A worker reachable from other hosts without a cluster token takes anyone's requests
        and KV writes: say so at start (pdserve up always sets one)."""
        if not self.cluster_token and not is_loopback(host):
            log.warning(
                "%s worker on %s without a cluster token: whoever reaches its ports can run requests "
                "and write into its KV cache (set --cluster-token or PDSERVE_CLUSTER_TOKEN)",
                role,
                host,
            )


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS flags of a client command (generate, health); unset, the servers' variables apply."""
    parser.add_argument("--tls-ca", default=None, help="CA bundle: connect with TLS (env PDSERVE_TLS_CA)")
    parser.add_argument("--tls-cert", default=None, help="client certificate, for mTLS (env PDSERVE_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, help="its private key (env PDSERVE_TLS_KEY)")


SECRET_SETTINGS = tuple(f.name for f in dataclasses.fields(SecuritySettings) if f.metadata["secret"])  # never printed


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """Raises ValueError naming a missing file or a certificate without its key."""
    return resolve(SecuritySettings, args).channel_credentials()


def bearer_ok(expected: str | None, header: str | None) -> bool:
    if not expected:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":  # a scheme's name is case-insensitive (RFC 9110)
        return False
    return hmac.compare_digest(token.encode(), expected.encode())


class TokenAuth(grpc.aio.ServerInterceptor):
    """Rejects calls to ``services`` (full names) without the bearer token: UNAUTHENTICATED."""

    def __init__(self, token: str | None, services: Sequence[str]) -> None:
        self.token = token
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if not self.token or handler is None or not details.method.startswith(self.prefixes):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == AUTH_KEY), None)
        if bearer_ok(self.token, header):
            return handler
        return _deny(handler, "missing or wrong bearer token" if header else "this server requires a bearer token")


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # makes this an async generator, as streaming handlers are

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
