package app

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/challengekey"
)

func TestChallengeKeySecret(t *testing.T) {
	ctx := context.Background()
	nn := types.NamespacedName{Namespace: "capi-system", Name: DefaultTPMKeySecretName}
	o := NewOptions()
	c := fake.NewClientBuilder().Build()
	first := o.keyRotator(c, nn)
	if _, err := first.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	id1, k1 := first.Ring.Current()
	if len(k1) != 32 || id1 != "k1" {
		t.Fatalf("generated key %q is %d bytes", id1, len(k1))
	}
	// Another replica (or the next start) reads the same key.
	second := o.keyRotator(c, nn)
	if _, err := second.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if id2, k2 := second.Ring.Current(); id2 != id1 || !bytes.Equal(k1, k2) {
		t.Fatalf("second replica: %s %x; want %s %x", id2, k2, id1, k1)
	}

	// The first format (one immutable key) is read as the legacy key.
	legacy := bytes.Repeat([]byte{7}, 32)
	old := fake.NewClientBuilder().WithObjects(&corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: nn.Namespace, Name: nn.Name, CreationTimestamp: metav1.Now()},
		Data:       map[string][]byte{challengekey.LegacyDataKey: legacy},
	}).Build()
	r := o.keyRotator(old, nn)
	if _, err := r.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if id, k := r.Ring.Current(); id != attestor.LegacyChallengeKeyID || !bytes.Equal(k, legacy) {
		t.Fatalf("first-format Secret read as %s %x", id, k)
	}

	short := fake.NewClientBuilder().WithObjects(&corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: nn.Namespace, Name: nn.Name},
		Data:       map[string][]byte{challengekey.LegacyDataKey: []byte("short")},
	}).Build()
	if _, err := o.keyRotator(short, nn).Sync(ctx); err == nil || !strings.Contains(err.Error(), "at least 32 are required") {
		t.Fatalf("short key accepted: %v", err)
	}
}

func TestTPMFlags(t *testing.T) {
	dir := t.TempDir()
	ca, err := tpmtest.NewManufacturerCA("flags", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Save(dir); err != nil {
		t.Fatal(err)
	}
	garbage := filepath.Join(dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}

	parse := func(args ...string) *Options {
		o := NewOptions()
		o.RESTConfig = &rest.Config{Host: "https://127.0.0.1:6443"}
		o.LeaderElectionNamespace = "capi-system"
		fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
		o.AddFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		if err := o.Complete(); err != nil {
			t.Fatal(err)
		}
		return o
	}

	o := parse("--tpm-manufacturer-ca="+filepath.Join(dir, tpmtest.BundleFile), "--tpm-challenge-ttl=30s", "--tpm-key-secret-name=k")
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.TPM.KeyRotationInterval != 30*24*time.Hour {
		t.Errorf("--challenge-key-rotation-interval defaults to %s, want 30 days", o.TPM.KeyRotationInterval)
	}
	if _, _, err := o.Verifiers(context.Background(), fake.NewClientBuilder().Build()); err != nil {
		t.Fatal(err)
	}

	o = parse("--tpm-manufacturer-ca="+garbage, "--tpm-manufacturer-ca=/nonexistent.pem", "--tpm-challenge-ttl=0s", "--tpm-key-secret-name=",
		"--challenge-key-rotation-interval=10m")
	err = o.Validate()
	if err == nil {
		t.Fatal("Validate() passed")
	}
	for _, want := range []string{"garbage.pem", "nonexistent.pem", "--tpm-challenge-ttl", "--tpm-key-secret-name", "--challenge-key-rotation-interval"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() does not report %s:\n%v", want, err)
		}
	}
}

// An operator who mounts the bundle at the conventional path needs no flag;
// one who does not still gets a controller that starts (TPMs are then
// trusted through infrastructure-reported EKs only); an unreadable bundle
// at that path stops the start.
func TestTPMDefaultManufacturerCA(t *testing.T) {
	dir := t.TempDir()
	ca, err := tpmtest.NewManufacturerCA("default", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Save(dir); err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, tpmtest.BundleFile)
	garbage := filepath.Join(dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, def  string
		flags      []string
		wantFiles  []string
		wantErrors bool
	}{
		{name: "default present", def: bundle, wantFiles: []string{bundle}},
		{name: "default absent", def: filepath.Join(dir, "absent.pem")},
		{name: "flag wins over the default", def: garbage, flags: []string{bundle}, wantFiles: []string{bundle}},
		{name: "default unparseable", def: garbage, wantFiles: []string{garbage}, wantErrors: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := TPMOptions{ManufacturerCAs: tc.flags, KeySecretName: "k", ChallengeTTL: time.Minute, defaultManufacturerCA: tc.def}
			files, err := o.manufacturerCAFiles()
			if err != nil || strings.Join(files, ",") != strings.Join(tc.wantFiles, ",") {
				t.Fatalf("manufacturerCAFiles() = %q, %v; want %q", files, err, tc.wantFiles)
			}
			if errs := o.validate(); (len(errs) > 0) != tc.wantErrors {
				t.Fatalf("validate() = %v, want errors: %v", errs, tc.wantErrors)
			}
		})
	}
}
