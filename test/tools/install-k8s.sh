#!/usr/bin/env bash
# Builds the Kubernetes and etcd binaries the tests and the demo run, from the
# Go modules on the module proxy, into a cache directory outside the repository
# keyed by version. A second run with the same versions does nothing.
#
#   KA_CACHE        cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator)
#   K8S_VERSION     Kubernetes release (default below; one minor for the whole project)
#   ETCD_VERSION    etcd server module version
#
# Prints the directory holding the binaries on its last line of stdout.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-3.6.8}"
KA_CACHE="${KA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator}"

# The suffix names the build recipe: bump it when the way binaries are built changes.
out="$KA_CACHE/bin/k8s-v${K8S_VERSION}-etcd-v${ETCD_VERSION}-r2"
want=(kube-apiserver kube-controller-manager kubemark kubectl etcd)

have_all() {
  for b in "${want[@]}"; do [ -x "$out/$b" ] || return 1; done
}
if have_all; then
  echo "$out"
  exit 0
fi

log() { echo "install-k8s: $*" >&2; }
mkdir -p "$out"

# One build at a time: test binaries of several packages (and people) may run
# this together, and a second copy would delete the first one's work tree.
exec 9>"$KA_CACHE/install-k8s.lock"
flock 9
if have_all; then
  echo "$out"
  exit 0
fi
work="$KA_CACHE/src"
mkdir -p "$work"

# --- Kubernetes: a scratch module that requires k8s.io/kubernetes and replaces
# every staging module required at v0.0.0 with its published v0.X.Y twin.
kdir="$work/k8s-v${K8S_VERSION}"
staging="0.${K8S_VERSION#1.}"
if [ ! -x "$out/kube-apiserver" ] || [ ! -x "$out/kube-controller-manager" ] || [ ! -x "$out/kubemark" ] || [ ! -x "$out/kubectl" ]; then
  log "building Kubernetes v${K8S_VERSION} binaries (cold build takes several minutes)"
  rm -rf "$kdir"; mkdir -p "$kdir"
  cd "$kdir"
  cat > go.mod <<MOD
module kabuild

go 1.26
MOD
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubemark"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  # Learn which staging modules k8s.io/kubernetes pins at v0.0.0.
  modfile="$(go mod download -json "k8s.io/kubernetes@v${K8S_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  replaces=()
  while read -r mod; do
    replaces+=("-replace=${mod}=${mod}@v${staging}")
  done < <(awk '/^require|^\t/ {print}' "$modfile" | grep -E '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0( |$)' | awk '{print $1}' | sort -u)
  go mod edit -require="k8s.io/kubernetes@v${K8S_VERSION}" "${replaces[@]}"
  GOFLAGS="-mod=mod" go mod tidy -e >/dev/null 2>&1 || true
  # Stamp the release version: unstamped binaries report v0.0.0-master
  # (kube-apiserver /version, kubectl version, kubemark's kubeletVersion).
  vpkg=k8s.io/component-base/version
  minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
  ldflags="-s -w -X ${vpkg}.gitVersion=v${K8S_VERSION} -X ${vpkg}.gitMajor=1 -X ${vpkg}.gitMinor=${minor} -X ${vpkg}.gitTreeState=clean"
  GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kubemark \
    k8s.io/kubernetes/cmd/kubectl
fi

# --- etcd: its server module's etcdmain, in a module of its own (its
# dependency set differs from Kubernetes').
if [ ! -x "$out/etcd" ]; then
  log "building etcd v${ETCD_VERSION}"
  edir="$work/etcd-v${ETCD_VERSION}"
  rm -rf "$edir"; mkdir -p "$edir"
  cd "$edir"
  cat > go.mod <<MOD
module etcdbuild

go 1.26
MOD
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod edit -require="go.etcd.io/etcd/server/v3@v${ETCD_VERSION}"
  GOFLAGS="-mod=mod" go mod tidy >/dev/null
  GOFLAGS="-mod=mod" go build -trimpath -ldflags="-s -w" -o "$out/etcd" .
fi

have_all || { log "missing binaries in $out"; exit 1; }
echo "$out"
