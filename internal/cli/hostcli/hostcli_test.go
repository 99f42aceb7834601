package hostcli

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/cli"
)

func TestServerNetworkFlags(t *testing.T) {
	f := serverNetFlags{allowPrivate: []string{"10.1.2.3/8", "192.168.1.5"}, dnsUpstream: "9.9.9.9:53",
		defaultAllowOut: []string{"pypi.org"}, defaultInternet: true, defaultPrivate: []string{"10.1.0.0/16"}}
	o, err := f.options()
	if err != nil {
		t.Fatal(err)
	}
	wantPrefixes := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.1.5/32")}
	if !reflect.DeepEqual(o.AllowPrivate, wantPrefixes) || o.DNSUpstream != "9.9.9.9:53" ||
		!o.Default.Internet || !reflect.DeepEqual(o.Default.AllowOut, []string{"pypi.org"}) || !reflect.DeepEqual(o.Default.AllowPrivate, []string{"10.1.0.0/16"}) {
		t.Fatalf("options %+v", o)
	}
	f.allowPrivate = []string{"not-a-cidr"}
	if _, err := f.options(); err == nil {
		t.Fatal("a bad CIDR was accepted")
	}
	cmd := newServerCmd(cli.Env{})
	for _, name := range []string{"egress-allow-private", "dns-upstream", "default-allow-out", "default-allow-private", "default-internet"} {
		if cmd.Flags().Lookup(name) == nil {
			t.Errorf("space server has no --%s", name)
		}
	}
}

// `space node` is `space server` with the cluster flags, and refuses to
// run as a single box.
func TestNodeCommandNeedsTheClusterStore(t *testing.T) {
	var errOut strings.Builder
	cmd := newNodeCmd(cli.Env{Ctx: t.Context(), Err: &errOut})
	if cmd.Name() != "node" {
		t.Fatalf("command name %q", cmd.Name())
	}
	for _, name := range []string{"cluster-store", "node-id", "advertise", "heartbeat", "listen", "data"} {
		if cmd.Flags().Lookup(name) == nil {
			t.Errorf("space node has no --%s", name)
		}
	}
	cmd.SetArgs([]string{"--data", t.TempDir()})
	cmd.SetErr(&errOut)
	cmd.SetOut(&errOut)
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "needs --cluster-store") {
		t.Fatalf("space node without --cluster-store: %v", err)
	}
}
