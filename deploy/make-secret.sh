#!/usr/bin/env sh
# Generates the cluster secret that every internal pdserve port requires (worker RPCs and the
# KV-transfer handshake) and writes it where the shipped deployments read it:
#
#   deploy/cluster.env           docker-compose: the env_file of router, prefill and decode
#   deploy/k8s/05-secret.yaml    Kubernetes: Secret pdserve-cluster, envFrom of every Deployment
#
# Both files are readable by their owner only and ignored by git and docker builds. Without
# them the deployments do not start. An existing secret is kept unless --rotate is given
# (deploy/README.md, "Rotating the cluster secret", says what to restart afterwards).
#
# Usage: deploy/make-secret.sh [--rotate]
set -eu
cd "$(dirname "$0")"
case "${1:-}" in
  "") if [ -e cluster.env ] || [ -e k8s/05-secret.yaml ]; then
        echo "deploy/cluster.env or deploy/k8s/05-secret.yaml exists already; pass --rotate to replace the secret" >&2
        exit 1
      fi ;;
  --rotate) ;;
  *) echo "usage: $0 [--rotate]" >&2; exit 2 ;;
esac
token=$(head -c 32 /dev/urandom | base64 | tr -d '\n=' | tr '+/' '-_')
umask 077
printf 'PDSERVE_CLUSTER_TOKEN=%s\n' "$token" > cluster.env
cat > k8s/05-secret.yaml <<YAML
# Written by deploy/make-secret.sh (not in git): the cluster secret of every pdserve role.
apiVersion: v1
kind: Secret
metadata:
  name: pdserve-cluster
  namespace: pdserve
  labels:
    app.kubernetes.io/name: pdserve
type: Opaque
stringData:
  PDSERVE_CLUSTER_TOKEN: "$token"
YAML
echo "wrote deploy/cluster.env and deploy/k8s/05-secret.yaml (a new cluster secret)"
