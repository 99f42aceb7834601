package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// fakeInternet stands in for the outside world on this machine only: a DNS
// server mapping test names to loopback addresses, and HTTP and HTTPS
// servers on 127.0.0.2 ("allowed.test") and 127.0.0.3 ("other.test",
// a name the policies deny, sharing nothing with allowed.test). Sandboxes
// reach 127.0.x.y as 198.19.x.y (the gateway's loopback alias).
type fakeInternet struct {
	dns               *gatewaytest.FakeDNS
	httpPort, tlsPort int
	// An HTTPS echo server on 127.0.0.2 for "api.test" and "plain.test"
	// (brokerPort), its certificate from upCA, a CA only the gateway
	// trusts (the server's --egress-upstream-ca is upCAFile): the real
	// hosts of credential brokering's tests.
	upCA       *gatewaytest.CA
	upCAFile   string
	brokerPort int
	udpHits    atomic.Int64
	udp        int
	stop       []func()
}

func startFakeInternet() (*fakeInternet, error) {
	fi := &fakeInternet{}
	d, stop, err := gatewaytest.ServeDNS("127.0.0.1:0", map[string][]string{
		"allowed.test":      {"127.0.0.2"},
		"other.test":        {"127.0.0.3"},
		"rebind-local.test": {"127.0.0.1"},
		"rebind-meta.test":  {"169.254.169.254"},
		"rebind-lan.test":   {"10.9.8.7"},
		"api.test":          {"127.0.0.2"},
		"plain.test":        {"127.0.0.2"},
	})
	if err != nil {
		return nil, err
	}
	fi.dns = d
	fi.stop = append(fi.stop, stop)
	if fi.upCA, err = gatewaytest.NewCA("test internet CA"); err != nil {
		fi.close()
		return nil, err
	}
	cert, err := fi.upCA.Issue("api.test", "plain.test")
	if err != nil {
		fi.close()
		return nil, err
	}
	bport, bstop, err := gatewaytest.ServeEcho("127.0.0.2:0", cert)
	if err != nil {
		fi.close()
		return nil, err
	}
	fi.brokerPort = int(bport)
	fi.stop = append(fi.stop, bstop)
	dir, err := os.MkdirTemp("", "space-e2e-internet-")
	if err != nil {
		fi.close()
		return nil, err
	}
	fi.stop = append(fi.stop, func() { os.RemoveAll(dir) })
	fi.upCAFile = filepath.Join(dir, "upstream-ca.pem")
	if err := os.WriteFile(fi.upCAFile, fi.upCA.CertPEM, 0o600); err != nil {
		fi.close()
		return nil, err
	}
	for _, tlsOn := range []bool{false, true} {
		port, stop, err := gatewaytest.ServeHTTPPair(tlsOn)
		if err != nil {
			fi.close()
			return nil, err
		}
		fi.stop = append(fi.stop, stop)
		if tlsOn {
			fi.tlsPort = int(port)
		} else {
			fi.httpPort = int(port)
		}
	}
	// A UDP listener that must never hear from a sandbox.
	pc, err := net.ListenPacket("udp", "127.0.0.2:0")
	if err != nil {
		fi.close()
		return nil, err
	}
	fi.udp = pc.LocalAddr().(*net.UDPAddr).Port
	fi.stop = append(fi.stop, func() { pc.Close() })
	go func() {
		buf := make([]byte, 2048)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			fi.udpHits.Add(1)
		}
	}()
	return fi, nil
}

func (fi *fakeInternet) close() {
	for _, f := range fi.stop {
		f()
	}
}

// sh runs a shell command in the sandbox and returns its output and code.
func sh(t *testing.T, e *env, id, script string) (string, int) {
	t.Helper()
	res, err := e.client.Exec(ctxT(t, 2*time.Minute), id, api.ExecRequest{Cmd: []string{"sh", "-c", script}})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	return res.Stdout + res.Stderr, res.ExitCode
}

func networkEvents(t *testing.T, e *env, id string) []api.NetworkEvent {
	t.Helper()
	var evs []api.NetworkEvent
	if err := e.client.NetworkEvents(ctxT(t, time.Minute), id, 0, false, func(ev api.NetworkEvent) error {
		evs = append(evs, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return evs
}

// networkRuntimes are the runtimes the egress test runs on (each sandbox
// gets its NIC its own way; the gateway and the policy are the same).
var networkRuntimes = []string{"native", "gvisor", "microvm"}

func TestNetworkEgressPolicy(t *testing.T) {
	e := setup(t)
	for _, rt := range networkRuntimes {
		t.Run(rt, func(t *testing.T) { testEgressPolicy(t, e, rt) })
	}
}

func testEgressPolicy(t *testing.T, e *env, runtime string) {
	fi := e.internet
	fi.dns.ForgetAsked()
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: runtime, Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test", "rebind-local.test", "rebind-meta.test", "rebind-lan.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	if sb.Network == nil || len(sb.Network.AllowOut) != 4 {
		t.Fatalf("sandbox does not report its policy: %+v", sb.Network)
	}
	if out, code := sh(t, e, sb.ID, "cat /etc/resolv.conf"); code != 0 || !strings.Contains(out, "nameserver 198.18.0.1") {
		t.Fatalf("resolv.conf: %d %q", code, out)
	}
	hp, tp := fi.httpPort, fi.tlsPort
	// An allowed name works from curl and from Python.
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", hp)); code != 0 || !strings.Contains(out, "127.0.0.2:") {
		info, _ := e.client.SandboxNetwork(ctxT(t, time.Minute), sb.ID)
		t.Fatalf("curl allowed.test: %d %q\ninfo %+v\nevents %+v", code, out, info, networkEvents(t, e, sb.ID))
	}
	py := fmt.Sprintf(`python3 -c "import urllib.request;print(urllib.request.urlopen('http://allowed.test:%d/',timeout=10).read().decode())"`, hp)
	if out, code := sh(t, e, sb.ID, py); code != 0 || !strings.Contains(out, "host=allowed.test") {
		t.Fatalf("python allowed.test: %d %q", code, out)
	}
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sSk --max-time 10 https://allowed.test:%d/", tp)); code != 0 || !strings.Contains(out, "127.0.0.2:") {
		t.Fatalf("curl https allowed.test: %d %q", code, out)
	}
	refused := []struct{ what, script string }{
		{"denied name", fmt.Sprintf("curl -sS --max-time 10 http://other.test:%d/", hp)},
		{"IP never resolved", fmt.Sprintf("curl -sS --max-time 10 http://198.19.0.3:%d/", hp)},
		{"allowed SNI to a denied name's IP", fmt.Sprintf("curl -sSk --max-time 10 --resolve allowed.test:%d:198.19.0.3 https://allowed.test:%d/", tp, tp)},
		{"allowed Host to a denied name's IP", fmt.Sprintf("curl -sS --max-time 10 -H 'Host: allowed.test' http://198.19.0.3:%d/", hp)},
		{"Host mismatch", fmt.Sprintf("curl -sS --max-time 10 -H 'Host: other.test' http://allowed.test:%d/", hp)},
		{"TLS without SNI", fmt.Sprintf("curl -sSk --max-time 10 https://198.19.0.2:%d/", tp)},
		{"rebinding to the host", fmt.Sprintf("curl -sS --max-time 10 http://rebind-local.test:%d/", hp)},
		{"rebinding to metadata", "curl -sS --max-time 10 http://rebind-meta.test/"},
		{"rebinding to a private address", "curl -sS --max-time 10 http://rebind-lan.test/"},
		{"the API port", fmt.Sprintf("curl -sS --max-time 10 http://198.19.0.1:%d/v1/sandboxes", e.apiPort)},
		{"the gateway's other ports", "curl -sS --max-time 10 http://198.18.0.1:80/"},
		{"IPv6", "curl -sS --max-time 10 'http://[2001:db8::1]/'"},
	}
	for _, r := range refused {
		if out, code := sh(t, e, sb.ID, r.script); code == 0 {
			t.Errorf("%s went through: %q", r.what, out)
		}
	}
	// A long-label query to a denied zone never reaches the upstream; DNS
	// to any other address and UDP out are dropped.
	long := strings.Repeat("x", 60) + ".exfil.denied.test"
	script := fmt.Sprintf(`python3 - <<'EOF'
import socket
try:
    socket.getaddrinfo(%q, 80); print("resolved")
except socket.gaierror as e:
    print("nxdomain", e)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
q = bytes.fromhex("12340100000100000000000007616c6c6f77656404746573740000010001")
s.sendto(q, ("198.19.0.2", 53))
try:
    s.recvfrom(512); print("answered")
except socket.timeout:
    print("dropped")
for i in range(5):
    s.sendto(b"leak", ("198.19.0.2", %d))
EOF`, long, fi.udp)
	out, _ := sh(t, e, sb.ID, script)
	if !strings.Contains(out, "nxdomain") || !strings.Contains(out, "dropped") {
		t.Fatalf("dns checks: %q", out)
	}
	if fi.dns.WasAsked(long) || fi.dns.WasAsked("other.test") {
		t.Fatal("a denied name reached the upstream resolver")
	}
	time.Sleep(200 * time.Millisecond)
	if n := fi.udpHits.Load(); n != 0 {
		t.Fatalf("%d UDP datagrams got out", n)
	}
	// Every verdict shows in the events.
	evs := networkEvents(t, e, sb.ID)
	seen := map[string]bool{}
	for _, ev := range evs {
		seen[ev.Protocol+"/"+ev.Verdict] = true
	}
	for _, want := range []string{"dns/allow", "dns/deny", "http/allow", "tls/allow", "tcp/deny", "dns/drop", "udp/drop"} {
		if !seen[want] {
			t.Errorf("no %s event; saw %v", want, seen)
		}
	}

	// Prometheus counters by verdict.
	resp, err := http.Get(e.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`space_network_events_total{protocol="dns",verdict="deny"}`, `space_network_events_total{protocol="tcp",verdict="deny"}`, "space_network_links "} {
		if !strings.Contains(string(mb), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// Live policy change: other.test becomes reachable at once, and the
	// old name's open connections end.
	if _, err := e.client.SetSandboxNetwork(ctxT(t, time.Minute), sb.ID, api.NetworkPolicy{AllowOut: []string{"other.test"}, AllowPrivate: []string{"127.0.0.0/8"}}); err != nil {
		t.Fatal(err)
	}
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://other.test:%d/", hp)); code != 0 || !strings.Contains(out, "127.0.0.3:") {
		t.Fatalf("after policy change, other.test: %d %q", code, out)
	}
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", hp)); code == 0 {
		t.Fatalf("after policy change, allowed.test still works: %q", out)
	}
	info, err := e.client.SandboxNetwork(ctxT(t, time.Minute), sb.ID)
	if err != nil || !info.Attached || info.Stats.BytesIn == 0 || info.Policy.AllowOut[0] != "other.test" {
		t.Fatalf("network info: %+v %v", info, err)
	}
}

func TestNetworkDefaultIsNoEgress(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", e.internet.httpPort)); code == 0 {
		t.Fatalf("a sandbox without a policy reached allowed.test: %q", out)
	}
	// A sandbox cannot reach another one: a server listening in A is not
	// reachable from B at any address B can name.
	a := newSandbox(t, e, api.CreateSandboxRequest{Network: &api.NetworkPolicy{Internet: true}})
	if _, err := e.client.Exec(ctxT(t, time.Minute), a.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "nohup python3 -m http.server 8000 >/dev/null 2>&1 &"}}); err != nil {
		t.Fatal(err)
	}
	b := newSandbox(t, e, api.CreateSandboxRequest{Network: &api.NetworkPolicy{Internet: true}})
	for _, dst := range []string{"198.18.0.1", "198.18.0.2", "198.18.0.3", "198.19.0.1"} {
		out, _ := sh(t, e, b.ID, fmt.Sprintf("curl -sS --max-time 5 -o /dev/null -w '%%{http_code}' http://%s:8000/ ; true", dst))
		if strings.Contains(out, "200") {
			t.Errorf("sandbox B reached a server on %s:8000: %q", dst, out)
		}
	}
}

func TestNetworkBadPolicies(t *testing.T) {
	e := setup(t)
	for _, c := range []struct {
		p     api.NetworkPolicy
		field string
	}{
		{api.NetworkPolicy{AllowOut: []string{"*"}}, "network.allow_out[0]"},
		{api.NetworkPolicy{AllowOut: []string{"ok.test", "10.0.0.0/33"}}, "network.allow_out[1]"},
		{api.NetworkPolicy{AllowOut: []string{"ok.test:70000"}}, "network.allow_out[0]"},
		{api.NetworkPolicy{DenyOut: []string{"example.com"}}, "network.deny_out[0]"},
		{api.NetworkPolicy{EgressProxy: "http://proxy:3128"}, "network.egress_proxy"},
	} {
		_, err := e.client.CreateSandbox(ctxT(t, time.Minute), api.CreateSandboxRequest{Network: &c.p})
		if errdefs.Code(err) != api.CodeInvalidArgument || !strings.Contains(err.Error(), c.field) {
			t.Errorf("%+v: got %v, want 400 naming %s", c.p, err, c.field)
		}
	}
}

// gatewayClean fails if the gateway ever tried to dial off this machine.
func gatewayClean(data string) error {
	b, err := os.ReadFile(filepath.Join(data, "network", "gateway.log"))
	if err != nil {
		return nil
	}
	if strings.Contains(string(b), "DIAL GUARD VIOLATION") {
		return fmt.Errorf("the gateway tried to dial off this machine:\n%s", b)
	}
	return nil
}

// TestNetworkSurvivesServerRestart: a sandbox keeps talking to the outside
// while the server is killed and started again; the new server adopts the
// same gateway process.
func TestNetworkSurvivesServerRestart(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	fi, err := startFakeInternet()
	if err != nil {
		t.Fatal(err)
	}
	defer fi.close()
	bin := buildSpace(t)
	root, err := os.MkdirTemp("", "nr-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	data := filepath.Join(root, "data")
	addr := freePort(t)
	flags := []string{"--egress-allow-private", "127.0.0.0/8", "--dns-upstream", fi.dns.Addr, "--egress-dial-guard", "loopback"}
	ctx := ctxT(t, 5*time.Minute)
	p := startServer(t, bin, data, addr, flags...)
	defer func() { p.kill9() }()
	c := p.client(t)
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if op, err := p.client(t).DeleteSandbox(context.Background(), sb.ID, true); err == nil {
			p.client(t).WaitOperation(context.Background(), op.ID)
		}
	}()
	// A loop in the sandbox fetches a page every 100 ms, logging each status.
	loop := fmt.Sprintf("nohup sh -c 'while true; do curl -s -o /dev/null --max-time 5 -w \"%%{http_code}\\n\" http://allowed.test:%d/ >> /tmp/codes; sleep 0.1; done' >/dev/null 2>&1 &", fi.httpPort)
	if _, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", loop}}); err != nil {
		t.Fatal(err)
	}
	codes := func() []string {
		res, err := p.client(t).Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/tmp/codes"}})
		if err != nil {
			t.Fatal(err)
		}
		return strings.Fields(res.Stdout)
	}
	for deadline := time.Now().Add(time.Minute); len(codes()) < 3; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the loop did not start: %v", codes())
		}
	}
	gwPid := func() string {
		b, _ := os.ReadFile(filepath.Join(data, "network", "gateway.pid"))
		return strings.Fields(string(b) + " none")[0]
	}
	pid := gwPid()
	before := len(codes())
	p.kill9()
	time.Sleep(2 * time.Second) // the sandbox keeps fetching meanwhile
	p = startServer(t, bin, data, addr, flags...)
	after := codes()
	if gwPid() != pid {
		t.Fatalf("the restarted server replaced the gateway (%s, was %s)", gwPid(), pid)
	}
	if len(after) < before+10 {
		t.Fatalf("the sandbox stopped fetching while the server was down: %d before, %d after", before, len(after))
	}
	for i, code := range after {
		if code != "200" {
			t.Fatalf("fetch %d got %s (of %v)", i, code, after)
		}
	}
	if err := gatewayClean(data); err != nil {
		t.Fatal(err)
	}
}

// TestNetworkBuildStep: a RUN step of a template build reaches what the
// build's policy allows (through the same gateway), and nothing else; a
// RUN --network=none step of the same build reaches nothing.
func TestNetworkBuildStep(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 10*time.Minute)
	dir := t.TempDir()
	file := fmt.Sprintf("FROM base:latest\n"+
		"RUN curl -sS --max-time 10 http://allowed.test:%d/ > /page.txt\n"+
		"RUN if curl -sS --max-time 5 http://other.test:%d/; then echo reached > /other.txt; else echo refused > /other.txt; fi\n"+
		"RUN --network=none sh -c 'if curl -sS --max-time 5 http://allowed.test:%d/; then echo reached; else echo refused; fi > /none.txt'\n",
		e.internet.httpPort, e.internet.httpPort, e.internet.httpPort)
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(file), 0o644); err != nil {
		t.Fatal(err)
	}
	const tag = "e2e-net-build:v1"
	t.Cleanup(func() { e.client.RemoveTemplate(context.Background(), tag, false) })
	var evs []api.BuildEvent
	if _, err := e.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{tag}, NoCache: true, AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}},
		func(ev api.BuildEvent) { evs = append(evs, ev) }); err != nil {
		t.Fatalf("build: %v (events %+v)", err, evs)
	}
	sb := newSandbox(t, e, api.CreateSandboxRequest{Template: tag})
	out, code := sh(t, e, sb.ID, "cat /page.txt /other.txt /none.txt")
	if code != 0 || !strings.Contains(out, "host=allowed.test") || !strings.Contains(out, "refused\nrefused") {
		t.Fatalf("build step network: %d %q", code, out)
	}
	// A bad build policy is refused before anything runs.
	_, err := e.client.BuildTemplate(ctx, dir, sdk.BuildOptions{Tags: []string{tag}, AllowOut: []string{"*"}}, nil)
	if errdefs.Code(err) != api.CodeInvalidArgument || !strings.Contains(err.Error(), "allow_out[0]") {
		t.Fatalf("bad build policy: %v", err)
	}
}

// TestNetworkSuspendAndFork (gvisor): after suspend and restore the NIC
// works again; a fork child gets its own gateway state — it inherits the
// policy but not the parent's DNS bindings, so an address only the parent
// resolved is refused to the child until it resolves the name itself.
func TestNetworkSuspendAndFork(t *testing.T) {
	e := setup(t)
	hp := e.internet.httpPort
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "gvisor", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	get := fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", hp)
	if out, code := sh(t, e, sb.ID, get); code != 0 || !strings.Contains(out, "host=allowed.test") {
		t.Fatalf("before suspend: %d %q", code, out)
	}
	ctx := ctxT(t, 5*time.Minute)
	wait := func(op *api.Operation, err error) *api.Operation {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		done, err := e.client.WaitOperation(ctx, op.ID)
		if err != nil {
			t.Fatal(err)
		}
		return done
	}
	wait(e.client.Suspend(ctx, sb.ID))
	info, err := e.client.SandboxNetwork(ctx, sb.ID)
	if err != nil || info.Attached {
		t.Fatalf("a suspended sandbox still has a link: %+v %v", info, err)
	}
	// What the ended link counted is kept.
	if len(info.History) == 0 || info.History[0].During != "suspend" || info.History[0].Stats.BytesIn == 0 {
		t.Fatalf("no summary of the link suspend ended: %+v", info.History)
	}
	wait(e.client.Restore(ctx, sb.ID))
	if out, code := sh(t, e, sb.ID, get); code != 0 || !strings.Contains(out, "host=allowed.test") {
		t.Fatalf("after restore: %d %q", code, out)
	}
	op := wait(e.client.Fork(ctx, sb.ID, api.ForkRequest{Count: 1}))
	if len(op.Children) != 1 {
		t.Fatalf("fork: %+v", op)
	}
	child := op.Children[0]
	t.Cleanup(func() {
		if op, err := e.client.DeleteSandbox(context.Background(), child, true); err == nil {
			e.client.WaitOperation(context.Background(), op.ID)
		}
	})
	csb, err := e.client.GetSandbox(ctx, child)
	if err != nil || csb.Network == nil || len(csb.Network.AllowOut) != 1 {
		t.Fatalf("child's policy: %+v %v", csb, err)
	}
	noDNS := fmt.Sprintf("curl -sS --max-time 10 --resolve allowed.test:%d:198.19.0.2 http://allowed.test:%d/", hp, hp)
	if out, code := sh(t, e, child, noDNS); code == 0 {
		t.Fatalf("the child used a binding only its parent resolved: %q", out)
	}
	if out, code := sh(t, e, child, get); code != 0 || !strings.Contains(out, "host=allowed.test") {
		t.Fatalf("child after its own resolution: %d %q", code, out)
	}
	if out, code := sh(t, e, sb.ID, noDNS); code != 0 {
		t.Fatalf("the parent lost its binding: %d %q", code, out)
	}
}

// TestNetworkGatewayCrash: the gateway process dies (kill -9); the server
// starts a new one and re-attaches every running sandbox, whose network
// comes back by itself.
func TestNetworkGatewayCrash(t *testing.T) {
	e := setup(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	get := fmt.Sprintf("curl -sS --max-time 5 http://allowed.test:%d/", e.internet.httpPort)
	if out, code := sh(t, e, sb.ID, get); code != 0 {
		t.Fatalf("before: %d %q", code, out)
	}
	pidFile := filepath.Join(e.data, "network", "gateway.pid")
	readPid := func() int {
		b, _ := os.ReadFile(pidFile)
		var pid int
		fmt.Sscan(string(b), &pid)
		return pid
	}
	old := readPid()
	if old <= 0 {
		t.Fatalf("no gateway pid in %s", pidFile)
	}
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	deadline := killed.Add(30 * time.Second)
	quick := fmt.Sprintf("curl -sS --max-time 2 --retry 0 http://allowed.test:%d/", e.internet.httpPort)
	for {
		out, code := sh(t, e, sb.ID, quick)
		if code == 0 && strings.Contains(out, "host=allowed.test") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the network did not come back after the gateway died: %d %q", code, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("network back %v after the gateway was killed", time.Since(killed).Round(time.Millisecond))
	if pid := readPid(); pid == old || pid <= 0 {
		t.Fatalf("gateway pid %d after the crash (was %d)", pid, old)
	}
	// The CLI shows the new link's events.
	out, _, code := e.spaceCLI(t, "", "net", "log", sb.ID)
	if code != 0 || !strings.Contains(out, "allowed.test") || !strings.Contains(out, "allow") {
		t.Fatalf("space net log: %d %q", code, out)
	}
}
