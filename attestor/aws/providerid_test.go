package aws

import (
	"context"
	"testing"

	awsemu "sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
)

func TestProviderIDFromIMDS(t *testing.T) {
	emu := awsemu.New(t, awsemu.Instance{AvailabilityZone: "eu-test-1c", InstanceID: "i-0abc"})
	a, err := NewAttestor(AttestorConfig{IMDSEndpoint: emu.IMDSURL})
	if err != nil {
		t.Fatal(err)
	}
	got, err := a.ProviderID(context.Background())
	if err != nil || got != "aws:///eu-test-1c/i-0abc" {
		t.Fatalf("ProviderID = %q, %v; want aws:///eu-test-1c/i-0abc", got, err)
	}
	emu.SetDocument([]byte(`{"accountId":"111122223333"}`))
	if got, err := a.ProviderID(context.Background()); err == nil {
		t.Fatalf("ProviderID from a document without zone and instance = %q, want an error", got)
	}
}
