#!/usr/bin/env bash
# The README demo: start the stack (1 prefill + 1 decode worker), stream one completion, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
PORT=${PDSERVE_DEMO_PORT:-50051}
LOG=$(mktemp)
"$PDSERVE" up --port "$PORT" >"$LOG" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null; rm -f "$LOG"' EXIT
echo "starting pdserve (router, 1 prefill worker, 1 decode worker; the first run converts the model once)..."
for _ in $(seq 300); do
  grep -q "pdserve ready" "$LOG" && break
  kill -0 $UP 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
grep "pdserve ready" "$LOG" || { echo "pdserve did not become ready"; tail -20 "$LOG"; exit 1; }
echo
echo '$ pdserve generate --chat --temperature 0 --max-tokens 96 "Explain in two sentences why the sky is blue."'
"$PDSERVE" generate --addr "127.0.0.1:$PORT" --chat --temperature 0 --max-tokens 96 "Explain in two sentences why the sky is blue."
echo
echo "stopping pdserve..."
