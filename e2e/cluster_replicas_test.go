package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/mcpserver"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/internal/testenv/pgtest"
	"github.com/spacehq/space/sdk"
)

// testCluster is PostgreSQL, nodes and replicas as separate processes, each
// with its own data directory, on this machine.
type testCluster struct {
	t     *testing.T
	bin   string
	dsn   string
	root  string
	certs string
	nodes map[string]*clusterMember
	cs    *clusterstore.Store
}

type clusterMember struct {
	name, addr, clusterAddr string
	args                    []string
	p                       *proc
}

func (c *testCluster) space(args ...string) {
	c.t.Helper()
	out, err := exec.Command(c.bin, args...).CombinedOutput()
	if err != nil {
		c.t.Fatalf("space %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// spaceAt runs the space CLI against replica r with key and returns its
// output.
func (c *testCluster) spaceAt(r *proc, key string, args ...string) string {
	c.t.Helper()
	out, err := exec.Command(c.bin, append([]string{"--url", r.url, "--api-key", key}, args...)...).CombinedOutput()
	if err != nil {
		c.t.Fatalf("space %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// logsIfFailed puts the end of every member's log in a failed test's
// output (before the temporary directory goes).
func (c *testCluster) logsIfFailed() {
	if !c.t.Failed() {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(c.root, "*", "server.log"))
	for _, f := range logs {
		b, _ := os.ReadFile(f)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		c.t.Logf("%s (last %d lines):\n%s", f, min(len(lines), 40), strings.Join(lines[max(0, len(lines)-40):], "\n"))
	}
}

// lastAuditSeq is the seq of an audit export's last record.
func lastAuditSeq(t *testing.T, file string) uint64 {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	var r api.AuditRecord
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &r); err != nil || r.Kind != "checkpoint" {
		t.Fatalf("%s does not end at a checkpoint: %+v %v", file, r, err)
	}
	return r.Seq
}

func (c *testCluster) startNode(name string, extra ...string) *clusterMember {
	c.t.Helper()
	cert := filepath.Join(c.certs, name)
	c.space("cluster", "cert", name, "--ca-dir", c.certs, "--role", "node", "--host", "127.0.0.1", "--out", cert)
	m := &clusterMember{name: name, addr: freePort(c.t), clusterAddr: freePort(c.t)}
	m.args = []string{"--cluster-store", c.dsn, "--node-id", name, "--heartbeat", "200ms",
		"--cluster-listen", m.clusterAddr, "--cluster-ca", filepath.Join(c.certs, "ca.crt"),
		"--cluster-cert", cert + ".crt", "--cluster-key", cert + ".key", "--orphan-grace", "3s",
		"--cluster-secrets-key", filepath.Join(c.certs, "secrets.key")}
	m.args = append(m.args, extra...)
	m.p = startServerAs(c.t, "node", c.bin, filepath.Join(c.root, name, "data"), m.addr, m.args...)
	c.nodes[name] = m
	return m
}

func (c *testCluster) restartNode(m *clusterMember) {
	m.p = startServerAs(c.t, "node", c.bin, filepath.Join(c.root, m.name, "data"), m.addr, m.args...)
}

func (c *testCluster) startReplica(name string) *proc {
	c.t.Helper()
	cert := filepath.Join(c.certs, name)
	c.space("cluster", "cert", name, "--ca-dir", c.certs, "--role", "replica", "--out", cert)
	return startServer(c.t, c.bin, filepath.Join(c.root, name, "data"), freePort(c.t),
		"--store", c.dsn, "--node-timeout", "2s", "--cluster-ca", filepath.Join(c.certs, "ca.crt"),
		"--cluster-cert", cert+".crt", "--cluster-key", cert+".key", "--cluster-secrets-key", filepath.Join(c.certs, "secrets.key"))
}

// TestClusterReplicasAndNodes is issue 15's cluster on one machine: a real
// PostgreSQL, two `space node` processes and two `space server --store`
// replicas. Creates through either replica land on both nodes; exec,
// files and attach work through the other replica; keys and tenants are
// the cluster's; an Idempotency-Key makes one sandbox of a retried create,
// also when the replica that got the first try is killed with -9 in the
// middle of it; a node killed with -9 is lost within the window, with its
// sandboxes, and comes back.
func TestClusterReplicasAndNodes(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	root, err := os.MkdirTemp("", "clr-") // short: sandbox socket paths live under it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	c := &testCluster{t: t, bin: buildSpace(t), dsn: pgtest.Shared(t).NewDatabase(t), root: root,
		certs: filepath.Join(root, "certs"), nodes: map[string]*clusterMember{}}
	c.space("cluster", "ca", c.certs)
	defer c.logsIfFailed()

	n1, n2 := c.startNode("n1"), c.startNode("n2")
	defer func() {
		for _, m := range c.nodes {
			m.p.kill9()
		}
	}()
	r1 := c.startReplica("r1")
	defer r1.kill9()
	r2 := c.startReplica("r2")
	defer r2.kill9()
	if c.cs, err = clusterstore.Open(ctx, c.dsn); err != nil {
		t.Fatal(err)
	}
	defer c.cs.Close()

	// The first replica stored the cluster's admin key; the second did not
	// make one of its own.
	a1 := r1.client(t)
	if _, err := os.Stat(filepath.Join(r2.data, "api-key")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the second replica wrote an api-key of its own: %v", err)
	}
	a2, err := sdk.New(r2.url, a1.APIKey)
	if err != nil {
		t.Fatal(err)
	}
	var cleanup []string
	defer func() {
		for _, id := range cleanup {
			if op, err := a1.DeleteSandbox(context.Background(), id, true); err == nil {
				a1.WaitOperation(context.Background(), op.ID)
			}
		}
	}()

	// Each node prepares the base template once (what placement's template
	// locality then sees on both), through its own API.
	for _, m := range []*clusterMember{n1, n2} {
		nc := m.p.client(t)
		sb, err := nc.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
		if err != nil {
			t.Fatal(err)
		}
		if op, err := nc.DeleteSandbox(ctx, sb.ID, true); err != nil {
			t.Fatal(err)
		} else if _, err := nc.WaitOperation(ctx, op.ID); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		nodes, err := c.cs.Nodes().Nodes(ctx)
		if err == nil && len(nodes) == 2 && slices.Contains(nodes[0].Templates, "base:latest") && slices.Contains(nodes[1].Templates, "base:latest") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("nodes' templates: %+v %v", nodes, err)
		}
	}

	// Creates through either replica land on both nodes.
	onNode := map[string][]string{}
	var ids []string
	for i, a := range []*sdk.Client{a1, a2, a1, a2} {
		sb, err := a.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native", Labels: map[string]string{"i": fmt.Sprint(i)}})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		cleanup = append(cleanup, sb.ID)
		ids = append(ids, sb.ID)
		if sb.State != api.StateRunning {
			t.Fatalf("create %d answered %s", i, sb.State)
		}
		row, err := c.cs.Sandboxes().GetSandbox(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		onNode[row.Node] = append(onNode[row.Node], sb.ID)
	}
	if len(onNode["n1"]) == 0 || len(onNode["n2"]) == 0 {
		t.Fatalf("four creates did not use both nodes: %v", onNode)
	}
	t.Logf("placement of four creates: %v", onNode)
	resp, err := http.Get(r1.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(metrics), "space_replica_placements_total{node=") || !strings.Contains(string(metrics), "space_replica_node_seconds_bucket") {
		t.Fatalf("a replica's metrics lack placements or node timings:\n%.2000s", metrics)
	}

	// Each node keeps its own audit chain and anchors its head in
	// PostgreSQL; through a replica, an export of it verifies with the
	// node's key and against that head.
	if _, err := a2.AuditRecords(ctx, sdk.AuditFilter{}); !errors.Is(err, sdk.ErrInvalidArgument) || !strings.Contains(err.Error(), "?node=") {
		t.Fatalf("an audit listing through a replica naming no node: %v", err)
	}
	for _, node := range []string{"n1", "n2"} {
		f1, f2 := filepath.Join(root, node+"-1.jsonl"), filepath.Join(root, node+"-2.jsonl")
		c.spaceAt(r1, a1.APIKey, "audit", "export", "--node", node, "-o", f1) // signs a checkpoint, which the node anchors
		signed := lastAuditSeq(t, f1)
		var head api.AuditHead
		for deadline := time.Now().Add(10 * time.Second); head.Seq < signed; time.Sleep(100 * time.Millisecond) {
			heads, err := a2.AuditHeads(ctx)
			if err != nil || time.Now().After(deadline) {
				t.Fatalf("node %s never anchored its checkpoint %d: %+v %v", node, signed, heads, err)
			}
			for _, h := range heads {
				if h.Node == node {
					head = h
				}
			}
		}
		if head.Problem != "" || head.Checkpoint.Kind != "checkpoint" || head.Checkpoint.Hash != head.Hash || head.KeyID == "" {
			t.Fatalf("head of %s: %+v", node, head)
		}
		c.spaceAt(r2, a1.APIKey, "audit", "export", "--node", node, "-o", f2)
		if out := c.spaceAt(r2, a1.APIKey, "audit", "verify", f2, "--server", "--node", node); !strings.Contains(out, "anchored: 1 of 1 heads found unchanged") {
			t.Fatalf("verify %s's export against its head: %s", node, out)
		}
	}

	// Everything about a sandbox works through the replica that did not
	// create it.
	for i, id := range ids {
		other := []*sdk.Client{a2, a1}[i%2]
		res, err := other.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sh", "-c", "echo out-$0; echo err >&2; exit 3", id}})
		if err != nil || res.ExitCode != 3 || string(res.Stdout) != "out-"+id+"\n" || string(res.Stderr) != "err\n" {
			t.Fatalf("exec in %s through the other replica: %+v %v", id, res, err)
		}
		if _, err := other.WriteFile(ctx, id, "/tmp/f", strings.NewReader("data of "+id), 0o644); err != nil {
			t.Fatal(err)
		}
		rc, err := a1.ReadFile(ctx, id, "/tmp/f")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(rc)
		rc.Close()
		if string(b) != "data of "+id {
			t.Fatalf("file of %s read back %q", id, b)
		}
	}
	// Attach: a command started through one replica, its output and stdin
	// through the other (the WebSocket crosses the replica and the
	// node's mutual TLS).
	cmd, err := a1.CreateCommand(ctx, ids[1], api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", "read l; echo got-$l"}}})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	sess, err := a2.Attach(ctx, cmd, sdk.AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(sess.Stdin, "hello\n")
	st, err := sess.Wait()
	sess.Close()
	if err != nil || st.ExitCode != 0 || out.String() != "got-hello\n" {
		t.Fatalf("attach through the other replica: %+v %v %q", st, err, out.String())
	}
	// A service in a sandbox, through a replica: the URLs it gives are the
	// replica's, and host-routed traffic reaches the service on the node
	// with the port token or a cluster key (vouched, not passed on).
	if res, err := a1.Exec(ctx, ids[1], api.ExecRequest{Cmd: []string{"sh", "-c",
		"mkdir -p /srv && echo hello-cluster > /srv/m.txt && cd /srv && (nohup python3 -m http.server 8000 >/dev/null 2>&1 &)"}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("starting a service: %+v %v", res, err)
	}
	pi, err := a2.Port(ctx, ids[1], 8000)
	r2Port := r2.url[strings.LastIndex(r2.url, ":")+1:]
	hostRouted := "8000-" + ids[1] + ".localhost:" + r2Port
	if err != nil || pi.URL != "http://"+hostRouted+"/" || pi.PathURL != r2.url+"/v1/sandboxes/"+ids[1]+"/ports/8000/" || pi.Token == "" {
		t.Fatalf("port through a replica: %+v %v", pi, err)
	}
	getPort := func(h map[string]string) (int, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "GET", r2.url+"/m.txt", nil)
		req.Host = hostRouted
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := 0, ""
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if code, body = getPort(map[string]string{api.PortTokenHeader: pi.Token}); code != http.StatusServiceUnavailable {
			break
		}
	}
	if code != http.StatusOK || body != "hello-cluster\n" {
		t.Fatalf("host-routed through a replica with the token: %d %q", code, body)
	}
	if code, body = getPort(map[string]string{"Authorization": "Bearer " + a1.APIKey}); code != http.StatusOK || body != "hello-cluster\n" {
		t.Fatalf("host-routed through a replica with a cluster key: %d %q", code, body)
	}
	if code, _ = getPort(nil); code != http.StatusUnauthorized {
		t.Fatalf("host-routed through a replica without credentials: %d", code)
	}
	// What the service sees of such a request: neither the key nor the
	// principal the replica vouched for.
	const echoHeaders = `import http.server as h
class E(h.BaseHTTPRequestHandler):
    def do_GET(self):
        b = str(self.headers).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
h.HTTPServer(("0.0.0.0", 8001), E).serve_forever()`
	if res, err := a1.Exec(ctx, ids[1], api.ExecRequest{Cmd: []string{"sh", "-c", "(nohup python3 -c \"$0\" >/dev/null 2>&1 &)", echoHeaders}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("starting a header echo: %+v %v", res, err)
	}
	hostRouted = "8001-" + ids[1] + ".localhost:" + r2Port
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if code, body = getPort(map[string]string{"Authorization": "Bearer " + a1.APIKey}); code != http.StatusServiceUnavailable {
			break
		}
	}
	if code != http.StatusOK || !strings.Contains(body, "8001-"+ids[1]) || strings.Contains(strings.ToLower(body), "space-cluster-principal") || strings.Contains(body, a1.APIKey) {
		t.Fatalf("what a service saw of a request through a replica: %d\n%s", code, body)
	}

	// MCP on a replica: its tools' calls come back to the replica, so a
	// sandbox made by a tool is placed on a node and everything else
	// reaches it there.
	tr := &mcp.StreamableClientTransport{Endpoint: r2.url + "/mcp", MaxRetries: -1,
		HTTPClient: &http.Client{Transport: bearer{a1.APIKey, http.DefaultTransport}}}
	mcs, err := mcp.NewClient(&mcp.Implementation{Name: "space-e2e", Version: "1"}, nil).Connect(ctx, tr, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer mcs.Close()
	msb := toolOK[mcpserver.SandboxInfo](t, mcs, "sandbox_create", map[string]any{"runtime": "native", "labels": map[string]any{"via": "mcp"}})
	cleanup = append(cleanup, msb.ID)
	if row, err := c.cs.Sandboxes().GetSandbox(ctx, msb.ID); err != nil || (row.Node != "n1" && row.Node != "n2") {
		t.Fatalf("row of a sandbox an MCP tool made through a replica: %+v %v", row, err)
	}
	if run := toolOK[mcpserver.CommandRunOut](t, mcs, "command_run", map[string]any{"id": msb.ID, "cmd": "echo via-mcp"}); run.ExitCode != 0 || run.Stdout != "via-mcp\n" {
		t.Fatalf("command_run through a replica: %+v", run)
	}
	toolOK[mcpserver.FileWriteOut](t, mcs, "file_write", map[string]any{"id": msb.ID, "path": "/tmp/m.txt", "content": "mcp-file"})
	if rd := toolOK[mcpserver.FileReadOut](t, mcs, "file_read", map[string]any{"id": msb.ID, "path": "/tmp/m.txt"}); rd.Content != "mcp-file" {
		t.Fatalf("file_read through a replica: %+v", rd)
	}
	if port := toolOK[mcpserver.PortExposeOut](t, mcs, "port_expose", map[string]any{"id": msb.ID, "port": 8000}); !strings.HasPrefix(port.URL, "http://8000-"+msb.ID+".localhost:"+r2Port+"/") {
		t.Fatalf("port_expose through a replica: %+v", port)
	}
	if ls := toolOK[mcpserver.SandboxListOut](t, mcs, "sandbox_list", map[string]any{"label": "via=mcp"}); len(ls.Sandboxes) != 1 || ls.Sandboxes[0].ID != msb.ID {
		t.Fatalf("sandbox_list through a replica: %+v", ls)
	}
	if d := toolOK[mcpserver.SandboxDeleteOut](t, mcs, "sandbox_delete", map[string]any{"id": msb.ID}); !d.Deleted {
		t.Fatalf("sandbox_delete through a replica: %+v", d)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := c.cs.Sandboxes().GetSandbox(ctx, msb.ID); errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the row of a sandbox deleted by an MCP tool stays")
		}
	}

	// E2B's JS SDK, unmodified, pointed at a replica.
	if node, err := exec.LookPath("node"); err != nil {
		testenv.Require(t, "node", false, "node is not on PATH (scripts/setup-test.sh checks for it)")
	} else {
		cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", "cluster-e2b.mjs")
		cmd.Dir = "js"
		cmd.Env = append(os.Environ(), "REPLICA_URL="+r2.url,
			"E2B_API_URL="+r2.url+"/e2b", "E2B_SANDBOX_URL="+r2.url+"/e2b/envd",
			"E2B_API_KEY="+a1.APIKey, "E2B_DOMAIN=localhost:"+r2Port)
		out, err := cmd.CombinedOutput()
		if err != nil || testing.Verbose() {
			t.Logf("node --test cluster-e2b.mjs:\n%s", out)
		}
		if err != nil {
			t.Fatalf("E2B's SDK through a replica: %v", err)
		}
	}

	// E2B's error shapes from the replica itself.
	for _, c := range []struct {
		method, path, key string
		status            int
		want              string
	}{
		{"GET", "/e2b/sandboxes", "", http.StatusUnauthorized, `"code":401`},
		{"GET", "/e2b/snapshots", a1.APIKey, http.StatusUnprocessableEntity, "not served by a cluster replica"},
		{"GET", "/e2b/sandboxes/sb-nosuchsandbox00", a1.APIKey, http.StatusNotFound, `"code":404`},
		{"POST", "/e2b/envd/process.Process/List", "", http.StatusBadRequest, `"code":"invalid_argument"`},
	} {
		req, _ := http.NewRequestWithContext(ctx, c.method, r2.url+c.path, strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		if c.key != "" {
			req.Header.Set("X-API-Key", c.key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || !strings.Contains(string(b), c.want) {
			t.Fatalf("%s %s through a replica: %d %s", c.method, c.path, resp.StatusCode, b)
		}
	}

	// Lifecycle through the other replica.
	for _, verb := range []string{api.OpPause, api.OpResume} {
		op, err := a2.Lifecycle(ctx, ids[0], verb)
		if err == nil {
			_, err = a2.WaitOperation(ctx, op.ID)
		}
		if err != nil {
			t.Fatalf("%s through r2: %v", verb, err)
		}
	}

	// Keys live in the cluster: one made through r1 works at r2 at once;
	// its tenant sees only its own sandboxes.
	key, err := a1.CreateKey(ctx, api.CreateKeyRequest{Name: "acme", Tenant: "acme", Scopes: []string{"sandbox:write", "exec:write"}})
	if err != nil {
		t.Fatal(err)
	}
	acme, _ := sdk.New(r2.url, key.Key)
	if _, err := acme.GetSandbox(ctx, ids[0]); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("another tenant's sandbox through r2: %v", err)
	}
	if _, err := acme.Exec(ctx, ids[0], api.ExecRequest{Cmd: []string{"true"}}); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("exec in another tenant's sandbox through r2: %v", err)
	}
	if l, err := acme.ListSandboxes(ctx, sdk.ListOptions{}); err != nil || len(l) != 0 {
		t.Fatalf("acme lists %v %v", l, err)
	}
	// Tenants and policies are the cluster's: set through one replica,
	// every node mirrors them. acme may have one sandbox in the whole
	// cluster.
	if _, err := a1.SetTenant(ctx, api.Tenant{Name: "acme", Quotas: api.Quotas{Sandboxes: 1}}); err != nil {
		t.Fatal(err)
	}
	for _, m := range c.nodes {
		nc := m.p.client(t)
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			tn, err := nc.Tenant(ctx, "acme")
			if err == nil && tn.Quotas.Sandboxes == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %s never mirrored tenant acme: %+v %v", m.name, tn, err)
			}
		}
	}
	acmeSB, err := acme.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	acmeR1, _ := sdk.New(r1.url, key.Key)
	if _, err := acmeR1.CreateSandbox(ctx, api.CreateSandboxRequest{Runtime: "native"}); !errors.Is(err, sdk.ErrQuotaExceeded) {
		t.Fatalf("acme's second sandbox in the cluster: %v", err)
	}
	if op, err := a1.DeleteSandbox(ctx, acmeSB.ID, true); err != nil {
		t.Fatal(err)
	} else if _, err := a1.WaitOperation(ctx, op.ID); err != nil {
		t.Fatal(err)
	}
	// A rule set put through r1 denies on both nodes, through r2; removed
	// through r2, it is gone from both.
	deny := api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "no-whoami", Match: `action.kind == "exec" && action.argv[0] == "whoami"`, Verdict: "deny", Reason: "cluster rule"}}}
	if _, err := a1.SetPolicyRuleSet(ctx, "tenant:default", deny); err != nil {
		t.Fatal(err)
	}
	bad := api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "bad", Match: `action.pth == "/x"`, Verdict: "deny"}}}
	if _, err := a1.SetPolicyRuleSet(ctx, "tenant:default", bad); !errors.Is(err, sdk.ErrInvalidArgument) {
		t.Fatalf("a rule set that does not compile: %v", err)
	}
	for _, id := range []string{onNode["n1"][0], onNode["n2"][0]} {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			_, err := a2.Exec(ctx, id, api.ExecRequest{Cmd: []string{"whoami"}})
			if errors.Is(err, sdk.ErrPolicyDenied) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the cluster's rule never denied in %s: %v", id, err)
			}
		}
	}
	if err := a2.DeletePolicyRuleSet(ctx, "tenant:default"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{onNode["n1"][0], onNode["n2"][0]} {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			res, err := a1.Exec(ctx, id, api.ExecRequest{Cmd: []string{"whoami"}})
			if err == nil && res.ExitCode == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the removed rule still denies in %s: %v", id, err)
			}
		}
	}
	// An "ask" through the cluster: the exec through r2 is held by n2,
	// r1 lists the pending approval from every node, r2 answers it (it
	// finds the node that holds it), and the exec runs.
	ask := api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "ask-echo", Match: `action.kind == "exec" && action.argv[0] == "echo"`, Verdict: "ask", Reason: "cluster ask"}}}
	if _, err := a1.SetPolicyRuleSet(ctx, "tenant:default", ask); err != nil {
		t.Fatal(err)
	}
	n2c := n2.p.client(t)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if rs, err := n2c.PolicyRuleSet(ctx, "tenant:default"); err == nil && len(rs.Rules) == 1 && rs.Rules[0].Name == "ask-echo" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("n2 never mirrored the ask rule")
		}
	}
	held := onNode["n2"][0]
	execDone := make(chan error, 1)
	go func() {
		res, err := a2.Exec(ctx, held, api.ExecRequest{Cmd: []string{"echo", "approved"}})
		if err == nil && (res.ExitCode != 0 || res.Stdout != "approved\n") {
			err = fmt.Errorf("exit %d, %q", res.ExitCode, res.Stdout)
		}
		execDone <- err
	}()
	var pending api.Approval
	for deadline := time.Now().Add(20 * time.Second); pending.ID == ""; time.Sleep(100 * time.Millisecond) {
		list, err := a1.Approvals(ctx, sdk.ApprovalsOptions{State: api.ApprovalPending})
		if err != nil || time.Now().After(deadline) {
			t.Fatalf("no pending approval listed through r1: %+v %v", list, err)
		}
		for _, ap := range list.Approvals {
			if ap.Sandbox == held {
				pending = ap
			}
		}
	}
	if list, err := a2.Approvals(ctx, sdk.ApprovalsOptions{Sandbox: held}); err != nil || len(list.Approvals) == 0 || list.Approvals[0].ID != pending.ID {
		t.Fatalf("approvals of one sandbox through r2: %+v %v", list, err)
	}
	if _, err := a2.Approve(ctx, "ap-nosuchapproval", ""); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("an approval no node holds: %v", err)
	}
	if ap, err := a2.Approve(ctx, pending.ID, "ok from r2"); err != nil || ap.State != api.ApprovalApproved {
		t.Fatalf("approving through r2: %+v %v", ap, err)
	}
	select {
	case err := <-execDone:
		if err != nil {
			t.Fatalf("the approved exec: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the approved exec never ran")
	}
	if err := a2.DeletePolicyRuleSet(ctx, "tenant:default"); err != nil {
		t.Fatal(err)
	}

	if _, err := a2.RevokeKey(ctx, key.ID); err != nil {
		t.Fatal(err)
	}
	acme1, _ := sdk.New(r1.url, key.Key)
	revoked := false
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && !revoked; time.Sleep(200 * time.Millisecond) {
		_, err := acme1.ListSandboxes(ctx, sdk.ListOptions{})
		revoked = errors.Is(err, sdk.ErrUnauthorized)
	}
	if !revoked {
		t.Fatal("a key revoked through r2 still works at r1 after 5 s")
	}
	// The principal header means nothing on a node's plain listener, and
	// its cluster listener wants a replica's certificate.
	req, _ := http.NewRequest(http.MethodGet, n1.p.url+"/v1/sandboxes", nil)
	req.Header.Set("Space-Cluster-Principal", `{"Tenant":"default","Scopes":["admin"]}`)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a forged principal on a node's plain listener: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	insecure := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	if resp, err := insecure.Get("https://" + n1.clusterAddr + "/v1/sandboxes"); err == nil {
		resp.Body.Close()
		t.Fatalf("the cluster listener answered a client without a certificate: %s", resp.Status)
	}
	// A call without a key, or a route a replica does not serve: JSON 4xx.
	resp, err = http.Get(r1.url + "/v1/sandboxes")
	if err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no key: %v %v", resp, err)
	}
	resp.Body.Close()
	if info, err := a2.Info(ctx); err != nil || len(info.Runtimes) == 0 {
		t.Fatalf("info through a replica: %+v %v", info, err)
	}
	if _, err := a2.GCTemplates(ctx); !errors.Is(err, sdk.ErrNotSupported) {
		t.Fatalf("a route replicas do not serve: %v", err)
	}

	// Secrets: set through a replica, sealed in PostgreSQL, mirrored by
	// every node; a grant through the other replica is made on the
	// sandbox's node; a rotation and a deletion reach the nodes.
	v1, v2 := "v1-cluster-secret", "v2-cluster-secret"
	sec, err := a2.SetSecret(ctx, "GH_TOKEN", api.SetSecretRequest{Value: &v1, Hosts: []string{"api.example.test"}, Header: "Authorization: Bearer {}"})
	if err != nil || sec.Version != 1 || sec.Tenant != "default" || !slices.Equal(sec.Hosts, []string{"api.example.test"}) {
		t.Fatalf("a secret set through a replica: %+v %v", sec, err)
	}
	if row, err := c.cs.Secrets().GetSecret(ctx, "default", "GH_TOKEN"); err != nil || len(row.Sealed) == 0 || bytes.Contains(row.Sealed, []byte(v1)) {
		t.Fatalf("the secret's row in PostgreSQL is not sealed: %v", err)
	}
	var grant *api.SecretGrant
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if grant, err = a1.GrantSecret(ctx, ids[0], "GH_TOKEN"); err == nil || !errors.Is(err, sdk.ErrNotFound) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || grant.Placeholder == "" {
		t.Fatalf("a grant through the other replica of a secret set through the first: %+v %v", grant, err)
	}
	nodeSecret := func(m *clusterMember, ok func(*api.Secret, error) bool, what string) {
		t.Helper()
		nc := m.p.client(t)
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			got, err := nc.GetSecret(ctx, "GH_TOKEN")
			if ok(got, err) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %s never %s: %+v %v", m.name, what, got, err)
			}
		}
	}
	for _, m := range []*clusterMember{n1, n2} {
		nodeSecret(m, func(s *api.Secret, err error) bool { return err == nil && s.Header == "Authorization: Bearer {}" }, "mirrored the secret")
	}
	if sec, err = a1.SetSecret(ctx, "GH_TOKEN", api.SetSecretRequest{Value: &v2, Hosts: []string{"api.example.test"}, Header: "Authorization: Bearer {}"}); err != nil || sec.Version != 2 {
		t.Fatalf("a rotation through a replica: %+v %v", sec, err)
	}
	for _, m := range []*clusterMember{n1, n2} {
		nodeSecret(m, func(s *api.Secret, err error) bool { return err == nil && s.Version == 2 }, "mirrored the rotation")
	}
	if list, err := a2.ListSecrets(ctx); err != nil || len(list) != 1 || list[0].Name != "GH_TOKEN" || list[0].Version != 2 {
		t.Fatalf("secrets listed by a replica: %+v %v", list, err)
	}
	if err := a2.DeleteSecret(ctx, "GH_TOKEN"); err != nil {
		t.Fatal(err)
	}
	for _, m := range []*clusterMember{n1, n2} {
		nodeSecret(m, func(_ *api.Secret, err error) bool { return errors.Is(err, sdk.ErrNotFound) }, "removed the deleted secret")
	}
	if grants, err := a1.SandboxSecrets(ctx, ids[0]); err != nil || len(grants) != 0 {
		t.Fatalf("grants of a deleted secret: %+v %v", grants, err)
	}

	// Warm pools are the cluster's: set through one replica (a node checks
	// the spec), kept by every node; a create through the other replica is
	// a claim on a warm node; removed, every node drops its members.
	if _, err := a2.SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: "native", Min: 3, Max: 2}); !errors.Is(err, sdk.ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "min (3) must not exceed max (2)") {
		t.Fatalf("a bad pool through a replica: %v", err)
	}
	if _, err := a2.SetPool(ctx, api.PoolSpec{Template: "nope:1", Runtime: "native", Max: 1}); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("a pool of a template no node has: %v", err)
	}
	if _, err := n1.p.client(t).SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: "native", Max: 1}); !errors.Is(err, sdk.ErrConflict) {
		t.Fatalf("a pool set on a node directly: %v", err)
	}
	pool, err := a1.SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: "native", Min: 1, Max: 1})
	if err != nil || pool.Ready != 0 || pool.Runtime != "native" {
		t.Fatalf("a pool set through a replica: %+v %v", pool, err)
	}
	if st, err := c.cs.Settings().Settings(ctx); err != nil || st.Pools[pool.ID] != pool.Spec {
		t.Fatalf("the pool's row: %+v %v", st.Pools, err)
	}
	waitPool := func(what string, ok func(*api.Pool, error) bool) *api.Pool {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			got, err := a2.Pool(ctx, pool.ID)
			if ok(got, err) {
				return got
			}
			if time.Now().After(deadline) {
				t.Fatalf("the pool never %s: %+v %v", what, got, err)
			}
		}
	}
	warm := waitPool("had a member on each node", func(p *api.Pool, err error) bool {
		return err == nil && p.Ready == 2 && len(p.Nodes) == 2 && p.Nodes[0].Ready == 1 && p.Nodes[1].Ready == 1
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		nodes, err := c.cs.Nodes().Nodes(ctx)
		if err == nil && slices.Contains(nodes[0].Warm, "base:latest") && slices.Contains(nodes[1].Warm, "base:latest") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("nodes never reported their warm members: %+v %v", nodes, err)
		}
	}
	claimed, err := a2.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	waitPool("counted the claim", func(p *api.Pool, err error) bool { return err == nil && p.Hits == warm.Hits+1 })
	if op, err := a1.DeleteSandbox(ctx, claimed.ID, true); err != nil {
		t.Fatal(err)
	} else if _, err := a1.WaitOperation(ctx, op.ID); err != nil {
		t.Fatal(err)
	}
	if out := c.spaceAt(r1, a1.APIKey, "pool", "ls"); !strings.Contains(out, pool.ID) || !strings.Contains(out, "NODES") || !strings.Contains(out, "n1:") {
		t.Fatalf("space pool ls through a replica:\n%s", out)
	}
	if err := a2.DeletePool(ctx, pool.ID); err != nil {
		t.Fatal(err)
	}
	if err := a2.DeletePool(ctx, pool.ID); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("deleting the pool twice: %v", err)
	}
	waitPool("left the nodes", func(_ *api.Pool, err error) bool { return errors.Is(err, sdk.ErrNotFound) })
	for _, m := range []*clusterMember{n1, n2} {
		if ps, err := m.p.client(t).ListPools(ctx); err != nil || len(ps) != 0 {
			t.Fatalf("node %s's pools after the delete: %+v %v", m.name, ps, err)
		}
	}

	// An idempotent create: the same key through both replicas, one sandbox.
	ictx := sdk.WithIdempotencyKey(ctx, "create-once-1")
	s1, err := a1.CreateSandboxAndWait(ictx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	cleanup = append(cleanup, s1.ID)
	s2, err := a2.CreateSandboxAndWait(ictx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil || s2.ID != s1.ID || s2.State != api.StateRunning {
		t.Fatalf("the retried create: %+v %v, want %s", s2, err, s1.ID)
	}

	// kill -9 of a replica in the middle of a create: the node made the
	// sandbox and its row, the replica never answered; the retry through
	// another replica gets that sandbox, and nothing is lost or doubled.
	r3 := c.startReplica("r3")
	defer r3.kill9()
	a3, _ := sdk.New(r3.url, a1.APIKey)
	kctx := sdk.WithIdempotencyKey(ctx, "create-once-2")
	go a3.CreateSandboxAndWait(kctx, api.CreateSandboxRequest{Runtime: "native"})
	var row clusterstore.Sandbox
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if row, err = c.cs.Sandboxes().SandboxByKey(ctx, "default", "create-once-2"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the create through r3 never reached a node")
		}
	}
	r3.kill9()
	cleanup = append(cleanup, row.ID)
	s3, err := a1.CreateSandboxAndWait(kctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil || s3.ID != row.ID || s3.State != api.StateRunning {
		t.Fatalf("the retry after r3 died: %+v %v, want %s running", s3, err, row.ID)
	}
	// After the orphan grace (3 s here) every sandbox on a node has a row
	// and every row a sandbox.
	time.Sleep(4 * time.Second)
	rows, err := c.cs.Sandboxes().Sandboxes(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var rowIDs, local []string
	for _, r := range rows {
		rowIDs = append(rowIDs, r.ID)
	}
	for _, m := range c.nodes {
		l, err := m.p.client(t).ListSandboxes(ctx, sdk.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, sb := range l {
			local = append(local, sb.ID)
		}
	}
	slices.Sort(rowIDs)
	slices.Sort(local)
	if !slices.Equal(rowIDs, local) || len(rowIDs) != 6 {
		t.Fatalf("rows %v, sandboxes on the nodes %v; want the same six", rowIDs, local)
	}
	if l, err := a2.ListSandboxes(ctx, sdk.ListOptions{}); err != nil || len(l) != 6 {
		t.Fatalf("list through r2: %d %v", len(l), err)
	}

	// kill -9 of a node: lost within the window, its sandboxes too.
	n2.p.kill9()
	killed := time.Now()
	var lostAfter time.Duration
	for deadline := killed.Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		sb, err := a1.GetSandbox(ctx, onNode["n2"][0])
		if err == nil && sb.State == clusterstore.StateLost {
			lostAfter = time.Since(killed)
			if !strings.Contains(sb.Error, "node n2 lost") {
				t.Fatalf("lost sandbox's reason %q", sb.Error)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n2's sandbox not lost 30 s after the kill: %+v %v", sb, err)
		}
	}
	t.Logf("node n2 and its sandbox lost %v after kill -9 (heartbeat 200 ms, node timeout 2 s)", lostAfter.Round(time.Millisecond))
	if lostAfter > 2*time.Second+time.Second {
		t.Errorf("lost %v after the kill; the window is 2 s", lostAfter)
	}
	// Creates now go to n1 only; a lost node's sandbox refuses exec with 503.
	sb, err := a2.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	cleanup = append(cleanup, sb.ID)
	if r, _ := c.cs.Sandboxes().GetSandbox(ctx, sb.ID); r.Node != "n1" {
		t.Fatalf("a create while n2 is lost went to %s", r.Node)
	}
	if _, err := a1.Exec(ctx, onNode["n2"][0], api.ExecRequest{Cmd: []string{"true"}}); !errors.Is(err, sdk.ErrUnavailable) {
		t.Fatalf("exec on a lost node's sandbox: %v", err)
	}
	// Back: n2 beats again, its sandboxes run again, and the cleanup
	// deletes them through the replicas.
	c.restartNode(n2)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		sb, err := a2.GetSandbox(ctx, onNode["n2"][0])
		if err == nil && sb.State == api.StateRunning {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n2's sandbox after its return: %+v %v", sb, err)
		}
	}

	// Templates move by digest: a template only n2 has, with n2 draining,
	// is copied to n1 (export, import, digests verified) for a create that
	// placement sends there.
	tiny, err := n2.p.client(t).ImportTemplate(ctx, "tiny:1", tinyRootfs(t))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		nodes, _ := c.cs.Nodes().Nodes(ctx)
		if slices.ContainsFunc(nodes, func(n clusterstore.Node) bool { return n.ID == "n2" && slices.Contains(n.Templates, "tiny:1") }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n2 never reported tiny:1: %+v", nodes)
		}
	}
	// Drained by an admin through a replica (the CLI): no new sandbox there.
	if out := c.spaceAt(r1, a1.APIKey, "nodes", "drain", "n2", "--reason", "test: the template must move"); out != "n2 draining\n" {
		t.Fatalf("space nodes drain: %q", out)
	}
	if out := c.spaceAt(r2, a1.APIKey, "nodes"); !strings.Contains(out, "test: the template must move") || !strings.Contains(out, "draining") {
		t.Fatalf("space nodes after a drain:\n%s", out)
	}
	moved, err := a2.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native", Template: "tiny:1"})
	if err != nil {
		t.Fatal(err)
	}
	cleanup = append(cleanup, moved.ID)
	if r, _ := c.cs.Sandboxes().GetSandbox(ctx, moved.ID); r.Node != "n1" || moved.TemplateDigest != tiny.Digest {
		t.Fatalf("the tiny sandbox: node %s digest %s, want n1 and %s", r.Node, moved.TemplateDigest, tiny.Digest)
	}
	res, err := a1.Exec(ctx, moved.ID, api.ExecRequest{Cmd: []string{"/bin/busybox", "echo", "moved"}})
	if err != nil || res.ExitCode != 0 || string(res.Stdout) != "moved\n" {
		t.Fatalf("exec in the moved template: %+v %v", res, err)
	}
	if got, err := n1.p.client(t).GetTemplate(ctx, "tiny:1"); err != nil || got.Digest != tiny.Digest {
		t.Fatalf("n1's copy: %+v %v", got, err)
	}
	if n, err := a2.UndrainNode(ctx, "n2"); err != nil || n.State != clusterstore.NodeReady || n.StateReason != "" {
		t.Fatalf("undrain: %+v %v", n, err)
	}
	if _, err := a2.DrainNode(ctx, "n9", ""); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("draining a node that does not exist: %v", err)
	}
}

// tinyRootfs is a template's root filesystem as a tar: busybox (static,
// from the host) and the files a sandbox needs.
func tinyRootfs(t *testing.T) io.Reader {
	t.Helper()
	bb, err := os.ReadFile("/bin/busybox")
	testenv.Require(t, "busybox-static", err == nil, "/bin/busybox (Debian's busybox-static, scripts/setup-test.sh) is missing")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"bin/", "etc/", "tmp/", "root/"} {
		tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755})
	}
	add := func(name string, mode int64, b []byte) {
		tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode, Size: int64(len(b))})
		tw.Write(b)
	}
	add("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n"))
	add("etc/group", 0o644, []byte("root:x:0:\n"))
	add("bin/busybox", 0o755, bb)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return &buf
}
