#!/usr/bin/env bash
# Builds the real Cluster API binaries the tests run (the core manager, the
# kubeadm bootstrap provider CABPK, clusterctl) from the sigs.k8s.io/cluster-api
# Go module, and copies the module's CRDs and webhook manifests beside them,
# into a cache directory outside the repository keyed by version. A second run
# with the same version does nothing.
#
#   KA_CACHE        cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator)
#   CAPI_VERSION    Cluster API release (default below; the same minor as the
#                   sigs.k8s.io/cluster-api/api types in go.mod)
#
# Layout of the printed directory:
#   capi-manager, cabpk-manager, clusterctl
#   config/core/...        the core provider's config tree (crd/bases, webhook, rbac)
#   config/bootstrap/...   CABPK's config tree
#   metadata.yaml          the Cluster API release metadata
# Prints the directory on its last line of stdout.
set -euo pipefail

CAPI_VERSION="${CAPI_VERSION:-1.14.2}"
KA_CACHE="${KA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator}"

# The suffix names the build recipe: bump it when the way binaries are built changes.
out="$KA_CACHE/bin/capi-v${CAPI_VERSION}-r1"
want=(capi-manager cabpk-manager clusterctl)

have_all() {
  for b in "${want[@]}"; do [ -x "$out/$b" ] || return 1; done
  [ -d "$out/config/core/crd/bases" ] && [ -d "$out/config/bootstrap/crd/bases" ]
}
if have_all; then
  echo "$out"
  exit 0
fi

log() { echo "install-capi: $*" >&2; }
mkdir -p "$out" "$KA_CACHE"

exec 9>"$KA_CACHE/install-capi.lock"
flock 9
if have_all; then
  echo "$out"
  exit 0
fi

# A scratch module requiring the Cluster API root module; its api submodule is
# a module of its own and must be pinned to the same release.
work="$KA_CACHE/src/capi-v${CAPI_VERSION}"
rm -rf "$work"; mkdir -p "$work"
cd "$work"
cat > go.mod <<MOD
module capibuild

go 1.26
MOD
cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm"
	_ "sigs.k8s.io/cluster-api/cmd/clusterctl"
	_ "sigs.k8s.io/cluster-api/core"
)
GO
go mod edit -require="sigs.k8s.io/cluster-api@v${CAPI_VERSION}" \
  -replace="sigs.k8s.io/cluster-api/api=sigs.k8s.io/cluster-api/api@v${CAPI_VERSION}"
GOFLAGS="-mod=mod" go mod tidy -e >/dev/null 2>&1 || true

log "building Cluster API v${CAPI_VERSION} (core manager, CABPK, clusterctl; about two minutes warm)"
vpkg=sigs.k8s.io/cluster-api/version
minor="${CAPI_VERSION#1.}"; minor="${minor%%.*}"
ldflags="-s -w -X ${vpkg}.gitVersion=v${CAPI_VERSION} -X ${vpkg}.gitMajor=1 -X ${vpkg}.gitMinor=${minor} -X ${vpkg}.gitTreeState=clean"
GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out/capi-manager" sigs.k8s.io/cluster-api/core
GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out/cabpk-manager" sigs.k8s.io/cluster-api/bootstrap/kubeadm
GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out/clusterctl" sigs.k8s.io/cluster-api/cmd/clusterctl

src="$(GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)"
rm -rf "$out/config"; mkdir -p "$out/config"
cp -r "$src/core/config" "$out/config/core"
cp -r "$src/bootstrap/kubeadm/config" "$out/config/bootstrap"
cp "$src/metadata.yaml" "$out/metadata.yaml"
chmod -R u+w "$out/config" "$out/metadata.yaml"

have_all || { log "missing binaries in $out"; exit 1; }
echo "$out"
