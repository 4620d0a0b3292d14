module sigs.k8s.io/kubelet-authenticator

go 1.26
