package app

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/shard"
)

// shardOptions say how replicas share the Clusters (docs/deploy.md).
type shardOptions struct {
	// Sharding shares the opted-in Clusters among the replicas of the
	// ring named by --leader-election-id.
	Sharding bool
	// ShardLeaseDuration is how long a replica's membership Lease lasts
	// without renewal.
	ShardLeaseDuration time.Duration
	// ShardIdentity names this replica; empty means the host name and a
	// random suffix (tests set it).
	ShardIdentity string
	// WatchFilter serves only the Clusters labelled
	// cluster.x-k8s.io/watch-filter=<value>.
	WatchFilter string
}

func (o *shardOptions) addFlags(fs *pflag.FlagSet) {
	fs.BoolVar(&o.Sharding, "sharding", o.Sharding,
		"Share the opted-in Clusters among every replica: "+
			"each Cluster is served by one replica at a time, "+
			"and a replica's Clusters move to the others when it goes (membership and claim Leases in the controller's namespace, "+
			"ring named by --leader-election-id). False: the leader serves every Cluster.")
	fs.DurationVar(&o.ShardLeaseDuration, "shard-lease-duration", o.ShardLeaseDuration,
		"With --sharding, how long a replica's membership Lease lasts without renewal (renewed every third of it): "+
			"the longest a dead replica's Clusters wait to move.")
	fs.StringVar(&o.WatchFilter, "watch-filter", o.WatchFilter,
		"Serve only the Clusters labelled "+capi.LabelWatchFilter+"=<value> (Cluster API's --watch-filter), for operators who shard by hand. Empty: every Cluster.")
}

func (o *shardOptions) validate(ringName string) []error {
	var errs []error
	for _, msg := range validation.IsValidLabelValue(o.WatchFilter) {
		errs = append(errs, fmt.Errorf("--watch-filter %q: %s", o.WatchFilter, msg))
	}
	if !o.Sharding {
		return errs
	}
	if d := o.ShardLeaseDuration; d < 3*time.Second || d > 10*time.Minute {
		errs = append(errs, fmt.Errorf("--shard-lease-duration %s must be between 3s and 10m", d))
	}
	for _, msg := range validation.IsValidLabelValue(ringName) {
		errs = append(errs, fmt.Errorf("--leader-election-id %q names the shard ring with --sharding: %s", ringName, msg))
	}
	if o.ShardIdentity != "" {
		for _, msg := range validation.IsDNS1123Subdomain(o.ShardIdentity) {
			errs = append(errs, fmt.Errorf("shard identity %q: %s", o.ShardIdentity, msg))
		}
	}
	return errs
}

// configure sets r's watch filter and, with --sharding, its ring, whose
// Leases c (not cached) reads and writes in namespace.
// It returns what unregisters the shard metrics.
func (o *shardOptions) configure(r *capi.ClusterReconciler, c client.Client, namespace, ringName string, reg prometheus.Registerer) (func(), error) {
	r.WatchFilter = o.WatchFilter
	if !o.Sharding {
		return func() {}, nil
	}
	id := o.ShardIdentity
	if id == "" {
		var err error
		if id, err = newShardIdentity(); err != nil {
			return nil, err
		}
	}
	ring := &shard.Ring{Client: c, Namespace: namespace, Name: ringName, Identity: id, LeaseDuration: o.ShardLeaseDuration}
	if err := ring.Validate(); err != nil {
		return nil, fmt.Errorf("--sharding: %w", err)
	}
	unregister, err := registerShardMetrics(reg, ring, r)
	if err != nil {
		return nil, err
	}
	r.Shards = ring
	return unregister, nil
}

// newShardIdentity is the host name (the pod's name) made a DNS label, and
// a random suffix: a restarted container is a new member, and two
// processes on one host are two.
func newShardIdentity() (string, error) {
	host, _ := os.Hostname()
	host = strings.Map(func(c rune) rune {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-':
			return c
		case c >= 'A' && c <= 'Z':
			return c + 'a' - 'A'
		}
		return '-'
	}, host)
	host = strings.Trim(host, "-")
	if len(host) > 50 {
		host = strings.TrimRight(host[:50], "-")
	}
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("unable to name this replica: %w", err)
	}
	if host == "" {
		host = "replica"
	}
	return host + "-" + hex.EncodeToString(b), nil
}

// registerShardMetrics exposes the replica's share of the Clusters: every
// series carries the replica's identity, so that the replicas of one
// process (tests) and of one scrape job stay apart.
func registerShardMetrics(reg prometheus.Registerer, ring *shard.Ring, r *capi.ClusterReconciler) (func(), error) {
	labels := prometheus.Labels{"replica": ring.Identity}
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: "kubelet_authenticator", Subsystem: "signer", Name: name, Help: help, ConstLabels: labels}
	}
	handovers := prometheus.NewCounter(prometheus.CounterOpts(opts("shard_handovers_total",
		"Clusters this replica took over from a replica that released them or whose membership Lease expired.")))
	ring.Metrics = counter{handovers}
	cs := []prometheus.Collector{
		handovers,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts(opts("shard_members",
			"Live replicas of the shard ring, as this replica sees them.")), func() float64 { return float64(len(ring.Members())) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts(opts("shard_clusters_served",
			"Opted-in Clusters whose CSR controller runs in this replica.")), func() float64 { return float64(len(r.Statuses())) }),
	}
	unregister := func() {
		for _, c := range cs {
			reg.Unregister(c)
		}
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			unregister()
			return nil, fmt.Errorf("unable to register shard metrics: %w", err)
		}
	}
	return unregister, nil
}

// counter implements shard.Metrics.
type counter struct{ handovers prometheus.Counter }

// Handover implements shard.Metrics.
func (c counter) Handover() { c.handovers.Inc() }
