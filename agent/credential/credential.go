// Package credential obtains the kubelet client credential: from the cache
// when it is fresh, otherwise by attesting, filing a CSR and waiting for the
// signer. It is what the exec plugin and the agent's renewal both call.
package credential

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/agent/kube"
	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Denial reasons of a challenge that was not answered in time (a node
// that was down, slow or cut off between the two rounds), after which the
// node files anew, with a new key, once in the same call.
var challengeLostReasons = []string{attestor.ReasonChallengeExpired}

// Source obtains credentials. It logs its progress (attestation, each CSR,
// the signer's decision) to the logger of the context it is called with
// (klog.FromContext): the exec plugin's goes to stderr.
type Source struct {
	Config   *config.NodeConfig
	Attestor attestor.Attestor
	// Cluster is the cluster the credential is for, from
	// KUBERNETES_EXEC_INFO; nil when not provided.
	Cluster *clientauthv1.Cluster
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock
}

func (s *Source) now() time.Time {
	if s.Clock != nil {
		return s.Clock.Now()
	}
	return time.Now()
}

func (s *Source) dir() cache.Dir { return cache.Dir{Path: s.Config.CacheDir} }

// Cached returns the cached credential if it is fresh: its key matches, it
// is inside its validity with the safety margin and not past the point
// where the exec plugin renews. It takes no lock and touches no network.
func (s *Source) Cached() (*cache.Credential, bool) {
	cred, err := s.dir().Load()
	if err != nil || !s.forThisNode(cred) {
		return nil, false
	}
	return cred, rotation.Fresh(cred.Leaf, s.now())
}

// forThisNode reports whether cred was issued for the configured node name
// (the configuration may have changed since).
func (s *Source) forThisNode(cred *cache.Credential) bool {
	return cred.Leaf.Subject.CommonName == attestor.NodeUserPrefix+s.Config.NodeName
}

// Get returns a credential kubelet can use now, and the time until which it
// should be reused. When the cache is not fresh it takes the cache lock,
// looks again (another process may have renewed it meanwhile) and renews.
// If renewing fails while the cached certificate is still usable, that
// certificate is returned and the failure only logged: a failed renewal never
// takes a working credential away.
func (s *Source) Get(ctx context.Context) (*cache.Credential, time.Time, error) {
	if cred, ok := s.Cached(); ok {
		return cred, rotation.Expiration(cred.Leaf), nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.Config.RequestTimeout.Duration)
	defer cancel()
	unlock, err := s.dir().Lock(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	defer unlock()
	return s.renewLocked(ctx, false)
}

// Renew obtains a new credential even if the cached one is fresh (the agent
// calls it at its renewal point). It holds the cache lock throughout. A
// failed renewal is returned as an error; the cached credential is left as
// it was, so whoever reads the cache keeps using it.
func (s *Source) Renew(ctx context.Context) (*cache.Credential, time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, s.Config.RequestTimeout.Duration)
	defer cancel()
	unlock, err := s.dir().Lock(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	defer unlock()
	return s.renewLocked(ctx, true)
}

// renewLocked renews unless the cached credential is fresh and force is
// false. When renewing fails while the cached credential is still usable,
// Get (force false) hands that credential out; Renew (force true) reports
// the failure.
func (s *Source) renewLocked(ctx context.Context, force bool) (*cache.Credential, time.Time, error) {
	log := klog.FromContext(ctx)
	current, err := s.dir().Load()
	switch {
	case errors.Is(err, cache.ErrNotFound):
		current = nil
	case err != nil:
		log.Info("Replacing the unusable cached credential", "err", err)
		current = nil
	case !s.forThisNode(current):
		log.Info("Replacing the cached credential of another node", "cached", current.Leaf.Subject.CommonName, "node", s.Config.NodeName)
		current = nil
	case !force && rotation.Fresh(current.Leaf, s.now()):
		return current, rotation.Expiration(current.Leaf), nil
	}
	var lapsed *x509.Certificate
	if current != nil && !rotation.Usable(current.Leaf, s.now()) {
		lapsed, current = current.Leaf, nil
	}
	cred, err := s.obtain(ctx, current)
	if err != nil {
		if current == nil && apierrors.IsUnauthorized(err) {
			err = s.bootstrapRefused(lapsed, err)
		}
		if current != nil && !force {
			retry := s.now().Add(time.Minute)
			if end := current.Leaf.NotAfter.Add(-rotation.Margin(current.Leaf)); end.Before(retry) {
				retry = end
			}
			log.Error(err, "Renewal failed; keeping the current certificate", "notAfter", current.Leaf.NotAfter.UTC().Format(time.RFC3339))
			return current, retry, nil
		}
		return nil, time.Time{}, err
	}
	return cred, rotation.Expiration(cred.Leaf), nil
}

// Request is one kind of certificate the node asks a signer for: the
// client certificate (the exec plugin's and the agent's renewals), or the
// serving certificate (agent/serving). Every kind goes through the same
// steps: a key kept while its CSR is in flight, fresh evidence bound to it,
// version negotiation, the challenge round, and the wait.
type Request struct {
	// SignerName, Usages and Lifetime (0: the signer's) go into the CSR
	// object.
	SignerName string
	Usages     []certificatesv1.KeyUsage
	Lifetime   time.Duration
	// PKCS10 builds the DER certificate request for key.
	PKCS10 func(key *ecdsa.PrivateKey) ([]byte, error)
	// PendingKeyFile names the file of the cache directory that keeps the
	// key of a request in flight, so that a retry finds the same CSR.
	PendingKeyFile string
	// Store keeps the issued chain (PEM) and its key (PEM, PKCS#8); the
	// pending key is dropped once it succeeds.
	Store func(certPEM, keyPEM []byte) error
}

// obtain files a client CSR with fresh evidence and waits for the
// certificate. current, when set, is a usable certificate that
// authenticates the renewal as the node itself.
func (s *Source) obtain(ctx context.Context, current *cache.Credential) (*cache.Credential, error) {
	cfg := s.Config
	restCfg, err := s.restConfig(ctx, current)
	if err != nil {
		return nil, err
	}
	dir := s.dir()
	if current == nil {
		// A bootstrap talks to the bootstrap kubeconfig's cluster, which is
		// what a success records: record it while the signer works, off the
		// cold path's critical path. It is only read once the bootstrap
		// kubeconfig is gone, and then only with a credential, so a failed
		// bootstrap leaves nothing wrong behind. A renewal records its
		// cluster only once it has succeeded.
		recorded := make(chan struct{})
		go func() {
			defer close(recorded)
			s.recordCluster(ctx, restCfg)
		}()
		defer func() { <-recorded }()
	}
	err = s.Obtain(ctx, restCfg, &Request{
		SignerName:     cfg.SignerName,
		Usages:         csr.ClientUsages,
		Lifetime:       cfg.CertificateLifetime.Duration,
		PKCS10:         func(key *ecdsa.PrivateKey) ([]byte, error) { return csr.PKCS10(key, cfg.NodeName, cfg.ProviderID) },
		PendingKeyFile: cache.PendingKeyFile,
		Store: func(certPEM, keyPEM []byte) error {
			if err := dir.Store(certPEM, keyPEM); err != nil {
				return err
			}
			if current != nil {
				s.recordCluster(ctx, restCfg)
			}
			return nil
		},
	})
	if err != nil {
		return nil, err
	}
	return dir.Load()
}

// Obtain files r with fresh evidence through restCfg, waits for the
// certificate and stores it. A challenge lost to time (the request filed by
// an earlier call, challenged while nobody was there to answer) is filed
// anew once, so that no person has to step in.
func (s *Source) Obtain(ctx context.Context, restCfg *rest.Config, r *Request) error {
	err := s.obtainOnce(ctx, restCfg, r)
	var denied *csr.DeniedError
	if errors.As(err, &denied) && slices.Contains(challengeLostReasons, denied.Reason) {
		klog.FromContext(ctx).Info("The challenge was not answered in time; filing anew", "csr", denied.Name, "reason", denied.Reason)
		return s.obtainOnce(ctx, restCfg, r)
	}
	return err
}

func (s *Source) obtainOnce(ctx context.Context, restCfg *rest.Config, r *Request) error {
	log := klog.FromContext(ctx)
	cfg := s.Config
	client, err := csr.NewClient(restCfg)
	if err != nil {
		return err
	}
	dir := s.dir()
	key, err := pendingKey(dir, r.PendingKeyFile)
	if err != nil {
		return err
	}
	spki, err := csr.SPKI(key)
	if err != nil {
		return err
	}
	binding := attestor.Binding(spki)
	clusterCA, err := clusterCA(restCfg)
	if err != nil {
		// Only evidence of binding v2 needs it: versions of binding v1
		// can still be produced (the signer negotiates).
		log.Info("Evidence cannot name the cluster", "err", err)
	}
	j := &filing{client: client, key: key, provider: cfg.Attestor, nodeName: cfg.NodeName, r: r}
	if j.pkcs10, err = r.PKCS10(key); err != nil {
		return err
	}
	if d := r.Lifetime; d > 0 {
		v := int32(d / time.Second)
		j.expiration = &v
	}

	version := ""
	tried := map[string]bool{}
	for {
		req := &attestor.Request{NodeName: cfg.NodeName, ProviderID: cfg.ProviderID, Binding: binding, SPKI: spki, Version: version, ClusterCA: clusterCA}
		certPEM, err := s.fileAndWait(ctx, j, req)
		var denied *csr.DeniedError
		if errors.As(err, &denied) && denied.Reason == attestor.ReasonUnsupportedEvidenceVersion { // re-file in a version the signer supports
			tried[version] = true
			next, supported, ok := s.nextVersion(ctx, client, denied.Name, tried)
			if ok {
				log.Info("Re-filing with another evidence version", "csr", denied.Name, "rejected", j.version, "next", next)
				version = next
				continue
			}
			err = fmt.Errorf("no evidence version in common with the signer: the %s attestor produces %s, the signer accepts %s: %w",
				cfg.Attestor, strings.Join(s.Attestor.Versions(), ","), supported, err)
		}
		if err != nil {
			if errors.As(err, &denied) {
				// A denied key is never reused: the next attempt starts afresh.
				_ = dir.ClearKey(r.PendingKeyFile)
			}
			return err
		}
		return s.store(ctx, r, key, certPEM)
	}
}

// pendingKey returns the key of the request in flight kept in file, or a
// new one, kept there before it is used.
func pendingKey(dir cache.Dir, file string) (*ecdsa.PrivateKey, error) {
	key, err := dir.LoadKey(file)
	if err != nil || key != nil {
		return key, err
	}
	if key, err = csr.GenerateKey(); err != nil {
		return nil, fmt.Errorf("unable to generate key: %w", err)
	}
	if err := dir.StoreKey(file, key); err != nil {
		return nil, err
	}
	return key, nil
}

// store hands the issued chain and its key to r.Store and drops the
// pending key.
func (s *Source) store(ctx context.Context, r *Request, key *ecdsa.PrivateKey, certPEM []byte) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if err := r.Store(certPEM, keyPEM); err != nil {
		return err
	}
	if err := s.dir().ClearKey(r.PendingKeyFile); err != nil {
		klog.FromContext(ctx).Error(err, "Unable to remove the pending key", "file", r.PendingKeyFile)
	}
	return nil
}

// fileAndWait files one CSR (and, for attestors that answer a challenge, the
// second) and returns the issued certificate. Its log lines give the time
// since it started (elapsed).
func (s *Source) fileAndWait(ctx context.Context, j *filing, req *attestor.Request) ([]byte, error) {
	log := klog.FromContext(ctx)
	j.start = time.Now()

	// The CSR's name follows from the key and the evidence version (the
	// requested one, else the attestor's newest): the watch on it opens,
	// and with it the connection to the API server, while the attestor
	// works.
	j.version = req.Version
	if vs := s.Attestor.Versions(); j.version == "" && len(vs) > 0 {
		j.version = vs[0]
	}
	name, err := j.name("1")
	if err != nil {
		return nil, err
	}
	responder, _ := s.Attestor.(attestor.Responder)
	var challenge *attestor.Challenge
	obj, err := j.round(ctx, round{
		name: name,
		produce: func() (*attestor.Attestation, string, error) {
			att, err := s.Attestor.Attest(ctx, req)
			if err != nil {
				return nil, "", fmt.Errorf("attestation failed: %w", err)
			}
			log.Info("Attested", "attestor", j.provider, "elapsed", j.since())
			if att.Version != j.version {
				j.version = att.Version
				if name, err = j.name("1"); err != nil {
					return nil, "", err
				}
			}
			return att, name, nil
		},
		filed: func() {
			log.Info("Filed the certificate signing request",
				"csr", name, "signer", j.r.SignerName, "attestor", j.provider, "evidenceVersion", j.version, "elapsed", j.since())
		},
		done: func(o *certificatesv1.CertificateSigningRequest) (bool, error) {
			if ch, ok := o.Annotations[attestor.AnnotationChallenge]; ok && responder != nil {
				challenge = &attestor.Challenge{CSRName: o.Name, CSRUID: string(o.UID), Data: []byte(ch)}
				return true, nil
			}
			return false, nil
		},
	})
	if err != nil {
		return nil, err
	}
	if challenge == nil {
		log.Info("The signer decided", "csr", name, "elapsed", j.since())
		return csr.Outcome(obj)
	}
	log.Info("Challenged", "csr", name, "elapsed", j.since())
	return j.answer(ctx, responder, req, challenge, obj)
}

// answer is the second round: it answers the challenge on first in a new
// CSR over the same key, watched from before the answer is worked out.
func (j *filing) answer(ctx context.Context, responder attestor.Responder, req *attestor.Request, challenge *attestor.Challenge,
	first *certificatesv1.CertificateSigningRequest) ([]byte, error) {
	log := klog.FromContext(ctx)
	name2, err := j.name("2:" + string(first.UID))
	if err != nil {
		return nil, err
	}
	obj, err := j.round(ctx, round{
		name: name2,
		produce: func() (*attestor.Attestation, string, error) {
			answer, err := responder.Respond(ctx, req, challenge)
			if err != nil {
				return nil, "", fmt.Errorf("unable to answer the signer's challenge on %s: %w", first.Name, err)
			}
			log.Info("Answered the challenge", "elapsed", j.since())
			return answer, name2, nil
		},
		filed: func() {
			log.Info("Filed the answer to the challenge", "challenged", first.Name, "csr", name2, "elapsed", j.since())
		},
	})
	if err != nil {
		return nil, err
	}
	log.Info("The signer decided", "csr", name2, "elapsed", j.since())
	return csr.Outcome(obj)
}

// filing is what every round of one join shares.
type filing struct {
	client     *csr.Client
	key        *ecdsa.PrivateKey
	pkcs10     []byte
	provider   string
	nodeName   string
	expiration *int32
	r          *Request
	// start is when the current attempt (fileAndWait) started, and
	// version its evidence version: the one requested, else the
	// attestor's newest, until the evidence says which it is.
	start   time.Time
	version string
}

// since is the time since the current attempt started, as its log lines
// give it.
func (j *filing) since() time.Duration { return time.Since(j.start).Round(100 * time.Microsecond) }

// name is the name of a CSR of the current attempt, for round ("1", or
// "2:" and the challenged CSR's UID).
func (j *filing) name(round string) (string, error) {
	return csr.Name(j.r.SignerName, j.nodeName, j.key, j.version, round)
}

// round is one CSR of a join.
type round struct {
	// name is the CSR's name as known before its evidence is: its watch
	// opens while produce works.
	name string
	// produce makes the evidence and returns the CSR's name, which the
	// evidence's version may have changed.
	produce func() (*attestor.Attestation, string, error)
	// filed is called once the CSR exists.
	filed func()
	// done says, besides an outcome (a certificate, a denial), when to
	// stop waiting; nil waits for the outcome.
	done func(*certificatesv1.CertificateSigningRequest) (bool, error)
}

// round files one CSR and waits until it has an outcome or rd.done says
// to stop.
func (j *filing) round(ctx context.Context, rd round) (*certificatesv1.CertificateSigningRequest, error) {
	ahead := j.client.WatchAhead(ctx, rd.name)
	defer ahead.Stop()
	att, name, err := rd.produce()
	if err != nil {
		return nil, err
	}
	request, err := attestor.EncodeRequest(j.pkcs10, j.provider, att.Evidence)
	if err != nil {
		return nil, err
	}
	ahead.Connected(ctx)
	obj, err := j.client.Create(ctx, csr.ObjectWithUsages(name, j.r.SignerName, j.r.Usages, request, j.expiration, att.Annotations))
	if err != nil {
		return nil, err
	}
	rd.filed()
	return j.client.WaitAhead(ctx, ahead, obj, func(o *certificatesv1.CertificateSigningRequest) (bool, error) {
		cert, err := csr.Outcome(o)
		if err != nil || cert != nil {
			return true, err
		}
		if rd.done != nil {
			return rd.done(o)
		}
		return false, nil
	})
}

// nextVersion picks the newest evidence version both the attestor and the
// signer support, from the signer's annotation on the denied CSR, and
// returns that annotation.
func (s *Source) nextVersion(ctx context.Context, client *csr.Client, name string, tried map[string]bool) (next, annotation string, ok bool) {
	obj, err := client.Get(ctx, name)
	if err != nil {
		return "", "(unknown: " + err.Error() + ")", false
	}
	annotation = obj.Annotations[attestor.AnnotationSupportedVersions]
	supported := strings.Split(annotation, ",")
	for _, v := range s.Attestor.Versions() {
		if !tried[v] && slices.Contains(supported, v) {
			return v, annotation, true
		}
	}
	return "", annotation, false
}

// RecoveryDoc is where a person finds the way back for a node that has
// neither a usable certificate nor a valid bootstrap credential.
const RecoveryDoc = "docs/troubleshooting.md#a-node-whose-certificate-and-bootstrap-token-expired"

// bootstrapRefused explains an Unauthorized answer to the bootstrap
// credential: with no usable certificate of its own, the node cannot get
// one until a person gives it a valid bootstrap token.
func (s *Source) bootstrapRefused(lapsed *x509.Certificate, err error) error {
	own := "the node has no certificate of its own yet"
	if lapsed != nil {
		own = "the node's own certificate expired at " + lapsed.NotAfter.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("the API server refused the bootstrap credential in %s (its token expired or was deleted), and %s: "+
		"put a new bootstrap token in %s and the node attests again (%s): %w", s.Config.BootstrapKubeconfig, own, s.Config.BootstrapKubeconfig, RecoveryDoc, err)
}

// NodeRESTConfig returns the client configuration that reaches the
// node's cluster as the node itself, with current (a usable client
// credential): what the serving certificate is requested with, never the
// bootstrap credential.
func (s *Source) NodeRESTConfig(current *cache.Credential) (*rest.Config, error) {
	if current == nil {
		return nil, errors.New("no client credential to authenticate as the node")
	}
	return s.nodeConfig(current)
}

// restConfig returns the client configuration for filing the CSR. A
// renewal (current set) authenticates as the node with current, to the
// cluster from KUBERNETES_EXEC_INFO when provided, else to ClusterConfig's.
// The bootstrap credential goes only to the bootstrap kubeconfig's server,
// verified with its CA: whoever can set the cluster kubelet's kubeconfig
// names must not collect the bootstrap token. A cluster that skips TLS
// verification (insecure-skip-tls-verify in either kubeconfig) is refused.
func (s *Source) restConfig(ctx context.Context, current *cache.Credential) (*rest.Config, error) {
	if current != nil {
		return s.nodeConfig(current)
	}
	return s.bootstrapConfig(ctx)
}

// nodeConfig authenticates as the node with current.
func (s *Source) nodeConfig(current *cache.Credential) (*rest.Config, error) {
	var cfg *rest.Config
	if c := s.Cluster; c != nil && c.Server != "" {
		if c.ProxyURL != "" {
			return nil, errors.New("cluster proxy-url is not supported")
		}
		cfg = &rest.Config{Host: c.Server, TLSClientConfig: rest.TLSClientConfig{
			CAData: c.CertificateAuthorityData, ServerName: c.TLSServerName, Insecure: c.InsecureSkipTLSVerify}}
		if err := kube.RequireVerified(cfg, "kubelet's kubeconfig (cluster "+c.Server+" in KUBERNETES_EXEC_INFO)"); err != nil {
			return nil, err
		}
	} else {
		var err error
		if cfg, err = ClusterConfig(s.Config); err != nil {
			return nil, err
		}
	}
	cfg.TLSClientConfig.CertData = current.CertPEM
	cfg.TLSClientConfig.KeyData = current.KeyPEM
	return cfg, nil
}

// bootstrapConfig authenticates with the bootstrap credential, to the
// bootstrap kubeconfig's server only.
func (s *Source) bootstrapConfig(ctx context.Context) (*rest.Config, error) {
	data, err := os.ReadFile(s.Config.BootstrapKubeconfig)
	if err != nil {
		return nil, fmt.Errorf("unable to read bootstrap kubeconfig: %w", err)
	}
	boot, err := clientcmd.RESTConfigFromKubeConfig(data)
	if err != nil {
		return nil, fmt.Errorf("unable to load bootstrap kubeconfig %s: %w", s.Config.BootstrapKubeconfig, err)
	}
	if err := kube.RequireVerified(boot, "bootstrap kubeconfig "+s.Config.BootstrapKubeconfig); err != nil {
		return nil, err
	}
	if s.Cluster != nil && s.Cluster.Server != "" && s.Cluster.Server != boot.Host {
		klog.FromContext(ctx).Info("Bootstrapping with the bootstrap kubeconfig's server, not the one in KUBERNETES_EXEC_INFO: "+
			"the bootstrap credential goes only to its own server",
			"kubeconfig", s.Config.BootstrapKubeconfig, "server", boot.Host, "execInfoServer", s.Cluster.Server)
	}
	cfg := &rest.Config{
		Host:            boot.Host,
		BearerToken:     boot.BearerToken,
		BearerTokenFile: boot.BearerTokenFile,
		TLSClientConfig: rest.TLSClientConfig{
			CAData: boot.CAData, CAFile: boot.CAFile, ServerName: boot.ServerName,
			CertData: boot.CertData, KeyData: boot.KeyData, CertFile: boot.CertFile, KeyFile: boot.KeyFile,
		},
	}
	if cfg.BearerToken == "" && cfg.BearerTokenFile == "" && len(cfg.CertData) == 0 && cfg.CertFile == "" {
		return nil, fmt.Errorf("bootstrap kubeconfig %s has no credential", s.Config.BootstrapKubeconfig)
	}
	return cfg, nil
}

// clusterCA returns the DER of the cluster CA evidence commits to (binding
// v2): the first certificate of the CA data the node verifies its API
// server with, the CSR's own connection.
func clusterCA(restCfg *rest.Config) ([]byte, error) {
	ca := restCfg.CAData
	if len(ca) == 0 && restCfg.CAFile != "" {
		data, err := os.ReadFile(restCfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("unable to read the cluster CA: %w", err)
		}
		ca = data
	}
	if len(ca) == 0 {
		return nil, errors.New("the connection to the API server names no CA data")
	}
	return attestor.FirstCertificate(ca)
}

// recordCluster keeps the server and CA a credential was obtained from in
// the cache directory (see ClusterConfig). A failure is only logged: the
// bootstrap kubeconfig still names the cluster.
func (s *Source) recordCluster(ctx context.Context, restCfg *rest.Config) {
	log := klog.FromContext(ctx)
	ca := restCfg.CAData
	if len(ca) == 0 && restCfg.CAFile != "" {
		data, err := os.ReadFile(restCfg.CAFile)
		if err != nil {
			log.Error(err, "Not recording the cluster", "server", restCfg.Host)
			return
		}
		ca = data
	}
	c := cache.Cluster{Server: restCfg.Host, CAData: ca, ServerName: restCfg.ServerName}
	if old, err := s.dir().LoadCluster(); err == nil && old.Server == c.Server && old.ServerName == c.ServerName && bytes.Equal(old.CAData, c.CAData) {
		return // unchanged: no write (and no fsync) on every renewal
	}
	if err := s.dir().StoreCluster(c); err != nil {
		log.Error(err, "Not recording the cluster", "server", restCfg.Host)
	}
}

// ClusterConfig returns where the node reaches its cluster as itself
// (server and CA, no credential): the bootstrap kubeconfig's cluster while
// that file exists, else the one recorded when the current credential was
// obtained, so that the agent keeps working after operators delete the
// bootstrap kubeconfig. A bootstrap kubeconfig with insecure-skip-tls-verify
// is refused: the agent's renewal and trust bundle clients connect here.
func ClusterConfig(cfg *config.NodeConfig) (*rest.Config, error) {
	data, err := os.ReadFile(cfg.BootstrapKubeconfig)
	if err == nil {
		boot, err := clientcmd.RESTConfigFromKubeConfig(data)
		if err != nil {
			return nil, fmt.Errorf("unable to load bootstrap kubeconfig %s: %w", cfg.BootstrapKubeconfig, err)
		}
		if err := kube.RequireVerified(boot, "bootstrap kubeconfig "+cfg.BootstrapKubeconfig); err != nil {
			return nil, err
		}
		return &rest.Config{Host: boot.Host, TLSClientConfig: rest.TLSClientConfig{
			CAData: boot.CAData, CAFile: boot.CAFile, ServerName: boot.ServerName}}, nil
	}
	c, cerr := cache.Dir{Path: cfg.CacheDir}.LoadCluster()
	if cerr != nil {
		return nil, fmt.Errorf("no cluster to talk to: the bootstrap kubeconfig is unreadable (%w) and none was recorded: %w", err, cerr)
	}
	return &rest.Config{Host: c.Server, TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData, ServerName: c.ServerName}}, nil
}

// ExecInfo parses KUBERNETES_EXEC_INFO. An empty value yields nil.
func ExecInfo(env string) (*clientauthv1.ExecCredential, error) {
	if strings.TrimSpace(env) == "" {
		return nil, nil
	}
	var ec clientauthv1.ExecCredential
	if err := json.Unmarshal([]byte(env), &ec); err != nil {
		return nil, fmt.Errorf("unable to parse KUBERNETES_EXEC_INFO: %w", err)
	}
	switch ec.APIVersion {
	case "client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1":
	default:
		return nil, fmt.Errorf("KUBERNETES_EXEC_INFO has apiVersion %q; this plugin speaks client.authentication.k8s.io/v1 (and v1beta1)", ec.APIVersion)
	}
	return &ec, nil
}

// Marshal returns the ExecCredential JSON for cred, in the apiVersion kubelet
// asked with ("" means v1).
func Marshal(apiVersion string, cred *cache.Credential, expires time.Time) ([]byte, error) {
	return MarshalPEM(apiVersion, cred.CertPEM, cred.KeyPEM, expires)
}

// MarshalPEM returns the ExecCredential JSON (and a newline) the plugin
// prints for a PEM certificate chain and key, in the apiVersion kubelet
// asked with ("" means v1). client-go reuses the credential until expires.
func MarshalPEM(apiVersion string, certPEM, keyPEM []byte, expires time.Time) ([]byte, error) {
	if apiVersion == "" {
		apiVersion = "client.authentication.k8s.io/v1"
	}
	out, err := json.Marshal(clientauthv1.ExecCredential{
		TypeMeta: metav1.TypeMeta{APIVersion: apiVersion, Kind: "ExecCredential"},
		Status: &clientauthv1.ExecCredentialStatus{
			ExpirationTimestamp:   &metav1.Time{Time: expires},
			ClientCertificateData: string(certPEM),
			ClientKeyData:         string(keyPEM),
		},
	})
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}
