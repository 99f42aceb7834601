package gwctl

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// gatewayProc is an in-process stand-in for the gateway process: a
// gateway whose Decider is a StreamDecider, serving the control protocol
// on sock until stop.
type gatewayProc struct {
	g    *gateway.Gateway
	sd   *StreamDecider
	stop func()
}

func startGatewayProc(t *testing.T, sock string, wait time.Duration) *gatewayProc {
	t.Helper()
	sd := &StreamDecider{Wait: wait}
	g, err := gateway.New(gateway.Options{Dialer: &gatewaytest.GuardDialer{T: t}, Logger: quiet, Decider: sd})
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Remove(sock)
	uln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = Serve(ctx, uln, g, quiet)
	}()
	p := &gatewayProc{g: g, sd: sd}
	var once sync.Once
	p.stop = func() {
		once.Do(func() {
			cancel()
			<-done
			g.Close()
		})
	}
	t.Cleanup(p.stop)
	return p
}

// waitStream waits until sd has a stream.
func waitStream(t *testing.T, sd *StreamDecider) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		sd.mu.Lock()
		ok := sd.cur != nil
		sd.mu.Unlock()
		if ok {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("no decisions stream opened")
}

// Questions are multiplexed: one waiting for an answer (an approval) holds
// up no other, answers find their questions by id, the connection's
// addresses and the executable travel, and a question the gateway
// withdraws ends the server's wait.
func TestDecisionsMultiplexed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ctl.sock")
	p := startGatewayProc(t, sock, time.Second)
	cl := &Client{Path: sock}
	release := make(chan struct{})
	withdrawn := make(chan struct{})
	var mu sync.Mutex
	var conns []gateway.ConnInfo
	decide := func(ctx context.Context, a actions.Action, c *gateway.ConnInfo) (actions.Decision, string) {
		if c != nil {
			mu.Lock()
			conns = append(conns, *c)
			mu.Unlock()
		}
		switch a.Name {
		case "slow.test":
			select {
			case <-release:
			case <-ctx.Done():
			}
		case "never.test":
			<-ctx.Done()
			close(withdrawn)
			return actions.Decision{Verdict: actions.Ask}, ""
		}
		if strings.HasPrefix(a.Name, "deny") {
			return actions.Decision{Verdict: actions.Deny, Reason: "no " + a.Name}, ""
		}
		return actions.Decision{Verdict: actions.Allow, Reason: "yes " + a.Name}, "/usr/bin/" + a.Name
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go cl.RunDecisions(ctx, decide, quiet)
	waitStream(t, p.sd)

	slow := make(chan actions.Decision, 1)
	go func() {
		slow <- p.sd.Decide(context.Background(), actions.Action{Kind: actions.DNS, Name: "slow.test"})
	}()
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := "a" + string(rune('a'+i%26)) + ".test"
			if i%2 == 1 {
				name = "deny" + name
			}
			ci := gateway.ConnInfo{Src: netip.MustParseAddrPort("198.18.0.2:40000"), Dst: netip.MustParseAddrPort("198.19.0.2:443")}
			d, exe := p.sd.DecideConn(context.Background(), actions.Action{Kind: actions.Connect, Name: name}, ci)
			if i%2 == 1 {
				if d.Verdict != actions.Deny || d.Reason != "no "+name || exe != "" {
					t.Errorf("%s: %+v %q", name, d, exe)
				}
			} else if d.Verdict != actions.Allow || d.Reason != "yes "+name || exe != "/usr/bin/"+name {
				t.Errorf("%s: %+v %q", name, d, exe)
			}
		}()
	}
	wg.Wait()
	select {
	case d := <-slow:
		t.Fatalf("the waiting question was answered early: %+v", d)
	default:
	}
	close(release)
	if d := <-slow; d.Verdict != actions.Allow || d.Reason != "yes slow.test" {
		t.Fatalf("slow: %+v", d)
	}
	mu.Lock()
	if len(conns) != 50 || conns[0].Src.Port() != 40000 || conns[0].Dst.Port() != 443 {
		t.Errorf("connection infos: %d %+v", len(conns), conns[:min(1, len(conns))])
	}
	mu.Unlock()

	// Withdrawn by the gateway (the link went): the server's wait ends.
	qctx, qcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer qcancel()
	if d := p.sd.Decide(qctx, actions.Action{Kind: actions.DNS, Name: "never.test"}); d.Verdict != actions.Deny {
		t.Fatalf("a withdrawn question: %+v", d)
	}
	select {
	case <-withdrawn:
	case <-time.After(5 * time.Second):
		t.Fatal("the server kept waiting on a withdrawn question")
	}
}

// No stream (the server restarting): a question waits the bound, then is
// denied; one that arrives within the bound is answered; a stream that
// ends before its answer denies.
func TestDecisionsFailClosed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ctl.sock")
	p := startGatewayProc(t, sock, 300*time.Millisecond)
	t0 := time.Now()
	d := p.sd.Decide(context.Background(), actions.Action{Kind: actions.DNS, Name: "x.test"})
	if el := time.Since(t0); d.Verdict != actions.Deny || !strings.Contains(d.Reason, "not connected") || el < 300*time.Millisecond || el > 2*time.Second {
		t.Fatalf("without a stream: %+v after %v", d, el)
	}

	cl := &Client{Path: sock}
	block := make(chan struct{})
	decide := func(ctx context.Context, a actions.Action, _ *gateway.ConnInfo) (actions.Decision, string) {
		if a.Name == "block.test" {
			close(block)
			<-ctx.Done()
		}
		return actions.Decision{Verdict: actions.Allow}, ""
	}
	// A question asked before the server connects, answered once it does.
	early := make(chan actions.Decision, 1)
	p.sd.Wait = 5 * time.Second
	go func() {
		early <- p.sd.Decide(context.Background(), actions.Action{Kind: actions.DNS, Name: "early.test"})
	}()
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = cl.ServeDecisions(ctx, decide, nil)
	}()
	if d := <-early; d.Verdict != actions.Allow {
		t.Fatalf("a question asked while the server connected: %+v", d)
	}
	// The stream ends (the server goes) while a question waits: denied.
	blocked := make(chan actions.Decision, 1)
	go func() {
		blocked <- p.sd.Decide(context.Background(), actions.Action{Kind: actions.DNS, Name: "block.test"})
	}()
	<-block
	cancel()
	<-served
	if d := <-blocked; d.Verdict != actions.Deny || !strings.Contains(d.Reason, "ended before the answer") {
		t.Fatalf("a question whose stream ended: %+v", d)
	}
}

// A restarted gateway (a new process on the same socket) gets the stream
// back from RunDecisions, and a link of it is decided by the server: a
// denied name is NXDOMAIN, an attach with decide=false never asks.
func TestDecisionsReconnectAfterGatewayRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ctl.sock")
	p := startGatewayProc(t, sock, 2*time.Second)
	cl := &Client{Path: sock}
	var mu sync.Mutex
	var asked []string
	decide := func(_ context.Context, a actions.Action, _ *gateway.ConnInfo) (actions.Decision, string) {
		mu.Lock()
		asked = append(asked, a.Sandbox+"/"+a.Name)
		mu.Unlock()
		return actions.Decision{Verdict: actions.Deny, Reason: "server says no"}, ""
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go cl.RunDecisions(ctx, decide, quiet)
	waitStream(t, p.sd)
	p.stop()

	p2 := startGatewayProc(t, sock, 2*time.Second)
	t0 := time.Now()
	waitStream(t, p2.sd)
	t.Logf("stream back %v after the restart", time.Since(t0))
	pol := api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}
	sbAsk := attachPair(t, cl, "sb-ask", pol, true)
	sbFast := attachPair(t, cl, "sb-fast", pol, false)
	if rc, _, err := sbAsk.Query(t, netip.MustParseAddr("198.18.0.1"), "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeNameError {
		t.Fatalf("a name the server denies: %v %v", rc, err)
	}
	// No upstream in this test: an allowed name the server is not asked
	// about fails upstream (SERVFAIL), not by the policy.
	if rc, _, err := sbFast.Query(t, netip.MustParseAddr("198.18.0.1"), "allowed.test", dnsmessage.TypeA); err != nil || rc != dnsmessage.RCodeServerFailure {
		t.Fatalf("a sandbox without rules: %v %v", rc, err)
	}
	mu.Lock()
	got := strings.Join(asked, ",")
	mu.Unlock()
	if got != "sb-ask/allowed.test" {
		t.Fatalf("asked: %q", got)
	}
	// Rules come for sb-fast: set-decide.
	if err := cl.SetDecide(ctx, "sb-fast", true); err != nil {
		t.Fatal(err)
	}
	if rc, _, _ := sbFast.Query(t, netip.MustParseAddr("198.18.0.1"), "allowed.test", dnsmessage.TypeA); rc != dnsmessage.RCodeNameError {
		t.Fatalf("after set-decide: %v", rc)
	}
	if err := cl.SetDecide(ctx, "sb-none", true); err == nil {
		t.Fatal("set-decide of an unknown sandbox succeeded")
	}
}

// attachPair attaches a socketpair NIC as id through the control client
// and returns the sandbox's side.
func attachPair(t *testing.T, cl *Client, id string, p api.NetworkPolicy, decide bool) *gatewaytest.SandboxStack {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	defer nic.Close()
	if err := cl.AttachDecide(context.Background(), id, nic, p, decide); err != nil {
		t.Fatal(err)
	}
	return gatewaytest.NewSandboxStack(t, fds[1])
}
