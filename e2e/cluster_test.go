package e2e

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/pgtest"
	"github.com/spacehq/space/sdk"
)

// TestClusterNode runs a real `space node --cluster-store` process as
// node n1 against a real PostgreSQL, with this test in the replicas' seat:
// the node registers and beats, records and reports the sandboxes it makes,
// applies the desired states a replica writes (pause, resume, delete), and
// after a kill -9 it is marked lost — it and its sandbox, with the reason —
// within the heartbeat window; restarted, it beats again and reports its
// sandbox running.
func TestClusterNode(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	dsn := pgtest.Shared(t).NewDatabase(t)
	bin := buildSpace(t)
	root, err := os.MkdirTemp("", "cl-") // short: sandbox socket paths live under it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	data := filepath.Join(root, "data")
	addr := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	nodeArgs := []string{"--cluster-store", dsn, "--node-id", "n1", "--heartbeat", "200ms"}

	p := startServerAs(t, "node", bin, data, addr, nodeArgs...)
	defer func() { p.kill9() }()
	cs, err := clusterstore.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	nodes, err := cs.Nodes().Nodes(ctx)
	if err != nil || len(nodes) != 1 || nodes[0].ID != "n1" || nodes[0].Address != "http://"+addr ||
		nodes[0].State != clusterstore.NodeReady || nodes[0].MemFree <= 0 || nodes[0].CPUs <= 0 {
		t.Fatalf("registered nodes %+v %v", nodes, err)
	}
	c := p.client(t)
	create := func() api.Sandbox {
		t.Helper()
		req := api.CreateSandboxRequest{Runtime: "native"}
		sb, err := c.CreateSandboxAndWait(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		// The node wrote the row before it answered the create.
		if r, err := cs.Sandboxes().GetSandbox(ctx, sb.ID); err != nil || r.Node != "n1" || r.Desired != clusterstore.DesiredRunning {
			t.Fatalf("row of a sandbox the node made: %+v %v", r, err)
		}
		return *sb
	}
	waitRow := func(id, what string, ok func(clusterstore.Sandbox, error) bool) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			r, err := cs.Sandboxes().GetSandbox(ctx, id)
			if ok(r, err) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("row of %s never %s: %+v %v", id, what, r, err)
			}
		}
	}
	applied := func(state string) func(clusterstore.Sandbox, error) bool {
		return func(r clusterstore.Sandbox, err error) bool {
			return err == nil && r.Observed == r.Generation && r.State == state
		}
	}
	sb := create()
	waitRow(sb.ID, "reported running", applied(api.StateRunning))
	for _, c2 := range []struct{ desired, state string }{
		{clusterstore.DesiredPaused, api.StatePaused},
		{clusterstore.DesiredRunning, api.StateRunning},
	} {
		if err := cs.Sandboxes().SetDesired(ctx, sb.ID, c2.desired); err != nil {
			t.Fatal(err)
		}
		waitRow(sb.ID, "applied "+c2.desired, applied(c2.state))
		if got, err := c.GetSandbox(ctx, sb.ID); err != nil || got.State != c2.state {
			t.Fatalf("the node's own record after %s: %+v %v", c2.desired, got, err)
		}
	}
	if err := cs.Sandboxes().SetDesired(ctx, sb.ID, clusterstore.DesiredDeleted); err != nil {
		t.Fatal(err)
	}
	waitRow(sb.ID, "removed", func(_ clusterstore.Sandbox, err error) bool { return errors.Is(err, errdefs.ErrNotFound) })
	if _, err := c.GetSandbox(ctx, sb.ID); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("a sandbox the cluster deleted is still on the node: %v", err)
	}

	// The node anchors its audit chain's head in PostgreSQL: the
	// checkpoint an export signs is there within a heartbeat or two.
	waitHead := func(what string, ok func(clusterstore.AuditHead) bool) clusterstore.AuditHead {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			h, err := cs.AuditHeads().AuditHead(ctx, "n1")
			if err == nil && ok(h) {
				return h
			}
			if time.Now().After(deadline) {
				t.Fatalf("audit head of n1 never %s: %+v %v", what, h, err)
			}
		}
	}
	exported := filepath.Join(root, "audit.jsonl")
	f, err := os.Create(exported)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExportAudit(ctx, "", "jsonl", f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	signed := lastAuditSeq(t, exported)
	waitHead("anchored the export's checkpoint", func(h clusterstore.AuditHead) bool { return h.Seq >= signed && h.Problem == "" })

	kept := create()
	waitRow(kept.ID, "reported running", applied(api.StateRunning))
	const window = 2 * time.Second
	lost := make(chan time.Time, 1)
	wctx, stopWatch := context.WithCancel(ctx)
	watchDone, err := cluster.WatchLost(wctx, cs.Nodes(), window, func([]string) { lost <- time.Now() }, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.kill9()
	killed := time.Now()
	select {
	case at := <-lost:
		t.Logf("node marked lost %v after kill -9 (heartbeat 200 ms, window %v)", at.Sub(killed).Round(time.Millisecond), window)
		if d := at.Sub(killed); d > window+window/4+time.Second {
			t.Errorf("lost %v after the kill; window %v", d, window)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a killed node was never marked lost")
	}
	stopWatch()
	<-watchDone
	r, err := cs.Sandboxes().GetSandbox(ctx, kept.ID)
	if err != nil || r.State != clusterstore.StateLost || !strings.Contains(r.StateReason, "node n1 lost: no heartbeat") {
		t.Fatalf("the lost node's sandbox: %+v %v", r, err)
	}

	// While it is down, its audit log is rolled back to before the head
	// it anchored (as restoring an older copy of the file would).
	anchored, err := cs.AuditHeads().AuditHead(ctx, "n1")
	if err != nil {
		t.Fatal(err)
	}
	adb, err := audit.OpenDB(filepath.Join(data, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adb.Exec(`DELETE FROM audit_records WHERE seq >= ?`, int64(anchored.Seq)); err != nil {
		t.Fatal(err)
	}
	adb.Close()

	// Back: the node beats again and its sandbox (still running: sandboxes
	// outlive their server) is reported running.
	p = startServerAs(t, "node", bin, data, addr, nodeArgs...)
	c = p.client(t)
	waitRow(kept.ID, "reported running again", func(r clusterstore.Sandbox, err error) bool {
		return err == nil && r.State == api.StateRunning
	})
	// It finds that its log no longer holds the anchored head: the problem
	// is on the head (which stays as it was) and in its own log.
	frozen := waitHead("reported the rollback", func(h clusterstore.AuditHead) bool { return h.Problem != "" })
	if frozen.Seq != anchored.Seq || frozen.Hash != anchored.Hash || !(strings.Contains(frozen.Problem, "before its anchored checkpoint") || strings.Contains(frozen.Problem, "not the one anchored")) {
		t.Fatalf("head after the rollback: %+v (anchored %d)", frozen, anchored.Seq)
	}
	recs, err := c.AuditRecords(ctx, sdk.AuditFilter{Kind: "audit"})
	if err != nil || !slices.ContainsFunc(recs, func(r api.AuditRecord) bool {
		return r.Action == "anchor" && strings.HasPrefix(r.Result, "mismatch: ")
	}) {
		t.Fatalf("the node's log does not record the mismatch: %+v %v", recs, err)
	}
	// An admin who has looked into it forgets the head; the node anchors
	// afresh.
	if err := cs.AuditHeads().ForgetAuditHead(ctx, "n1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExportAudit(ctx, "", "jsonl", io.Discard); err != nil {
		t.Fatal(err)
	}
	waitHead("anchored afresh", func(h clusterstore.AuditHead) bool { return h.Problem == "" && h.Seq > 0 })
	if nodes, _ := cs.Nodes().Nodes(ctx); len(nodes) != 1 || nodes[0].State != clusterstore.NodeReady {
		t.Fatalf("node after its return: %+v", nodes)
	}
	// Deleted on the node directly: the row goes.
	op, err := c.DeleteSandbox(ctx, kept.ID, true)
	if err == nil {
		_, err = c.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatal(err)
	}
	waitRow(kept.ID, "removed after the node's own delete", func(_ clusterstore.Sandbox, err error) bool {
		return errors.Is(err, errdefs.ErrNotFound)
	})
}

// A node whose cluster flags are incomplete or whose database is
// unreachable refuses to start instead of serving outside the cluster.
func TestClusterNodeRefusesBadConfig(t *testing.T) {
	testenv.RequireRoot(t)
	bin := buildSpace(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--cluster-store", "postgres://[::1"}, "cluster store DSN"},
		{[]string{"--cluster-store", "host=/nonexistent-space-socket-dir user=postgres dbname=x", "--node-id", "n1"}, "joining the cluster"},
		{[]string{"--cluster-store", "x", "--listen", "unix:/tmp/x.sock"}, "--advertise is required"},
		{[]string{"--cluster-store", "x", "--heartbeat", "0s"}, "--heartbeat must be positive"},
		{[]string{"--cluster-store", "x", "--cluster-listen", "127.0.0.1:1"}, "needs the cluster CA"},
		{[]string{"--store", "postgres://x"}, "needs the cluster CA"},
		{[]string{"--cluster-store", "x", "--suspend-share", "relative/dir"}, "--suspend-share"},
		{[]string{"--store", "postgres://x", "--cluster-store", "y"}, "one or the other"},
	} {
		root := t.TempDir()
		args := append([]string{"server", "--data", filepath.Join(root, "data"), "--cache", testenv.CacheDir(), "--pool-default", "0",
			"--listen", freePort(t)}, c.args...)
		cmd := exec.CommandContext(t.Context(), bin, args...)
		cmd.Env = append(os.Environ(), "SPACE_AGENT_BIN="+testenv.AgentBinary(t), "SPACE_JAIL_BIN="+testenv.JailBinary(t),
			"SPACE_GATEWAY_BIN="+testenv.GatewayBinary(t))
		cmd.WaitDelay = time.Minute
		b, err := cmd.CombinedOutput()
		out := string(b)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("space %s: err %v, output %q; want a refusal naming %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
}
