package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

type proc struct {
	cmd  *exec.Cmd
	url  string
	data string
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func startServer(t *testing.T, bin, data, addr string, extra ...string) *proc {
	t.Helper()
	return startServerAs(t, "server", bin, data, addr, extra...)
}

// startServerAs is startServer with the command that runs it: "server", or
// "node" for a cluster node.
func startServerAs(t *testing.T, command, bin, data, addr string, extra ...string) *proc {
	t.Helper()
	// No default warm pool unless the test asks for one: a member is a
	// running sandbox that outlives a kill -9 (for the next start to
	// re-adopt), which a test that deletes only its own sandboxes would
	// leave running after its data directory is gone.
	if !slices.Contains(extra, "--pool-default") {
		extra = append(extra, "--pool-default", "0")
	}
	// Nothing leaves this machine: names the gateway would forward go to a
	// closed local port, and every dial off the machine is refused,
	// unless the test brings its own fake internet.
	if !slices.Contains(extra, "--dns-upstream") {
		extra = append(extra, "--dns-upstream", "127.0.0.1:9")
	}
	if !slices.Contains(extra, "--egress-dial-guard") {
		extra = append(extra, "--egress-dial-guard", "loopback")
	}
	checkNoOrphans(t, data)
	cmd := exec.Command(bin, append([]string{command, "--data", data, "--listen", addr, "--cache", testenv.CacheDir()}, extra...)...)
	cmd.Env = append(os.Environ(), "SPACE_AGENT_BIN="+testenv.AgentBinary(t), "SPACE_JAIL_BIN="+testenv.JailBinary(t),
		"SPACE_GATEWAY_BIN="+testenv.GatewayBinary(t))
	if err := os.MkdirAll(filepath.Dir(data), 0o700); err != nil {
		t.Fatal(err)
	}
	log, err := os.OpenFile(filepath.Join(data, "..", "server.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close() // the child has its own copy
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, url: "http://" + addr, data: data}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(p.url + "/healthz"); err == nil {
			resp.Body.Close()
			return p
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("server did not come up; see %s", filepath.Join(data, "..", "server.log"))
	return nil
}

var orphanChecks sync.Map

// checkNoOrphans fails the test if, when it ends, a process still names
// data on its command line (a runsc, QEMU or gateway of a sandbox the test
// left behind when it killed its server), and kills those processes so they
// do not outlive the run.
func checkNoOrphans(t *testing.T, data string) {
	if _, seen := orphanChecks.LoadOrStore(data, true); seen {
		return
	}
	t.Cleanup(func() {
		var left []string
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			left = left[:0]
			expired := time.Now().After(deadline)
			for pid, cmdline := range testenv.ProcsNaming(data) {
				left = append(left, strconv.Itoa(pid)+": "+cmdline)
				if expired {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			if len(left) == 0 || expired {
				break
			}
		}
		if len(left) > 0 {
			t.Errorf("processes outlived the test's server (killed now):\n  %s", strings.Join(left, "\n  "))
		}
	})
}

func (p *proc) kill9() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
}

func (p *proc) client(t *testing.T) *sdk.Client {
	key, err := os.ReadFile(filepath.Join(p.data, "api-key"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := sdk.New(p.url, strings.TrimSpace(string(key)))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestKill9LosesNothing kills the server with SIGKILL mid-create and
// mid-exec; after each restart the sandbox is there, usable, with its files,
// and after deleting it nothing of it is left on the host.
func TestKill9LosesNothing(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	bin := buildSpace(t)
	root := t.TempDir()
	data := filepath.Join(root, "data")
	addr := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	withPool := []string{"--pool-default", "1"}
	p := startServer(t, bin, data, addr, withPool...)
	c := p.client(t)
	// Warm the template store so the create below is quick but still racing the kill.
	if _, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Labels: map[string]string{"warm": "1"}}); err != nil {
		t.Fatal(err)
	}
	// The default pool fills: grow it so members are being made when the
	// kill lands (a half-made member must leave nothing behind).
	if _, err := c.SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: "auto", Min: 3, Max: 3}); err != nil {
		t.Fatal(err)
	}
	resp, err := c.CreateSandbox(ctx, api.CreateSandboxRequest{Labels: map[string]string{"crash": "create"}})
	if err != nil {
		t.Fatal(err)
	}
	p.kill9() // mid-create, mid-fill
	p = startServer(t, bin, data, addr, withPool...)
	c = p.client(t)
	op, err := c.WaitOperation(ctx, resp.Operation.ID)
	if err != nil {
		t.Fatalf("create after kill -9: %v", err)
	}
	if op.State != api.OpSucceeded {
		t.Fatalf("create op after restart: %+v", op)
	}
	id := resp.Sandbox.ID
	if _, err := c.WriteFile(ctx, id, "/root/before-crash", strings.NewReader("still here"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Mid-exec kill: the exec fails for the client, the sandbox survives.
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sleep", "3"}})
		done <- err
	}()
	time.Sleep(500 * time.Millisecond)
	p.kill9()
	<-done
	p = startServer(t, bin, data, addr, withPool...)
	c = p.client(t)
	sb, err := c.GetSandbox(ctx, id)
	if err != nil || sb.State != api.StateRunning {
		t.Fatalf("sandbox after second kill -9: %v %+v", err, sb)
	}
	res, err := c.Exec(ctx, id, api.ExecRequest{Cmd: []string{"cat", "/root/before-crash"}})
	if err != nil || res.Stdout != "still here" {
		t.Fatalf("exec after restart: %v %+v", err, res)
	}
	// Delete everything, stop the server, and look for leftovers.
	sbs, err := c.ListSandboxes(ctx, sdk.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range sbs {
		ids = append(ids, s.ID)
		op, err := c.DeleteSandbox(ctx, s.ID, true)
		if err != nil {
			t.Fatal(err)
		}
		if op, err := c.WaitOperation(ctx, op.ID); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("delete %s: %v %+v", s.ID, err, op)
		}
	}
	// Pools go, then a kill -9 (maybe mid-drain or mid-fill) and a start
	// without the default pool: its reconcile destroys whatever members
	// are left, whole or half-made.
	pools, err := c.ListPools(ctx)
	if err != nil || len(pools) == 0 {
		t.Fatalf("pools after restarts: %v %+v", err, pools)
	}
	for _, pl := range pools {
		if err := c.DeletePool(ctx, pl.ID); err != nil {
			t.Fatal(err)
		}
	}
	p.kill9()
	p = startServer(t, bin, data, addr, "--pool-default", "0")
	p.kill9()
	if leaks := hostLeaks(data); len(leaks) > 0 {
		t.Fatalf("leaked: %v", leaks)
	}
	for _, id := range ids {
		for _, ctrl := range []string{"memory", "pids", "freezer", "cpu", "unified"} {
			if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", ctrl, "space", id)); err == nil {
				t.Errorf("cgroup %s/space/%s leaked", ctrl, id)
			}
		}
		if out, _ := exec.Command("pgrep", "-f", id).Output(); len(out) > 0 {
			t.Errorf("processes of %s survive: %s", id, out)
		}
	}
	fmt.Fprintln(os.Stderr, "kill -9 test: sandboxes", ids)
}
