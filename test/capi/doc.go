// Package capi tests the product in the loop with the real Cluster API
// controllers: the core manager and the kubeadm bootstrap provider (CABPK),
// built by test/tools/install-capi.sh, run against a real management API
// server with their webhooks served. A small infrastructure provider written
// in the test stands in for a cloud; nodes boot from the cloud-init CABPK
// generates for the KubeadmConfigTemplate of docs/examples, and run the node
// binary and kubemark's hollow kubelet. The tests skip when KA_CAPI_BIN is
// unset (make test sets it).
package capi
