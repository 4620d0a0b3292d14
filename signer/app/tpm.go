package app

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// Defaults of the TPM attestor's options.
const (
	// DefaultTPMKeySecretName names the Secret holding the controller key
	// TPM challenge secrets are derived from.
	DefaultTPMKeySecretName = "node-attestation-controller-tpm-key"
	// TPMKeySecretKey is the key of the Secret's data holding the key.
	TPMKeySecretKey = "key"
	// tpmKeySize is the size of a generated key.
	tpmKeySize = 32
	// DefaultTPMManufacturerCAFile is the manufacturer CA bundle read when
	// no --tpm-manufacturer-ca is given, if it exists: where a deployment
	// mounts the operator's bundle (docs/attestors/tpm.md). When it does
	// not exist, no EK certificate is trusted.
	DefaultTPMManufacturerCAFile = "/etc/kubelet-authenticator/tpm-ca-certificates.pem"
	// MinTPMChallengeTTL and MaxTPMChallengeTTL bound --tpm-challenge-ttl;
	// the engine takes no challenge open longer than the latter.
	MinTPMChallengeTTL = time.Second
	MaxTPMChallengeTTL = engine.DefaultMaxChallengeTTL
)

// TPMOptions configure the TPM attestor's verifier half.
type TPMOptions struct {
	// ManufacturerCAs are PEM bundles of TPM manufacturer CA certificates
	// (roots and intermediates) that EK certificates must chain to.
	ManufacturerCAs []string
	// KeySecretNamespace and KeySecretName name the Secret on the
	// management cluster holding the controller key, shared by all
	// replicas; created with a random key when missing. The namespace
	// defaults to the leader election namespace.
	KeySecretNamespace, KeySecretName string
	// ChallengeTTL is how long a challenge may take to be answered.
	ChallengeTTL time.Duration

	// defaultManufacturerCA replaces DefaultTPMManufacturerCAFile (tests).
	defaultManufacturerCA string
}

func (o *TPMOptions) defaultCAFile() string {
	if o.defaultManufacturerCA != "" {
		return o.defaultManufacturerCA
	}
	return DefaultTPMManufacturerCAFile
}

// manufacturerCAFiles returns the manufacturer CA bundles to load:
// --tpm-manufacturer-ca, else DefaultTPMManufacturerCAFile if it exists.
func (o *TPMOptions) manufacturerCAFiles() ([]string, error) {
	if len(o.ManufacturerCAs) > 0 {
		return o.ManufacturerCAs, nil
	}
	def := o.defaultCAFile()
	if _, err := os.Stat(def); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("--tpm-manufacturer-ca default %s: %w", def, err)
	}
	return []string{def}, nil
}

// AddFlags adds the TPM options' flags to fs.
func (o *TPMOptions) AddFlags(fs *pflag.FlagSet) {
	fs.StringArrayVar(&o.ManufacturerCAs, "tpm-manufacturer-ca", o.ManufacturerCAs,
		"PEM file of TPM manufacturer CA certificates (roots and the intermediates that issue EK certificates); repeatable. "+
			"When not given, "+DefaultTPMManufacturerCAFile+" is read if it exists. "+
			"Without a bundle, a TPM is trusted only when its Machine carries the cluster-x-k8s-io/tpm-endorsement-key annotation.")
	fs.StringVar(&o.KeySecretNamespace, "tpm-key-secret-namespace", o.KeySecretNamespace,
		"Namespace of the Secret holding the key TPM challenges are derived from. Empty: the leader election namespace.")
	fs.StringVar(&o.KeySecretName, "tpm-key-secret-name", o.KeySecretName,
		"Name of the Secret holding the key TPM challenges are derived from (data key \"key\", at least 32 bytes); created with a random key when missing.")
	fs.DurationVar(&o.ChallengeTTL, "tpm-challenge-ttl", o.ChallengeTTL,
		"How long a node has to answer a TPM challenge; an unanswered challenge's request is then denied ChallengeExpired.")
}

// validate reports every problem with the TPM options.
func (o *TPMOptions) validate() []error {
	files, err := o.manufacturerCAFiles()
	errs := []error{err}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, fmt.Errorf("--tpm-manufacturer-ca: %w", err))
			continue
		}
		if _, _, err := tpm.LoadManufacturerCAs(data); err != nil {
			errs = append(errs, fmt.Errorf("--tpm-manufacturer-ca %s: %s", f, strings.ReplaceAll(err.Error(), "\n", "; ")))
		}
	}
	if o.KeySecretName == "" {
		errs = append(errs, errors.New("--tpm-key-secret-name must not be empty"))
	}
	if o.ChallengeTTL < MinTPMChallengeTTL || o.ChallengeTTL > MaxTPMChallengeTTL {
		errs = append(errs, fmt.Errorf("--tpm-challenge-ttl %s must be between %s and %s", o.ChallengeTTL, MinTPMChallengeTTL, MaxTPMChallengeTTL))
	}
	return slices.DeleteFunc(errs, func(err error) bool { return err == nil })
}

// tpmVerifierConfig is the TPM verifier's configuration: the manufacturer
// CA pool from the bundles, the controller key from its Secret (created
// when missing).
func (o *Options) tpmVerifierConfig(ctx context.Context, c client.Client) (tpm.VerifierConfig, []byte, error) {
	t := &o.TPM
	cfg := tpm.VerifierConfig{ChallengeTTL: t.ChallengeTTL}
	fail := func(err error) (tpm.VerifierConfig, []byte, error) { return tpm.VerifierConfig{}, nil, err }
	files, err := t.manufacturerCAFiles()
	if err != nil {
		return fail(err)
	}
	if len(files) == 0 {
		klog.FromContext(ctx).Info("No TPM manufacturer CA bundle: EK certificates are not trusted, only EKs Machines report (cluster-x-k8s-io/tpm-endorsement-key)",
			"defaultBundle", t.defaultCAFile())
	} else {
		var bundles [][]byte
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				return fail(fmt.Errorf("--tpm-manufacturer-ca: %w", err))
			}
			bundles = append(bundles, data)
		}
		roots, inters, err := tpm.LoadManufacturerCAs(bundles...)
		if err != nil {
			return fail(fmt.Errorf("--tpm-manufacturer-ca: %w", err))
		}
		cfg.Roots, cfg.Intermediates = roots, inters
		klog.FromContext(ctx).Info("TPM manufacturer CA bundle loaded", "files", files)
	}
	ns := t.KeySecretNamespace
	if ns == "" {
		ns = o.namespace()
	}
	if ns == "" {
		return fail(errors.New("--tpm-key-secret-namespace is required outside a cluster without --leader-election-namespace"))
	}
	key, err := EnsureKeySecret(ctx, c, types.NamespacedName{Namespace: ns, Name: t.KeySecretName})
	if err != nil {
		return fail(err)
	}
	cfg.HMACKey = key
	return cfg, key, nil
}

// namespace is the controller's own namespace: the leader election one, or
// the pod's.
func (o *Options) namespace() string {
	if o.LeaderElectionNamespace != "" {
		return o.LeaderElectionNamespace
	}
	if b, err := os.ReadFile(inClusterNamespaceFile); err == nil {
		return strings.TrimSpace(string(b))
	}
	return ""
}

// EnsureKeySecret returns the controller key from the Secret nn, creating
// the Secret with a random 32-byte key when it does not exist. Creation is
// atomic: when replicas race, every one ends up with the key that was
// created first.
func EnsureKeySecret(ctx context.Context, c client.Client, nn types.NamespacedName) ([]byte, error) {
	var s corev1.Secret
	err := c.Get(ctx, nn, &s)
	if apierrors.IsNotFound(err) {
		key := make([]byte, tpmKeySize)
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		s = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: nn.Namespace,
				Name:      nn.Name,
				Labels:    map[string]string{"app.kubernetes.io/managed-by": "node-attestation-controller"},
				Annotations: map[string]string{
					"kubelet-authenticator.x-k8s.io/purpose": "TPM challenge secrets are derived from this key; replacing it voids the challenges in flight (nodes file anew)",
				},
			},
			Type:      corev1.SecretTypeOpaque,
			Data:      map[string][]byte{TPMKeySecretKey: key},
			Immutable: new(bool),
		}
		*s.Immutable = true
		err = c.Create(ctx, &s)
		if err == nil {
			return key, nil
		}
		if !apierrors.IsAlreadyExists(err) {
			return nil, fmt.Errorf("unable to create the TPM key Secret %s: %w", nn, err)
		}
		err = c.Get(ctx, nn, &s)
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read the TPM key Secret %s: %w", nn, err)
	}
	key := s.Data[TPMKeySecretKey]
	if len(key) < tpmKeySize {
		return nil, fmt.Errorf("the TPM key Secret %s holds a %d-byte %q key; at least %d bytes are required (delete the Secret to have a new one made)", nn, len(key), TPMKeySecretKey, tpmKeySize)
	}
	return key, nil
}
