package app

import (
	"errors"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/validation"
)

func TestShardOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want []string // flags the error names; none: valid
	}{
		{name: "default: one leader", args: nil},
		{name: "sharding", args: []string{"--sharding"}},
		{name: "lease duration ignored without sharding", args: []string{"--shard-lease-duration=1s"}},
		{name: "lease too short", args: []string{"--sharding", "--shard-lease-duration=1s"}, want: []string{"--shard-lease-duration"}},
		{name: "ring name not a label value", args: []string{"--sharding", "--leader-election-id=" + strings.Repeat("a", 64)}, want: []string{"--leader-election-id"}},
		{name: "watch filter not a label value", args: []string{"--watch-filter=two words"}, want: []string{"--watch-filter"}},
		{name: "everything at once", args: []string{"--sharding", "--shard-lease-duration=1h", "--watch-filter=-x"}, want: []string{"--shard-lease-duration", "--watch-filter"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			o.AddFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := errors.Join(o.shardOptions.validate(o.LeaderElectionID)...)
			if len(tc.want) == 0 && err != nil {
				t.Fatalf("valid options refused: %v", err)
			}
			if len(tc.want) > 0 && err == nil {
				t.Fatalf("accepted, want an error naming %v", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not name %s: %v", w, err)
				}
			}
		})
	}
}

// TestShardIdentity: a replica's default name is a valid Lease name, and
// two replicas on one host get two names.
func TestShardIdentity(t *testing.T) {
	a, err := newShardIdentity()
	if err != nil {
		t.Fatal(err)
	}
	b, err := newShardIdentity()
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{a, b} {
		if msgs := validation.IsDNS1123Subdomain(id); len(msgs) > 0 {
			t.Errorf("identity %q: %v", id, msgs)
		}
	}
	if a == b {
		t.Errorf("two replicas on one host are both %q", a)
	}
}
