"""``pdserve health``: exit 0 when a pdserve server answers SERVING (container healthchecks).
Over TLS when the flags or the server's own ``PDSERVE_TLS_*`` variables say so."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.security import client_credentials


def run_health(args: argparse.Namespace) -> int:
    try:
        credentials = client_credentials(args)
    except ValueError as e:
        print(f"pdserve health: error: {e}", file=sys.stderr)
        return 2
    channel = grpc.secure_channel(args.addr, credentials) if credentials else grpc.insecure_channel(args.addr)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.addr}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
