#!/usr/bin/env bash
# Builds the real helm command (helm.sh/helm/v3/cmd/helm) the chart test runs,
# from the Go module on the module proxy, into a cache directory outside the
# repository keyed by version. A second run with the same version does nothing.
#
#   KA_CACHE        cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator)
#   HELM_VERSION    Helm release (default below)
#
# Prints the directory holding the helm binary on its last line of stdout.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-3.22.0}"
KA_CACHE="${KA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator}"

# The suffix names the build recipe: bump it when the way helm is built changes.
out="$KA_CACHE/bin/helm-v${HELM_VERSION}-r2"
if [ -x "$out/helm" ]; then
  echo "$out"
  exit 0
fi

log() { echo "install-helm: $*" >&2; }
mkdir -p "$out" "$KA_CACHE"

# One build at a time (several test binaries may ask together).
exec 9>"$KA_CACHE/install-helm.lock"
flock 9
if [ -x "$out/helm" ]; then
  echo "$out"
  exit 0
fi

# A scratch module requiring helm, so that helm's dependencies do not touch
# this repository's go.mod.
work="$KA_CACHE/src/helm-v${HELM_VERSION}"
rm -rf "$work"; mkdir -p "$work"
cd "$work"
cat > go.mod <<MOD
module helmbuild

go 1.26
MOD
cat > tools.go <<'GO'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
GO
go mod edit -require="helm.sh/helm/v3@v${HELM_VERSION}"
GOFLAGS="-mod=mod" go mod tidy -e >/dev/null 2>&1 || true

# helm's default Kubernetes version (helm template, helm lint) is the one of
# the client-go it links, as helm's own Makefile sets it.
cgo="$(GOFLAGS=-mod=mod go list -m -f '{{.Version}}' k8s.io/client-go)"   # v0.MINOR.PATCH
kminor="${cgo#v0.}"; kminor="${kminor%%.*}"
log "building helm v${HELM_VERSION} (about a minute warm)"
GOFLAGS="-mod=mod" go build -trimpath \
  -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=v${HELM_VERSION} \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${kminor} \
    -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${kminor}" \
  -o "$out/helm.tmp" helm.sh/helm/v3/cmd/helm
mv "$out/helm.tmp" "$out/helm"
echo "$out"
