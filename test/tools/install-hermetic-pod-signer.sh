#!/usr/bin/env bash
# Builds hermetic-pod-signer (test/tools/hermetic-pod-signer/main.go): the
# upstream test signer of pod certificates
# (k8s.io/kubernetes/test/utils/hermeticpodcertificatesigner) as a program,
# the baseline of make bench-signer. It is built in the scratch module
# test/tools/install-k8s.sh made for the same Kubernetes release (so the build
# cache of that build is reused), and cached outside the repository keyed by
# version and by the program's hash. Prints the binary's path on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

K8S_VERSION="${K8S_VERSION:-1.36.3}"
KA_CACHE="${KA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator}"
"$here/install-k8s.sh" >/dev/null

src="$here/hermetic-pod-signer/main.go"
sum="$(sha256sum "$src" | cut -c1-12)"
out="$KA_CACHE/bin/hermetic-pod-signer-v${K8S_VERSION}-${sum}/hermetic-pod-signer"
if [ -x "$out" ]; then
  echo "$out"
  exit 0
fi
exec 9>"$KA_CACHE/install-hermetic-pod-signer.lock"
flock 9
if [ -x "$out" ]; then
  echo "$out"
  exit 0
fi
base="$KA_CACHE/src/k8s-v${K8S_VERSION}"
[ -f "$base/go.mod" ] || { echo "install-hermetic-pod-signer: no scratch module in $base (run test/tools/install-k8s.sh)" >&2; exit 1; }
work="$KA_CACHE/src/hermetic-pod-signer-v${K8S_VERSION}"
rm -rf "$work"; mkdir -p "$work"
sed 's/^module .*/module hermeticpodsigner/' "$base/go.mod" > "$work/go.mod"
cp "$base/go.sum" "$work/go.sum"
sed '/^\/\/go:build ignore$/d' "$src" > "$work/main.go"
cd "$work"
echo "install-hermetic-pod-signer: building (reuses the Kubernetes build cache)" >&2
vpkg=k8s.io/component-base/version
minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
ldflags="-s -w -X ${vpkg}.gitVersion=v${K8S_VERSION} -X ${vpkg}.gitMajor=1 -X ${vpkg}.gitMinor=${minor} -X ${vpkg}.gitTreeState=clean"
mkdir -p "$(dirname "$out")"
GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out.tmp" .
mv "$out.tmp" "$out"
echo "$out"
