package gcp

import (
	"context"
	"testing"

	gcpemu "sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
)

func TestProviderIDFromMetadata(t *testing.T) {
	emu := gcpemu.New(t, gcpemu.Instance{ProjectID: "p-1", Zone: "europe-test1-c", InstanceName: "node-7"})
	a, err := NewAttestor(AttestorConfig{MetadataEndpoint: emu.MetadataURL})
	if err != nil {
		t.Fatal(err)
	}
	got, err := a.ProviderID(context.Background())
	if err != nil || got != "gce://p-1/europe-test1-c/node-7" {
		t.Fatalf("ProviderID = %q, %v; want gce://p-1/europe-test1-c/node-7", got, err)
	}
	// Anything but a metadata server gives no provider ID.
	a, _ = NewAttestor(AttestorConfig{MetadataEndpoint: emu.JWKSURL})
	if got, err := a.ProviderID(context.Background()); err == nil {
		t.Fatalf("ProviderID from a non-metadata server = %q, want an error", got)
	}
}
