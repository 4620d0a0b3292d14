package app

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/signer/challengekey"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

// Defaults of the TPM attestor's options.
const (
	// DefaultTPMKeySecretName names the Secret holding the challenge keys
	// TPM challenges are sealed and their secrets derived under.
	DefaultTPMKeySecretName = "node-attestation-controller-tpm-key"
	// ChallengeKeyOverlap is how long a retired challenge key is kept:
	// the longest challenge lifetime any replica allows
	// (MaxTPMChallengeTTL), plus ample time for every replica to read the
	// new key (challengekey.DefaultResync).
	ChallengeKeyOverlap = MaxTPMChallengeTTL + 10*time.Minute
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
	// KeyRotationInterval is how long a challenge key stays current; 0
	// rotates only on demand (challengekey.AnnotationRotate).
	KeyRotationInterval time.Duration

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
		"Name of the Secret holding the keys TPM challenges are sealed and derived under (data key \"keys.json\"; the first format's single \"key\" is read too); "+
			"created with a random key when missing.")
	fs.DurationVar(&o.KeyRotationInterval, "challenge-key-rotation-interval", o.KeyRotationInterval,
		"How long a TPM challenge key stays current before a new one replaces it; the previous key is kept "+ChallengeKeyOverlap.String()+
			" for the challenges in flight, then dropped. 0: rotate only on demand (annotate the key Secret with "+challengekey.AnnotationRotate+").")
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
	if o.KeyRotationInterval != 0 && o.KeyRotationInterval < ChallengeKeyOverlap {
		errs = append(errs, fmt.Errorf("--challenge-key-rotation-interval %s must be 0 (on demand only) or at least %s (how long a previous key is kept)",
			o.KeyRotationInterval, ChallengeKeyOverlap))
	}
	if o.ChallengeTTL < MinTPMChallengeTTL || o.ChallengeTTL > MaxTPMChallengeTTL {
		errs = append(errs, fmt.Errorf("--tpm-challenge-ttl %s must be between %s and %s", o.ChallengeTTL, MinTPMChallengeTTL, MaxTPMChallengeTTL))
	}
	return slices.DeleteFunc(errs, func(err error) bool { return err == nil })
}

// tpmVerifierConfig is the TPM verifier's configuration: the manufacturer
// CA pool from the bundles, the challenge keys from their Secret (created
// when missing), kept current and rotated by a Rotator that runs until ctx
// ends.
func (o *Options) tpmVerifierConfig(ctx context.Context, c client.Client) (tpm.VerifierConfig, attestor.ChallengeKeys, error) {
	t := &o.TPM
	cfg := tpm.VerifierConfig{ChallengeTTL: t.ChallengeTTL}
	fail := func(err error) (tpm.VerifierConfig, attestor.ChallengeKeys, error) {
		return tpm.VerifierConfig{}, nil, err
	}
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
	rot := o.keyRotator(c, types.NamespacedName{Namespace: ns, Name: t.KeySecretName})
	if _, err := rot.Sync(ctx); err != nil {
		return fail(err)
	}
	go rot.Run(ctx, challengekey.DefaultResync)
	cfg.Keys = rot.Ring
	return cfg, rot.Ring, nil
}

// keyRotator returns the Rotator of the challenge key Secret nn.
func (o *Options) keyRotator(c client.Client, nn types.NamespacedName) *challengekey.Rotator {
	return &challengekey.Rotator{
		Client:   c,
		Secret:   nn,
		Ring:     &challengekey.Ring{},
		Interval: o.TPM.KeyRotationInterval,
		Overlap:  ChallengeKeyOverlap,
	}
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
