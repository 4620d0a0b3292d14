#!/usr/bin/env bash
# Installs what the tests and the demo need on a fresh machine, idempotently:
# the Debian packages in test/tools/apt-packages.txt (swtpm, ...) and the
# Kubernetes and etcd binaries (built from Go modules, cached outside the
# repository by test/tools/install-k8s.sh), Cluster API's and helm. Prints the binaries' directory.
#
#   setup.sh                    everything make test needs
#   setup.sh --kubernetes-only  the packages and Kubernetes binaries only (make demo, make bench)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kubernetes_only=false
case "${1:-}" in
  "") ;;
  --kubernetes-only) kubernetes_only=true ;;
  *) echo "usage: $0 [--kubernetes-only]" >&2; exit 2 ;;
esac

missing=()
while read -r pkg; do
  [ -z "$pkg" ] && continue
  case "$pkg" in \#*) continue ;; esac
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done < "$here/apt-packages.txt"

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >&2 || true
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

if ! $kubernetes_only; then
  # Cluster API (core manager, CABPK, clusterctl) for the lifecycle tests.
  "$here/install-capi.sh" >/dev/null
  # helm, for the chart test (test/addon).
  "$here/install-helm.sh" >/dev/null
fi
"$here/install-k8s.sh" | tail -n 1
