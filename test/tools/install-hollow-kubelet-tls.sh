#!/usr/bin/env bash
# Builds hollow-kubelet-tls (test/tools/hollow-kubelet-tls/main.go): kubemark's
# hollow kubelet serving HTTPS with kubelet's tlsCertFile/tlsPrivateKeyFile
# handling, which kubemark itself cannot do. It is built in the scratch module
# test/tools/install-k8s.sh made for the same Kubernetes release (so the build
# cache of that build is reused), and cached outside the repository keyed by
# version and by the program's hash. Prints the binary's path on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

K8S_VERSION="${K8S_VERSION:-1.36.3}"
KA_CACHE="${KA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubelet-authenticator}"
"$here/install-k8s.sh" >/dev/null

src="$here/hollow-kubelet-tls/main.go"
sum="$(sha256sum "$src" | cut -c1-12)"
out="$KA_CACHE/bin/hollow-kubelet-tls-v${K8S_VERSION}-${sum}/hollow-kubelet-tls"
if [ -x "$out" ]; then
  echo "$out"
  exit 0
fi
exec 9>"$KA_CACHE/install-hollow-kubelet-tls.lock"
flock 9
if [ -x "$out" ]; then
  echo "$out"
  exit 0
fi
base="$KA_CACHE/src/k8s-v${K8S_VERSION}"
[ -f "$base/go.mod" ] || { echo "install-hollow-kubelet-tls: no scratch module in $base (run test/tools/install-k8s.sh)" >&2; exit 1; }
work="$KA_CACHE/src/hollow-kubelet-tls-v${K8S_VERSION}"
rm -rf "$work"; mkdir -p "$work"
sed 's/^module .*/module hollowkubelettls/' "$base/go.mod" > "$work/go.mod"
cp "$base/go.sum" "$work/go.sum"
sed '/^\/\/go:build ignore$/d' "$src" > "$work/main.go"
cd "$work"
echo "install-hollow-kubelet-tls: building (reuses the Kubernetes build cache)" >&2
vpkg=k8s.io/component-base/version
minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
ldflags="-s -w -X ${vpkg}.gitVersion=v${K8S_VERSION} -X ${vpkg}.gitMajor=1 -X ${vpkg}.gitMinor=${minor} -X ${vpkg}.gitTreeState=clean"
mkdir -p "$(dirname "$out")"
GOFLAGS="-mod=mod" go build -trimpath -ldflags="$ldflags" -o "$out.tmp" .
mv "$out.tmp" "$out"
echo "$out"
