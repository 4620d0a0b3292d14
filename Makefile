# kubelet-authenticator. `make help` lists the targets.

SHELL := /usr/bin/env bash
.DEFAULT_GOAL := help

GO          ?= go
BIN         ?= bin
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo v0.0.0-dev)
COMMIT      ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS     := -s -w -X sigs.k8s.io/kubelet-authenticator/version.gitVersion=$(VERSION) -X sigs.k8s.io/kubelet-authenticator/version.gitCommit=$(COMMIT)
# Build tags of the test and demo binaries: the in-process TPM simulator and
# the test-only attestors. Release builds (make build) use none of them.
TEST_TAGS   ?= tpmsimulator testattestors
TEST_TIMEOUT ?= 45m
# Release platforms and commands of make build and make images.
PLATFORMS   ?= linux/amd64 linux/arm64
RELEASE_CMDS := kubelet-authenticator node-attestation-controller tpm-boot-policy
# The controller's image. No image is published: set REGISTRY to one you can
# push to. make images names the image IMAGE, make push-images pushes it there,
# and make release-manifests writes IMAGE into the clusterctl components and
# the packaged Helm chart, so that what is installed is what was pushed. The
# release version is the chart's appVersion (also the series of
# deploy/release/metadata.yaml).
REGISTRY        ?= registry.k8s.io/kubelet-authenticator
RELEASE_VERSION ?= $(shell sed -n 's/^appVersion: *//p' deploy/helm/kubelet-authenticator/Chart.yaml)
IMAGE_NAME      ?= $(REGISTRY)/node-attestation-controller
IMAGE           := $(IMAGE_NAME):$(RELEASE_VERSION)

# Where the Kubernetes and etcd binaries live (built once, cached outside the
# repository); computed only by the targets that need them.
k8s_bin = $(shell test/tools/setup.sh)
# The demo and the benchmarks need no Cluster API binaries and no helm.
k8s_only_bin = $(shell test/tools/setup.sh --kubernetes-only)
capi_bin = $(shell test/tools/install-capi.sh)
# controller-gen generates the API's deepcopy and CRD (make generate); it is
# installed from its Go module into the same cache outside the repository.
KA_CACHE        ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kubelet-authenticator
CONTROLLER_GEN_VERSION ?= v0.23.0
CONTROLLER_GEN  := $(KA_CACHE)/bin/controller-gen-$(CONTROLLER_GEN_VERSION)/controller-gen
# golangci-lint runs the linters of .golangci.yml in make lint; installed
# from its Go module like controller-gen.
GOLANGCI_LINT_VERSION ?= v2.15.0
GOLANGCI_LINT   := $(KA_CACHE)/bin/golangci-lint-$(GOLANGCI_LINT_VERSION)/golangci-lint
# Where the generated CRDs go (kustomize and clusterctl install them; the
# Helm chart's crds/ links to them).
CRD_DIR         := deploy/crd/bases
helm_bin = $(shell test/tools/install-helm.sh)

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "; printf "Targets:\n"} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build the node binary, the controller and tpm-boot-policy (for image builders) for linux/amd64 and linux/arm64 into bin/<os>_<arch>/ (release: static, no simulator, no test attestors)
	@set -e; for p in $(PLATFORMS); do \
	  os="$${p%/*}"; arch="$${p#*/}"; out="$(BIN)/$${os}_$${arch}"; \
	  for c in $(RELEASE_CMDS); do \
	    echo "$$out/$$c"; \
	    CGO_ENABLED=0 GOOS="$$os" GOARCH="$$arch" $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o "$$out/$$c" ./cmd/$$c; \
	  done; \
	done

oci_args = --version '$(VERSION)' --image '$(IMAGE)' --output $(BIN)/images/node-attestation-controller \
	  $(foreach p,$(PLATFORMS),--binary $(p)=$(BIN)/$(subst /,_,$(p))/node-attestation-controller)

.PHONY: images
images: build ## Build the controller's container image IMAGE (REGISTRY/node-attestation-controller:RELEASE_VERSION; OCI layout and archive, no container engine) into bin/images/
	$(GO) run ./images/oci $(oci_args)

.PHONY: push-images
push-images: build ## Build the controller's image and push it to IMAGE (credentials: ~/.docker/config.json, as docker login writes it)
	$(GO) run ./images/oci $(oci_args) --push

.PHONY: release-manifests
release-manifests: ## Write the clusterctl add-on provider artifacts (addon-components.yaml, metadata.yaml; also as a clusterctl local repository) and the packaged Helm chart, all naming IMAGE, into bin/release/
	@bin_dir="$(k8s_only_bin)"; helm_dir="$(helm_bin)"; set -e; \
	out="$(abspath $(BIN))/release"; repo="$$out/addon-kubelet-authenticator/$(RELEASE_VERSION)"; \
	tmp="$$(mktemp -d)"; trap 'rm -rf "$$tmp"' EXIT; mkdir -p "$$repo" "$$tmp/release"; \
	printf 'resources:\n- %s\nimages:\n- name: registry.k8s.io/kubelet-authenticator/node-attestation-controller\n  newName: %s\n  newTag: %s\n' \
	  "$$(realpath --relative-to="$$tmp/release" deploy/release)" '$(IMAGE_NAME)' '$(RELEASE_VERSION)' > "$$tmp/release/kustomization.yaml"; \
	"$$bin_dir/kubectl" kustomize "$$tmp/release" > "$$out/addon-components.yaml"; \
	cp deploy/release/metadata.yaml "$$out/metadata.yaml"; \
	cp "$$out/addon-components.yaml" "$$out/metadata.yaml" "$$repo/"; \
	cp -RL deploy/helm/kubelet-authenticator "$$tmp/chart"; \
	sed -i 's|^  repository: .*|  repository: $(IMAGE_NAME)|' "$$tmp/chart/values.yaml"; \
	"$$helm_dir/helm" package "$$tmp/chart" --app-version '$(RELEASE_VERSION)' --destination "$$out" >/dev/null; \
	echo "$$out: addon-components.yaml metadata.yaml $$(cd "$$out" && ls *.tgz) addon-kubelet-authenticator/$(RELEASE_VERSION)/ (image $(IMAGE))"

.PHONY: tools
tools: ## Install test dependencies (Debian packages, Kubernetes binaries built from Go modules)
	@test/tools/setup.sh

.PHONY: test
test: ## Run every test: unit, integration and end-to-end against real kube-apiserver + etcd (and the real Cluster API controllers)
	@bin_dir="$(k8s_bin)"; test -x "$$bin_dir/kube-apiserver" || { echo "no Kubernetes binaries"; exit 1; }; \
	capi_dir="$(capi_bin)"; test -x "$$capi_dir/capi-manager" || { echo "no Cluster API binaries"; exit 1; }; \
	helm_dir="$(helm_bin)"; test -x "$$helm_dir/helm" || { echo "no helm"; exit 1; }; \
	KA_K8S_BIN="$$bin_dir" KA_CAPI_BIN="$$capi_dir" KA_HELM_BIN="$$helm_dir" $(GO) test -tags '$(TEST_TAGS)' -timeout $(TEST_TIMEOUT) -count=1 ./...

.PHONY: test-unit
test-unit: ## Run the tests that need no control plane
	$(GO) test -tags '$(TEST_TAGS)' -count=1 -short ./...

.PHONY: demo
demo: ## Start a management and a workload cluster and show a node attest, get its certificate and talk as itself (ATTESTOR=tpm|aws|azure|gcp|insecure, default tpm)
	@bin_dir="$(k8s_only_bin)"; test -x "$$bin_dir/kube-apiserver" || { echo "no Kubernetes binaries"; exit 1; }; \
	mkdir -p $(BIN) && $(GO) test -c -tags '$(TEST_TAGS)' -o $(BIN)/demo ./test/demo && \
	KA_K8S_BIN="$$bin_dir" KA_DEMO=1 KA_DEMO_ATTESTOR='$(ATTESTOR)' $(BIN)/demo -test.run '^TestDemo$$' -test.timeout 30m

.PHONY: bench
bench: ## Benchmarks: exec plugin cached path against the floor; the limiter behind kubelet bootstrap's 400 ms; cold path of every attestor against kubelet's TLS bootstrap, spaced and back to back, interleaved
	@bin_dir="$(k8s_only_bin)"; \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench BenchmarkCachedPath -benchtime 500x -count=1 ./test/bench/ && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkKubeletBootstrapLimiter$$' -benchtime 2x -count=1 ./test/bench/ && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkColdPath$$' -benchtime 30x -count=1 -timeout 30m ./test/bench/ && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkTPMBootState$$' -benchtime 20x -count=1 ./test/bench/

# Size of the fleet join of make bench-signer (documented: 1,000 nodes, 50 at a time;
# TPM nodes on swtpm: 32 at once).
FLEET_TPM_NODES   ?= 32
FLEET_NODES       ?= 1000
FLEET_CONCURRENCY ?= 50
# Opted-in Clusters two --sharding replicas share in make bench-signer (documented: 5,000).
SHARD_CLUSTERS ?= 5000
# Pod certificates each pod signer issues in make bench-signer (documented: 1,000).
POD_BENCH_REQUESTS ?= 1000
# Faults under load in make bench-signer (documented): nodes per Cluster
# joining during each fault, and opt-in/opt-out cycles of the leak check.
FAULT_WAVE    ?= 10
OPT_IN_CYCLES ?= 100

.PHONY: bench-signer
bench-signer: ## Benchmarks: fleet join (FLEET_NODES exec-plugin processes, FLEET_CONCURRENCY at a time) against tuned and default kube-controller-manager, with an SVG plot in bin/; FLEET_TPM_NODES TPM nodes on swtpm at once, first join and rejoin; controller CSRs/s on 500 pending CSRs; its memory with 0 and 10,000 Machines; its peak memory and a healthy cluster's join rate while four tenants' API servers attack it; its peak memory under a flood of CSRs with huge metadata, beside its idle figure, with the join rate during it; what an opted-in Cluster costs (1 and 500 Clusters), and SHARD_CLUSTERS Clusters on two --sharding replicas; POD_BENCH_REQUESTS pod certificates from our pod signer and the upstream hermetic test signer, interleaved; the faults under load with FAULT_WAVE nodes per Cluster and fault, and OPT_IN_CYCLES opt-in/opt-out cycles of a Cluster without a leak (log in bin/faults.log)
	@bin_dir="$(k8s_only_bin)"; \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkFleetJoin$$' -benchtime 1x -count=1 -timeout 60m ./test/bench/ \
	  -args -fleet-nodes=$(FLEET_NODES) -fleet-concurrency=$(FLEET_CONCURRENCY) -fleet-plot=$(abspath $(BIN))/fleet-join.svg && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkFleetJoinTPM$$' -benchtime 2x -count=1 -timeout 30m ./test/bench/ \
	  -args -fleet-tpm-nodes=$(FLEET_TPM_NODES) && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkSigner(Throughput|Memory|Hostile|MetadataFlood|Clusters)$$' -benchtime 1x -count=1 -timeout 30m ./test/bench/ && \
	KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkSignerShardedClusters$$' -benchtime 1x -count=1 -timeout 60m ./test/bench/ \
	  -args -shard-clusters=$(SHARD_CLUSTERS) && \
	test/tools/install-hermetic-pod-signer.sh >/dev/null && \
	KA_K8S_BIN="$$bin_dir" POD_BENCH_REQUESTS=$(POD_BENCH_REQUESTS) $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench '^BenchmarkPodCertificates$$' -benchtime 1x -count=1 -timeout 30m ./test/bench/ && \
	mkdir -p $(BIN) && \
	{ KA_K8S_BIN="$$bin_dir" $(GO) test -tags '$(TEST_TAGS)' -run '^Test(SignerFaults|SignerOptInCycles)$$' -v -count=1 -timeout 30m ./test/integration/ \
	  -args -fault-wave=$(FAULT_WAVE) -opt-in-cycles=$(OPT_IN_CYCLES) >$(BIN)/faults.log 2>&1; rc=$$?; \
	  grep -E 'signer_(faults|leak)_test\.go|^(ok|FAIL|--- )' $(BIN)/faults.log; test $$rc -eq 0; }

.PHONY: lint
lint: verify-generate $(GOLANGCI_LINT) ## gofmt, go vet with and without the test tags, golangci-lint (.golangci.yml), and generated files current
	@out="$$(gofmt -l $$(git ls-files '*.go'))"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags '$(TEST_TAGS)' ./...
	$(GOLANGCI_LINT) run ./...

$(GOLANGCI_LINT):
	@mkdir -p $(@D)
	GOBIN=$(abspath $(@D)) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)

$(CONTROLLER_GEN):
	@mkdir -p $(@D)
	GOBIN=$(abspath $(@D)) $(GO) install sigs.k8s.io/controller-tools/cmd/controller-gen@$(CONTROLLER_GEN_VERSION)

.PHONY: generate
generate: $(CONTROLLER_GEN) ## Generate the API's deepcopy (api/) and its CRDs (deploy/crd/bases) with controller-gen
	$(CONTROLLER_GEN) object paths=./api/... crd:crdVersions=v1 output:crd:artifacts:config=$(CRD_DIR)

.PHONY: verify-generate
verify-generate: $(CONTROLLER_GEN) ## Fail when make generate changes a generated file (it leaves the regenerated file in place)
	@sum() { find api $(CRD_DIR) -name 'zz_generated.*.go' -o -name '*.yaml' | sort | xargs sha256sum | sha256sum; }; \
	before="$$(sum)"; $(MAKE) --no-print-directory generate >/dev/null; \
	if [ "$$(sum)" != "$$before" ]; then echo "generated files were not current: make generate rewrote them; review and commit them"; exit 1; fi

.PHONY: clean
clean: ## Remove build output
	rm -rf $(BIN)
