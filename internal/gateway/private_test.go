package gateway

import (
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/spacehq/space/api"
)

// The operator's --egress-allow-private (here 127.0.0.0/8, the fixture's
// fake internet) is only the outer limit: an allowed NAME leads into it
// only through the sandbox's own allow_private. Without it, any sandbox
// allowing a name whose DNS an attacker controls (allowed.test and
// *.zone.test resolve to 127.0.0.2 here) would reach every opened range.

// dnsEvent is the last allow event of a DNS query for name.
func (f *fixture) dnsEvent(t *testing.T, name string) api.NetworkEvent {
	t.Helper()
	var got api.NetworkEvent
	f.hasEvent(t, func(ev api.NetworkEvent) bool {
		if ev.Protocol == "dns" && ev.Name == name && ev.Verdict == api.VerdictAllow {
			got = ev
			return true
		}
		return false
	})
	if got.Name == "" {
		t.Fatalf("no dns event for %s: %+v", name, f.events(t))
	}
	return got
}

// TestNameIntoOpenedRangeNeedsAllowPrivate: no allow_private, so the
// loopback answers of allowed names are removed and nothing reaches
// 127.0.0.2, though the operator opened 127.0.0.0/8 and the names are
// allowed.
func TestNameIntoOpenedRangeNeedsAllowPrivate(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"*.zone.test", "allowed.test", "rebind-mixed.test"}})
	for _, name := range []string{"a.zone.test", "allowed.test", "rebind-mixed.test"} {
		rc, ips, err := f.sb.Query(t, gatewayAddr, name, dnsmessage.TypeA)
		if err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 0 {
			t.Fatalf("%s: rcode %v ips %v err %v; want an empty answer", name, rc, ips, err)
		}
		ev := f.dnsEvent(t, name)
		if len(ev.Answers) != 0 || !strings.Contains(ev.Reason, "127.0.0.2 (loopback address not in the sandbox's allow_private)") {
			t.Errorf("%s: event %+v", name, ev)
		}
	}
	for _, host := range []string{"a.zone.test", "allowed.test"} {
		if body, err := f.sb.Get(ip2, f.port, host); err == nil {
			t.Fatalf("GET %s on 127.0.0.2 went through: %q", host, body)
		}
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "tcp" && ev.Verdict == api.VerdictDeny && ev.IP == "127.0.0.2" &&
			strings.Contains(ev.Reason, "not resolved for an allowed name by this sandbox; loopback address (127.0.0.0/8)")
	}) {
		t.Fatalf("no deny event for the connection: %+v", f.events(t))
	}
	if f.dialer.Dialed("127.0.0.2") {
		t.Fatal("the gateway dialed 127.0.0.2")
	}
}

// TestAllowPrivateOpensNames: allow_private covering the address lets the
// same names through, and only into what it lists.
func TestAllowPrivateOpensNames(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"*.zone.test", "allowed.test", "other.test"}, AllowPrivate: []string{"127.0.0.2"}})
	for _, name := range []string{"a.zone.test", "allowed.test"} {
		if rc, ips, err := f.sb.Query(t, gatewayAddr, name, dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 || ips[0] != ip2 {
			t.Fatalf("%s: rcode %v ips %v err %v", name, rc, ips, err)
		}
		if body, err := f.sb.Get(ip2, f.port, name); err != nil || !strings.Contains(body, "127.0.0.2:") {
			t.Fatalf("GET %s: %q %v", name, body, err)
		}
	}
	// other.test is 127.0.0.3: outside the sandbox's allow_private.
	if _, ips, err := f.sb.Query(t, gatewayAddr, "other.test", dnsmessage.TypeA); err != nil || len(ips) != 0 {
		t.Fatalf("other.test: ips %v err %v", ips, err)
	}
	if ev := f.dnsEvent(t, "other.test"); !strings.Contains(ev.Reason, "removed 127.0.0.3 (loopback address not in the sandbox's allow_private)") {
		t.Errorf("other.test: event %+v", ev)
	}
	if _, err := f.sb.Get(ip3, f.port, "other.test"); err == nil {
		t.Fatal("GET other.test on 127.0.0.3 went through")
	}
	if f.dialer.Dialed("127.0.0.3") {
		t.Fatal("the gateway dialed 127.0.0.3")
	}
}

// TestAllowPrivateOutsideTheOperatorsRanges: a policy cannot open more
// than the operator did; the host's own address stays protected.
func TestAllowPrivateOutsideTheOperatorsRanges(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"rebind-lan.test", "rebind-local.test", "allowed.test"}, AllowPrivate: []string{"10.0.0.0/8", "127.0.0.1"}})
	for name, why := range map[string]string{
		"rebind-lan.test":   "removed 10.1.2.3 (private)",                                              // the operator opened no 10/8
		"rebind-local.test": "removed 127.0.0.1 (protected address)",                                   // the host itself
		"allowed.test":      "removed 127.0.0.2 (loopback address not in the sandbox's allow_private)", // opened, not listed
	} {
		if _, ips, err := f.sb.Query(t, gatewayAddr, name, dnsmessage.TypeA); err != nil || len(ips) != 0 {
			t.Fatalf("%s: ips %v err %v", name, ips, err)
		}
		if ev := f.dnsEvent(t, name); !strings.Contains(ev.Reason, why) {
			t.Errorf("%s: event %+v, want %q", name, ev, why)
		}
	}
	if _, err := f.sb.Get(netip.MustParseAddr("10.1.2.3"), 80, "rebind-lan.test"); err == nil {
		t.Fatal("a connection to 10.1.2.3 went through")
	}
	if f.dialer.Dialed("10.1.2.3") || f.dialer.Dialed("127.0.0.2") {
		t.Fatalf("dialed: %v", f.dialer.Dials())
	}
}

// TestAllowPrivateDroppedByNewPolicy: a binding made under allow_private
// does not survive a policy without it — Check refuses the name's route
// at connect time, not only the DNS filter.
func TestAllowPrivateDroppedByNewPolicy(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	if _, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || len(ips) != 1 {
		t.Fatalf("allowed.test: %v %v", ips, err)
	}
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err != nil || !strings.Contains(body, "127.0.0.2:") {
		t.Fatalf("GET allowed.test: %q %v", body, err)
	}
	if err := f.g.SetPolicy("sb1", api.NetworkPolicy{AllowOut: []string{"allowed.test"}}); err != nil {
		t.Fatal(err)
	}
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err == nil {
		t.Fatalf("GET allowed.test after allow_private was dropped went through: %q", body)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "tcp" && ev.Verdict == api.VerdictDeny && ev.IP == "127.0.0.2" && strings.Contains(ev.Reason, "loopback address (127.0.0.0/8)")
	}) {
		t.Fatalf("no deny event: %+v", f.events(t))
	}
}

// TestCIDREntryKeepsAnswers: an allow_out IP/CIDR inside the operator's
// range opens its address without allow_private, so a name resolving
// there keeps its answer (Check then allows it by address).
func TestCIDREntryKeepsAnswers(t *testing.T) {
	f := newFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "127.0.0.2/32"}})
	if _, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || len(ips) != 1 || ips[0] != ip2 {
		t.Fatalf("allowed.test: %v %v", ips, err)
	}
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err != nil || !strings.Contains(body, "127.0.0.2:") {
		t.Fatalf("GET allowed.test: %q %v", body, err)
	}
}
