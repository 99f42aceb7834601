package gwctl

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/testenv"
)

// procStatus returns the named fields of /proc/pid/status.
func procStatus(t *testing.T, pid int) map[string]string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// TestSupervisedGateway runs the real gateway process: confined, serving a
// link, adopted by a new supervisor (a server restart) without losing the
// link, and restarted when it dies.
func TestSupervisedGateway(t *testing.T) {
	testenv.RequireRoot(t)
	dns := gatewaytest.StartDNS(t, map[string][]string{"allowed.test": {"127.0.0.2"}})
	dir := t.TempDir()
	var restarts atomic.Int32
	newSup := func() *Supervisor {
		return &Supervisor{
			Binary: testenv.GatewayBinary(t),
			Dir:    dir,
			Settings: Settings{DNSUpstream: dns.Addr, AllowPrivate: []string{"127.0.0.0/8"},
				Protect: []string{"127.0.0.1"}, DialGuard: "loopback"},
			Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
			OnRestart: func() { restarts.Add(1) },
		}
	}
	ctx := context.Background()
	sup := newSup()
	if err := sup.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { sup.Close(true) }()
	pid := sup.Pid()
	st := procStatus(t, pid)
	for k, want := range map[string]string{"NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0000000000000000"} {
		if st[k] != want {
			t.Errorf("gateway %s = %q, want %q", k, st[k], want)
		}
	}
	for _, k := range []string{"Uid", "Gid"} {
		if want := strings.Repeat(fmt.Sprint(UID)+"\t", 3) + fmt.Sprint(UID); st[k] != want {
			t.Errorf("gateway %s = %q, want %q", k, st[k], want)
		}
	}
	if st["Groups"] != "" {
		t.Errorf("gateway Groups = %q, want none", st["Groups"])
	}
	// What the confinement must refuse, tried from inside the gateway.
	probe, err := sup.Client().Probe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, what := range []string{"open", "socket_unix", "socket_netlink", "socket_packet", "execve", "unshare", "ptrace", "kill", "setuid", "bind"} {
		got, ok := probe[what]
		if !ok || got == "" {
			t.Errorf("the gateway could %s (probe %q, present %v)", what, got, ok)
		}
	}
	t.Logf("confinement probe: %v", probe)

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	c := sup.Client()
	// No rules for it (no server answers decisions here): the fast path.
	if err := c.AttachDecide(ctx, "sb1", nic, api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}, false); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	sb := gatewaytest.NewSandboxStack(t, fds[1])
	gw := netip.MustParseAddr(hostnet.GatewayAddr)
	resolve := func(name string) (dnsmessage.RCode, []netip.Addr) {
		t.Helper()
		rc, ips, err := sb.Query(t, gw, name, dnsmessage.TypeA)
		if err != nil {
			t.Fatalf("query %s: %v", name, err)
		}
		return rc, ips
	}
	if rc, ips := resolve("allowed.test"); rc != dnsmessage.RCodeSuccess || len(ips) != 1 {
		t.Fatalf("allowed.test: %v %v", rc, ips)
	}
	if rc, _ := resolve("denied.test"); rc != dnsmessage.RCodeNameError {
		t.Fatalf("denied.test: %v", rc)
	}
	// Bad input over the control socket is refused, named.
	if err := c.Attach(ctx, "sb2", nil, api.NetworkPolicy{}); errdefs.Code(err) != "invalid_argument" {
		t.Fatalf("attach without descriptor: %v (%s)", err, errdefs.Code(err))
	}
	if err := c.SetPolicy(ctx, "sb1", api.NetworkPolicy{AllowOut: []string{"*"}}); errdefs.Code(err) != "invalid_argument" {
		t.Fatalf("bare *: %v", err)
	}
	if _, err := c.Info(ctx, "nope"); errdefs.Code(err) != "not_found" {
		t.Fatalf("info of unknown: %v", err)
	}

	// A server restart: the new supervisor adopts the same process, and the
	// sandbox's link never went away.
	sup.Close(false)
	sup = newSup()
	if err := sup.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if sup.Pid() != pid {
		t.Fatalf("restarted server started a new gateway (%d, was %d)", sup.Pid(), pid)
	}
	ids, err := sup.Client().Attached(ctx)
	if err != nil || len(ids) != 1 || ids[0] != "sb1" {
		t.Fatalf("attached after adopt: %v %v", ids, err)
	}
	if rc, _ := resolve("allowed.test"); rc != dnsmessage.RCodeSuccess {
		t.Fatalf("after adopt: %v", rc)
	}
	var evs []api.NetworkEvent
	if err := sup.Client().Events(ctx, "sb1", 0, false, func(ev api.NetworkEvent) error { evs = append(evs, ev); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(evs) < 3 {
		t.Fatalf("events: %+v", evs)
	}

	// The gateway dies: a new one is started and OnRestart runs (the
	// manager re-attaches from there).
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for restarts.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if restarts.Load() == 0 || sup.Pid() == pid || sup.Pid() == 0 {
		t.Fatalf("gateway not restarted (restarts %d, pid %d)", restarts.Load(), sup.Pid())
	}
	if _, err := sup.Client().Ping(ctx); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(sup.logFile())
	if strings.Contains(string(b), "DIAL GUARD VIOLATION") {
		t.Fatalf("the gateway tried to dial off this machine:\n%s", b)
	}
}
