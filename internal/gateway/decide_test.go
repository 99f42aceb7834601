package gateway

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/netpolicy"
)

// fakeDecider decides with rule (which may block, as an ask does) and
// records every action and connection it was asked about.
type fakeDecider struct {
	rule func(ctx context.Context, a actions.Action) actions.Decision

	mu    sync.Mutex
	seen  []actions.Action
	conns []ConnInfo
	asked chan actions.Action // every action, as it arrives (buffered)
}

var _ ConnDecider = (*fakeDecider)(nil)

func newFakeDecider(rule func(ctx context.Context, a actions.Action) actions.Decision) *fakeDecider {
	return &fakeDecider{rule: rule, asked: make(chan actions.Action, 100)}
}

func (f *fakeDecider) Decide(ctx context.Context, a actions.Action) actions.Decision {
	f.mu.Lock()
	f.seen = append(f.seen, a)
	f.mu.Unlock()
	f.asked <- a
	return f.rule(ctx, a)
}

func (f *fakeDecider) DecideConn(ctx context.Context, a actions.Action, c ConnInfo) (actions.Decision, string) {
	f.mu.Lock()
	f.conns = append(f.conns, c)
	f.mu.Unlock()
	return f.Decide(ctx, a), "/usr/bin/fake"
}

func (f *fakeDecider) actions() []actions.Action {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]actions.Action(nil), f.seen...)
}

// newDecideFixture is newFixture with a Decider (attached with o).
func newDecideFixture(t *testing.T, p api.NetworkPolicy, d actions.Decider, o LinkOptions) *fixture {
	f := &fixture{dialer: &gatewaytest.GuardDialer{T: t}}
	f.dns = gatewaytest.StartDNS(t, map[string][]string{
		"allowed.test": {"127.0.0.2"},
		"alias.test":   {"127.0.0.2"},
		"other.test":   {"127.0.0.3"},
	})
	for _, tlsOn := range []bool{false, true} {
		port, stop, err := gatewaytest.ServeHTTPPair(tlsOn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		if tlsOn {
			f.tlsPort = port
		} else {
			f.port = port
		}
	}
	f.tlsConf = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // the test servers' own certificate
	g, err := New(Options{
		DNSUpstream: f.dns.Addr,
		Policy: netpolicy.Options{
			AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
			Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")},
		},
		Dialer:  f.dialer,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Decider: d,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	if err := g.AttachWith("sb1", nic, p, o); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	f.g = g
	f.sb = gatewaytest.NewSandboxStack(t, fds[1])
	return f
}

var decideOn = LinkOptions{Decide: true}

// A DNS query the network policy allows but the Decider denies gets
// NXDOMAIN, is never forwarded, and shows as a deny with the rule's reason.
func TestDecideDNSDeny(t *testing.T) {
	d := newFakeDecider(func(_ context.Context, a actions.Action) actions.Decision {
		if a.Kind == actions.DNS && a.Name == "other.test" {
			return actions.Decision{Verdict: actions.Deny, Reason: "no other today", Rule: "r1"}
		}
		return actions.Decision{Verdict: actions.Allow}
	})
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "other.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, decideOn)
	rc, _, err := f.sb.Query(t, gatewayAddr, "other.test", dnsmessage.TypeA)
	if err != nil || rc != dnsmessage.RCodeNameError {
		t.Fatalf("denied name: rcode %v err %v", rc, err)
	}
	if f.dns.WasAsked("other.test") {
		t.Fatal("a name the policy denied reached the upstream resolver")
	}
	if rc, ips, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Fatalf("allowed name: %v %v %v", rc, ips, err)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "dns" && ev.Name == "other.test" && ev.Verdict == api.VerdictDeny &&
			strings.Contains(ev.Reason, "no other today") && strings.Contains(ev.Reason, "r1")
	}) {
		t.Fatalf("no deny event with the rule's reason: %+v", f.events(t))
	}
	var got []string
	for _, a := range d.actions() {
		if a.Sandbox != "sb1" || a.Time.IsZero() {
			t.Errorf("action without sandbox or time: %+v", a)
		}
		got = append(got, a.Kind+":"+a.Name)
	}
	if strings.Join(got, ",") != "dns:other.test,dns:allowed.test" {
		t.Fatalf("actions asked: %v", got)
	}
	// A name the network policy refuses is never asked about.
	if rc, _, _ := f.sb.Query(t, gatewayAddr, "alias.test", dnsmessage.TypeA); rc != dnsmessage.RCodeNameError {
		t.Fatalf("alias.test: %v", rc)
	}
	if n := len(d.actions()); n != 2 {
		t.Fatalf("the Decider was asked about a name the network policy refuses: %+v", d.actions())
	}
}

// A connection the network policy allows and the Decider denies is reset
// before the host dials anything, with a deny event naming the reason and
// the executable the Decider named.
func TestDecideConnectDeny(t *testing.T) {
	d := newFakeDecider(func(_ context.Context, a actions.Action) actions.Decision {
		if a.Kind == actions.Connect && a.SNI == "" {
			return actions.Decision{Verdict: actions.Deny, Reason: "plain http is not for agents"}
		}
		return actions.Decision{Verdict: actions.Allow, Rule: "tls-ok"}
	})
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, decideOn)
	if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err == nil {
		t.Fatalf("a denied connection went through: %q", body)
	}
	if f.dialer.Dialed(fmt.Sprintf("127.0.0.2:%d", f.port)) {
		t.Fatal("the host dialled a connection the policy denied")
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "http" && ev.Verdict == api.VerdictDeny && ev.Name == "allowed.test" &&
			strings.Contains(ev.Reason, "plain http is not for agents") && ev.Exe == "/usr/bin/fake"
	}) {
		t.Fatalf("no deny event with reason and exe: %+v", f.events(t))
	}
	// TLS to the same name is allowed, SNI in the action.
	c, err := f.sb.Dial(ip2, f.tlsPort)
	if err != nil {
		t.Fatal(err)
	}
	conf := f.tlsConf.Clone()
	conf.ServerName = "allowed.test"
	tc := tls.Client(c, conf)
	_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatalf("tls allowed by the Decider: %v", err)
	}
	tc.Close()
	var conn actions.Action
	for _, a := range d.actions() {
		if a.Kind == actions.Connect && a.SNI == "allowed.test" {
			conn = a
		}
	}
	if conn.Name != "allowed.test" || conn.IP != "127.0.0.2" || conn.Port != int(f.tlsPort) {
		t.Fatalf("connect action: %+v", conn)
	}
	d.mu.Lock()
	ci := d.conns
	d.mu.Unlock()
	if len(ci) != 2 || ci[0].Src.Addr() != sandboxAddr || ci[0].Src.Port() == 0 ||
		ci[0].Dst != netip.AddrPortFrom(ip2, f.port) || ci[1].Dst != netip.AddrPortFrom(ip2, f.tlsPort) {
		t.Fatalf("connection infos: %+v", ci)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Protocol == "tls" && ev.Verdict == api.VerdictAllow && strings.Contains(ev.Reason, "rule tls-ok")
	}) {
		t.Fatalf("no allow event naming the rule: %+v", f.events(t))
	}
}

// An ask holds the connection (and a DNS query) until the Decider answers;
// the sandbox's other connections and queries go on meanwhile.
func TestDecideAskHolds(t *testing.T) {
	release := map[string]chan actions.Decision{
		"alias.test": make(chan actions.Decision, 1), // its connection
		"ask.dns":    make(chan actions.Decision, 1),
	}
	d := newFakeDecider(func(ctx context.Context, a actions.Action) actions.Decision {
		key := a.Name
		if a.Kind == actions.DNS && a.Name == "other.test" {
			key = "ask.dns"
		} else if a.Kind != actions.Connect {
			key = ""
		}
		if ch := release[key]; ch != nil {
			select {
			case v := <-ch:
				return v
			case <-ctx.Done():
				return actions.Decision{Verdict: actions.Ask}
			}
		}
		return actions.Decision{Verdict: actions.Allow}
	})
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test", "alias.test", "other.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, decideOn)
	for _, n := range []string{"allowed.test", "alias.test"} {
		if _, _, err := f.sb.Query(t, gatewayAddr, n, dnsmessage.TypeA); err != nil {
			t.Fatal(err)
		}
	}
	type result struct {
		body string
		err  error
	}
	held := make(chan result, 1)
	go func() {
		c, err := f.sb.Dial(ip2, f.port)
		if err != nil {
			held <- result{"", err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		fmt.Fprintf(c, "GET /hello HTTP/1.1\r\nHost: alias.test\r\nConnection: close\r\n\r\n")
		b, err := io.ReadAll(c)
		held <- result{string(b), err}
	}()
	waitAsked(t, d, func(a actions.Action) bool { return a.Kind == actions.Connect && a.Name == "alias.test" })
	// While it waits: another connection, and a query, go through.
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err != nil || !strings.Contains(body, "host=allowed.test") {
		t.Fatalf("another connection while one waits: %q %v", body, err)
	}
	if rc, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess {
		t.Fatalf("a query while a connection waits: %v %v", rc, err)
	}
	select {
	case r := <-held:
		t.Fatalf("the held connection did not wait: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	if n := countDials(f.dialer, fmt.Sprintf("tcp 127.0.0.2:%d", f.port)); n != 1 {
		t.Fatalf("%d dials before the decision: the host dialled the held connection (or not the other)", n)
	}
	release["alias.test"] <- actions.Decision{Verdict: actions.Allow, Approval: "ap-1"}
	r := <-held
	if r.err != nil || !strings.Contains(r.body, "host=alias.test") {
		t.Fatalf("the approved connection: %q %v", r.body, r.err)
	}
	if !f.hasEvent(t, func(ev api.NetworkEvent) bool {
		return ev.Name == "alias.test" && ev.Verdict == api.VerdictAllow && strings.Contains(ev.Reason, "approval ap-1")
	}) {
		t.Fatalf("no allow event naming the approval: %+v", f.events(t))
	}

	// A DNS query waits for its answer too; denied, it is NXDOMAIN.
	dnsDone := make(chan dnsmessage.RCode, 1)
	go func() {
		rc, _, _ := f.sb.Query(t, gatewayAddr, "other.test", dnsmessage.TypeA)
		dnsDone <- rc
	}()
	waitAsked(t, d, func(a actions.Action) bool { return a.Kind == actions.DNS && a.Name == "other.test" })
	release["ask.dns"] <- actions.Decision{Verdict: actions.Deny, Reason: "denied by a person"}
	if rc := <-dnsDone; rc != dnsmessage.RCodeNameError {
		t.Fatalf("denied query: %v", rc)
	}
	if f.dns.WasAsked("other.test") {
		t.Fatal("a denied query reached the upstream")
	}
}

// Detaching the link ends a wait at once: the held connection is not
// relayed, and the Decider's context ends.
func TestDecideDetachEndsWait(t *testing.T) {
	ended := make(chan struct{})
	d := newFakeDecider(func(ctx context.Context, a actions.Action) actions.Decision {
		if a.Kind != actions.Connect {
			return actions.Decision{Verdict: actions.Allow}
		}
		<-ctx.Done()
		close(ended)
		return actions.Decision{Verdict: actions.Ask}
	})
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, decideOn)
	if _, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = f.sb.Get(ip2, f.port, "allowed.test") }()
	waitAsked(t, d, func(a actions.Action) bool { return a.Kind == actions.Connect })
	f.g.Detach("sb1")
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("detaching did not end the wait")
	}
	time.Sleep(100 * time.Millisecond)
	if f.dialer.Dialed(fmt.Sprintf("127.0.0.2:%d", f.port)) {
		t.Fatal("a connection whose decision never came was dialled")
	}
}

// A link attached without Decide never asks (the fast path for sandboxes
// no rule applies to); SetDecide turns it on.
func TestDecideFastPath(t *testing.T) {
	d := newFakeDecider(func(context.Context, actions.Action) actions.Decision {
		return actions.Decision{Verdict: actions.Deny, Reason: "everything"}
	})
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, LinkOptions{})
	if rc, _, err := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeSuccess {
		t.Fatalf("query: %v %v", rc, err)
	}
	if body, err := f.sb.Get(ip2, f.port, "allowed.test"); err != nil || !strings.Contains(body, "127.0.0.2") {
		t.Fatalf("get: %q %v", body, err)
	}
	if n := len(d.actions()); n != 0 {
		t.Fatalf("a link without rules asked the Decider %d times", n)
	}
	if err := f.g.SetDecide("sb1", true); err != nil {
		t.Fatal(err)
	}
	if rc, _, _ := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); rc != dnsmessage.RCodeNameError {
		t.Fatalf("after SetDecide, a denied query: %v", rc)
	}
	if err := f.g.SetDecide("sb-none", true); err == nil {
		t.Fatal("SetDecide of an unknown sandbox succeeded")
	}
}

// A Decider that returns an unresolved ask (or nothing) denies.
func TestDecideFailsClosed(t *testing.T) {
	d := newFakeDecider(func(context.Context, actions.Action) actions.Decision { return actions.Decision{} })
	f := newDecideFixture(t, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, d, decideOn)
	if rc, _, _ := f.sb.Query(t, gatewayAddr, "allowed.test", dnsmessage.TypeA); rc != dnsmessage.RCodeNameError {
		t.Fatalf("a query with no verdict: %v", rc)
	}
}

func waitAsked(t *testing.T, d *fakeDecider, match func(actions.Action) bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case a := <-d.asked:
			if match(a) {
				return
			}
		case <-deadline:
			t.Fatalf("the Decider was not asked; it saw %+v", d.actions())
		}
	}
}

func countDials(d *gatewaytest.GuardDialer, substr string) int {
	n := 0
	for _, s := range d.Dials() {
		if strings.Contains(s, substr) {
			n++
		}
	}
	return n
}
