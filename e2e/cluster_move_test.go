package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/pgtest"
	"github.com/spacehq/space/sdk"
)

// TestClusterMovesASuspendedSandbox: two nodes share a suspend directory
// (storage both mount at one path). A gVisor sandbox suspended on n1 is
// exported there; n1 is killed with -9 and marked lost; a wake through a
// replica continues the sandbox on n2 — its files and its running
// process, memory and all. When n1 comes back it deletes its stale copy.
func TestClusterMovesASuspendedSandbox(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	root, err := os.MkdirTemp("", "clm-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	c := &testCluster{t: t, bin: buildSpace(t), dsn: pgtest.Shared(t).NewDatabase(t), root: root,
		certs: filepath.Join(root, "certs"), nodes: map[string]*clusterMember{}}
	c.space("cluster", "ca", c.certs)
	share := filepath.Join(root, "share")
	if err := os.Mkdir(share, 0o700); err != nil {
		t.Fatal(err)
	}
	n1 := c.startNode("n1", "--suspend-share", share)
	n2 := c.startNode("n2", "--suspend-share", share)
	defer func() {
		for _, m := range c.nodes {
			m.p.kill9()
		}
	}()
	r1 := c.startReplica("r1")
	defer r1.kill9()
	if c.cs, err = clusterstore.Open(ctx, c.dsn); err != nil {
		t.Fatal(err)
	}
	defer c.cs.Close()
	a := r1.client(t)
	// n2 prepares the base template first, so placement sends the
	// sandbox to n1... unless n1 has it too; pin it by draining n2 for
	// the create.
	if err := c.cs.Nodes().Drain(ctx, "n2", "test: create on n1"); err != nil {
		t.Fatal(err)
	}
	sb, err := a.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "gvisor"})
	if err != nil {
		t.Fatal(err)
	}
	var deleted bool
	defer func() {
		if !deleted {
			if op, err := a.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
				a.WaitOperation(context.Background(), op.ID)
			}
		}
	}()
	if row, _ := c.cs.Sandboxes().GetSandbox(ctx, sb.ID); row.Node != "n1" {
		t.Fatalf("created on %s, want n1", row.Node)
	}
	// Ready again: heartbeats keep a drained node draining, so undo it
	// the way an operator would (the row), before n1 is lost.
	execSQL(t, c.dsn, `UPDATE nodes SET state = 'ready', state_reason = '' WHERE id = 'n2'`)

	if _, err := a.WriteFile(ctx, sb.ID, "/root/kept", strings.NewReader("written on n1"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd, err := a.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{Detached: true,
		ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", "echo $$ > /tmp/loop.pid; x=remembered; while :; do echo $x > /tmp/alive; sleep 0.2; done"}}})
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	for deadline := time.Now().Add(20 * time.Second); pid == 0; time.Sleep(100 * time.Millisecond) {
		res, err := a.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"cat", "/tmp/loop.pid"}})
		if err == nil {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(res.Stdout)))
		}
		if time.Now().After(deadline) {
			t.Fatalf("the background loop never ran: %+v %v (command %s)", res, err, cmd.ID)
		}
	}
	op, err := a.Suspend(ctx, sb.ID)
	if err == nil {
		_, err = a.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatalf("suspend through the replica: %v", err)
	}
	exported := filepath.Join(share, sb.ID, "sandbox.json")
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := os.Stat(exported); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("n1 never exported the suspended sandbox to the share")
		}
	}

	n1.p.kill9()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		got, err := a.GetSandbox(ctx, sb.ID)
		if err == nil && got.State == clusterstore.StateLost {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox of a killed node is not lost: %+v %v", got, err)
		}
	}
	t0 := time.Now()
	op, err = a.Wake(ctx, sb.ID)
	if err == nil {
		_, err = a.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatalf("wake of a lost node's suspended sandbox: %v", err)
	}
	t.Logf("moved to another node and woken in %v", time.Since(t0).Round(time.Millisecond))
	if row, _ := c.cs.Sandboxes().GetSandbox(ctx, sb.ID); row.Node != "n2" {
		t.Fatalf("after the wake the row says %s (%s), want n2", row.Node, row.State)
	}
	got, err := a.GetSandbox(ctx, sb.ID)
	if err != nil || got.State != api.StateRunning {
		t.Fatalf("the moved sandbox: %+v %v", got, err)
	}
	res, err := a.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "cat /root/kept; kill -0 " + strconv.Itoa(pid) + " && echo same-process; sleep 0.5; cat /tmp/alive"}})
	if err != nil || string(res.Stdout) != "written on n1same-process\nremembered\n" {
		t.Fatalf("the moved sandbox's files and process: %+v %v", res, err)
	}

	// n1 comes back: its copy is stale and goes; the share's export goes
	// once the sandbox runs on n2.
	c.restartNode(n1)
	n1c := n1.p.client(t)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		l, err := n1c.ListSandboxes(ctx, sdk.ListOptions{})
		_, serr := os.Stat(filepath.Join(share, sb.ID))
		if err == nil && len(l) == 0 && os.IsNotExist(serr) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n1's stale copy or the share's export is left: %v %v %v", l, err, serr)
		}
	}
	op, err = a.DeleteSandbox(ctx, sb.ID, true)
	if err == nil {
		_, err = a.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		t.Fatal(err)
	}
	deleted = true
	_ = n2
}

// execSQL runs one statement on the cluster database, as an operator would.
func execSQL(t *testing.T, dsn, q string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), q); err != nil {
		t.Fatal(err)
	}
}
