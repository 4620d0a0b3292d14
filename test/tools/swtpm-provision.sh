#!/usr/bin/env bash
# Manufacture a swtpm TPM 2.0 whose EK certificates chain to a self-made
# manufacturer CA, the way a TPM vendor provisions a chip.
#
#   test/tools/swtpm-provision.sh DIR [CADIR]
#
# Creates, under DIR (which must exist and be empty or absent):
#   state/                 the TPM state (swtpm --tpmstate dir=DIR/state)
#   ca/                    the manufacturer CA (swtpm_localca: a root CA and
#                          an intermediate that signs EK certificates), or
#                          CADIR when given: TPMs provisioned with the same
#                          CADIR share one manufacturer, as a vendor's chips
#                          do (swtpm_localca creates it on first use and
#                          locks it, so several may be provisioned at once)
#   manufacturer-ca.pem    root + intermediate, the bundle a verifier trusts
#   ek/                    copies of the EK certificates swtpm_setup stored
#                          in NV (RSA 2048 at 0x01c00002, ECC P-384 at 0x01c00016)
# Then run the TPM with, e.g.:
#   swtpm socket --tpm2 --tpmstate dir=DIR/state \
#     --server type=unixio,path=DIR/tpm.sock --ctrl type=unixio,path=DIR/ctrl.sock \
#     --flags not-need-init,startup-clear
# and point the node attestor at unix://DIR/tpm.sock.
#
# Needs swtpm and swtpm-tools (test/tools/apt-packages.txt). Nothing outside
# DIR (and CADIR) is written: swtpm_setup and swtpm_localca get their own
# config files.
set -euo pipefail

dir=${1:?usage: $0 DIR [CADIR]}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
ca=${2:-$dir/ca}
mkdir -p "$ca"
ca=$(cd "$ca" && pwd)
for tool in swtpm swtpm_setup swtpm_localca; do
	command -v "$tool" >/dev/null || { echo "$0: $tool not found; install swtpm swtpm-tools" >&2; exit 1; }
done
mkdir -p "$dir/state" "$dir/ek"

cat >"$dir/swtpm-localca.conf" <<CONF
statedir = $ca
signingkey = $ca/signkey.pem
issuercert = $ca/issuercert.pem
certserial = $ca/certserial
CONF
cat >"$dir/swtpm-localca.options" <<CONF
--platform-manufacturer kubelet-authenticator-test
--platform-version 2.1
--platform-model swtpm
CONF
cat >"$dir/swtpm_setup.conf" <<CONF
create_certs_tool = $(command -v swtpm_localca)
create_certs_tool_config = $dir/swtpm-localca.conf
create_certs_tool_options = $dir/swtpm-localca.options
active_pcr_banks = sha256
CONF

# swtpm_localca creates the root CA (swtpm-localca-rootca) and the
# intermediate (swtpm-localca) in statedir on first use.
swtpm_setup --tpm2 --tpmstate "$dir/state" --create-ek-cert \
	--config "$dir/swtpm_setup.conf" --write-ek-cert-files "$dir/ek" \
	--overwrite --logfile "$dir/swtpm_setup.log"

cat "$ca/swtpm-localca-rootca-cert.pem" "$ca/issuercert.pem" >"$dir/manufacturer-ca.pem"
echo "$dir/manufacturer-ca.pem"
