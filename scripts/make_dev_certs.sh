#!/usr/bin/env bash
# Development certificates for pdserve's TLS/mTLS: a CA, and one server+client certificate
# signed by it, valid for localhost, 127.0.0.1 and any extra names/IPs given.
# Usage: scripts/make_dev_certs.sh OUT_DIR [NAME_OR_IP ...]
# Then: pdserve up --tls-cert OUT_DIR/node.crt --tls-key OUT_DIR/node.key --tls-ca OUT_DIR/ca.crt [--tls-client-auth]
set -euo pipefail
out="${1:?usage: $0 OUT_DIR [NAME_OR_IP ...]}"
shift || true
mkdir -p "$out"
san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san="$san,IP:$name"; else san="$san,DNS:$name"; fi
done
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=pdserve dev CA" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=pdserve node" \
  -keyout "$out/node.key" -out "$out/node.csr" 2>/dev/null
printf "subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n" "$san" > "$out/node.ext"
openssl x509 -req -in "$out/node.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial -days 365 \
  -extfile "$out/node.ext" -out "$out/node.crt" 2>/dev/null
rm -f "$out/node.csr" "$out/node.ext" "$out/ca.srl"
chmod 600 "$out"/*.key
echo "wrote $out/ca.crt, $out/node.crt, $out/node.key (SAN: $san)"
