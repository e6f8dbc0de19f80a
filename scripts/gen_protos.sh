#!/usr/bin/env bash
# Regenerates the Python code under protos/ from the .proto files (needs grpcio-tools).
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: protos/, next to the sources)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-protos}"
"${PYTHON:-python}" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/pdserve/v1/*.proto
