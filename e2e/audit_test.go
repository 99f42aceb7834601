package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// TestAuditTrail: what a caller and a sandbox do lands in the audit log —
// the API calls, the lifecycle operation, the command's start and exit,
// the file written, the connection the gateway refused — and an export of
// it verifies offline, while a tampered export fails naming the record.
func TestAuditTrail(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	if out, code := sh(t, e, sb.ID, "echo audited"); code != 0 || !strings.Contains(out, "audited") {
		t.Fatalf("exec: %d %q", code, out)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/tmp/audit.txt", strings.NewReader("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://allowed.test:%d/", e.internet.httpPort)); code != 0 {
		t.Fatalf("an allowed name failed: %q", out)
	}
	if out, code := sh(t, e, sb.ID, fmt.Sprintf("curl -sS --max-time 10 http://other.test:%d/", e.internet.httpPort)); code == 0 {
		t.Fatalf("a denied name went through: %q", out)
	}

	want := map[string]func(api.AuditRecord) bool{
		"api exec": func(r api.AuditRecord) bool {
			return r.Kind == "api" && r.Action == "POST /v1/sandboxes/{id}/exec" && r.Target == sb.ID && r.Result == "200" && r.Tenant == "default" && r.KeyID != ""
		},
		"lifecycle create": func(r api.AuditRecord) bool {
			return r.Kind == "lifecycle" && r.Action == "create" && r.Result == "succeeded" && r.KeyID != ""
		},
		"command start": func(r api.AuditRecord) bool {
			return r.Kind == "command" && r.Action == "start" && strings.Contains(string(r.Detail), `"echo audited"`) && r.KeyID != ""
		},
		"command exit": func(r api.AuditRecord) bool { return r.Kind == "command" && r.Action == "exit" && r.Result == "0" },
		"files write": func(r api.AuditRecord) bool {
			return r.Kind == "files" && r.Action == "write" && r.Target == "/tmp/audit.txt" && r.Result == "ok" && r.KeyID != ""
		},
		"network deny": func(r api.AuditRecord) bool {
			return r.Kind == "network" && strings.HasPrefix(r.Result, "deny") && strings.Contains(r.Target, "other.test")
		},
		"network allow": func(r api.AuditRecord) bool {
			return r.Kind == "network" && r.Action == "http" && r.Result == "allow" && strings.Contains(r.Target, "allowed.test 127.0.0.2:")
		},
	}
	var recs []api.AuditRecord
	deadline := time.Now().Add(20 * time.Second)
	for {
		var err error
		recs, err = e.client.AuditRecords(ctx, sdk.AuditFilter{Sandbox: sb.ID, Limit: 10000})
		if err != nil {
			t.Fatal(err)
		}
		missing := []string{}
		for name, ok := range want {
			found := false
			for _, r := range recs {
				if r.Sandbox != sb.ID {
					t.Fatalf("sandbox filter let through %+v", r)
				}
				found = found || ok(r)
			}
			if !found {
				missing = append(missing, name)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			b, _ := json.MarshalIndent(recs, "", " ")
			t.Fatalf("audit log lacks %v:\n%s", missing, b)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Bad queries are 400s naming the parameter.
	if _, err := e.client.AuditRecords(ctx, sdk.AuditFilter{Kind: "bogus"}); err == nil || !strings.Contains(err.Error(), "kind must be one of") {
		t.Fatalf("bad kind: %v", err)
	}

	// Export, verify offline with the server's key, tamper, verify again.
	dir := t.TempDir()
	file := filepath.Join(dir, "a.jsonl")
	if _, stderr, code := e.spaceCLI(t, "", "audit", "export", "-o", file); code != 0 {
		t.Fatalf("export: %d %s", code, stderr)
	}
	keyOut, stderr, code := e.spaceCLI(t, "", "audit", "key")
	if code != 0 {
		t.Fatalf("audit key: %d %s", code, stderr)
	}
	key := strings.Fields(keyOut)[2]
	out, stderr, code := e.spaceCLI(t, "", "audit", "verify", file, "--key", key)
	if code != 0 || !strings.HasPrefix(out, "ok: ") {
		t.Fatalf("verify of a fresh export: %d %s %s", code, out, stderr)
	}
	if out, _, code := e.spaceCLI(t, "", "audit", "verify", file, "--server"); code != 0 {
		t.Fatalf("verify --server: %d %s", code, out)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	// Make the denied connection look allowed.
	idx := -1
	for i, l := range lines {
		var r api.AuditRecord
		json.Unmarshal([]byte(l), &r)
		if r.Sandbox == sb.ID && r.Kind == "network" && strings.HasPrefix(r.Result, "deny") {
			idx = i
			lines[i] = strings.Replace(l, `"result":"deny`, `"result":"allow`, 1)
			break
		}
	}
	if idx < 0 {
		t.Fatal("the export lacks the denied connection")
	}
	var victim api.AuditRecord
	json.Unmarshal([]byte(lines[idx]), &victim)
	os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600)
	out, _, code = e.spaceCLI(t, "", "audit", "verify", file, "--key", key)
	wantLine := fmt.Sprintf("line %d (seq %d): changed", idx+1, victim.Seq)
	if code != 1 || !strings.Contains(out, wantLine) {
		t.Fatalf("verify of a tampered export: code %d, want a line %q in:\n%s", code, wantLine, out)
	}

	// OCSF: one event per record, classes by kind.
	ocsf, stderr, code := e.spaceCLI(t, "", "audit", "export", "--format", "ocsf", "--since", "1h")
	if code != 0 {
		t.Fatalf("ocsf export: %d %s", code, stderr)
	}
	classes := map[float64]bool{}
	for _, l := range strings.Split(strings.TrimSpace(ocsf), "\n") {
		var ev map[string]any
		if err := json.Unmarshal([]byte(l), &ev); err != nil {
			t.Fatalf("ocsf line %q: %v", l, err)
		}
		classes[ev["class_uid"].(float64)] = true
	}
	for _, c := range []float64{6003, 1007, 1001, 4001} {
		if !classes[c] {
			t.Errorf("no OCSF class %v in the export", c)
		}
	}
}

// TestAuditRecordsPerSandbox counts what a typical create + exec + delete
// adds to the log (reported in docs/security-model.md).
func TestAuditRecordsPerSandbox(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	last := func() uint64 {
		var max uint64
		e.client.FollowAudit(ctxT(t, 300*time.Millisecond), sdk.AuditFilter{}, func(r api.AuditRecord) error {
			max = r.Seq
			return nil
		})
		return max
	}
	start := last()
	sb, err := e.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, e, sb.ID, "true")
	op, err := e.client.DeleteSandbox(ctx, sb.ID, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.WaitOperation(ctx, op.ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	recs, err := e.client.AuditRecords(ctx, sdk.AuditFilter{After: start, Limit: 10000})
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	var apis []string
	n := 0
	for _, r := range recs {
		if r.Kind == "checkpoint" || r.Action == "GET /v1/audit" {
			continue
		}
		kinds[r.Kind]++
		n++
		if r.Kind == "api" {
			apis = append(apis, r.Action+" "+r.Result)
		}
	}
	t.Logf("create + exec + delete: %d records %v; api: %q", n, kinds, apis)
	if kinds["lifecycle"] != 2 || kinds["command"] != 2 || kinds["api"] < 4 {
		t.Fatalf("unexpected records: %v", kinds)
	}
}

// TestAuditNetworkAcrossRestart: the server is killed (-9) while a sandbox
// keeps connecting; the restarted server follows the gateway's link again
// from where the log left off, so every verdict is recorded exactly once
// (link_seq runs 1, 2, 3… with no gap and no repeat), and the chain, which
// the new server continued, still verifies.
func TestAuditNetworkAcrossRestart(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.BaseRootfs(t)
	fi, err := startFakeInternet()
	if err != nil {
		t.Fatal(err)
	}
	defer fi.close()
	bin := buildSpace(t)
	root, err := os.MkdirTemp("", "ar-")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(root, "server.log"))
			t.Logf("server log:\n%s", b)
		}
		os.RemoveAll(root)
	}()
	data := filepath.Join(root, "data")
	addr := freePort(t)
	flags := []string{"--egress-allow-private", "127.0.0.0/8", "--dns-upstream", fi.dns.Addr, "--egress-dial-guard", "loopback", "--audit-checkpoint-interval", "1s"}
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
	loop := fmt.Sprintf("nohup sh -c 'for i in $(seq 60); do curl -s -o /dev/null --max-time 5 http://allowed.test:%d/; curl -s -o /dev/null --max-time 5 http://other.test:%d/; sleep 0.1; done' >/dev/null 2>&1 &", fi.httpPort, fi.httpPort)
	if _, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", loop}}); err != nil {
		t.Fatal(err)
	}
	netRecs := func(c *sdk.Client) []api.AuditRecord {
		recs, err := c.AuditRecords(ctx, sdk.AuditFilter{Sandbox: sb.ID, Kind: "network", Limit: 10000})
		if err != nil {
			t.Fatal(err)
		}
		return recs
	}
	for deadline := time.Now().Add(time.Minute); len(netRecs(c)) < 5; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no network records")
		}
	}
	p.kill9()
	time.Sleep(2 * time.Second) // the sandbox keeps connecting meanwhile
	p = startServer(t, bin, data, addr, flags...)
	c = p.client(t)
	// The loop ends after 60 rounds; wait until the log has caught up
	// with the gateway's own count of events.
	var recs []api.AuditRecord
	var prev uint64
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		var last uint64
		if err := c.NetworkEvents(ctx, sb.ID, 0, false, func(ev api.NetworkEvent) error { last = ev.Seq; return nil }); err != nil {
			t.Fatal(err)
		}
		recs = netRecs(c)
		// The loop is over once the gateway's count stands still.
		if n := len(recs); n > 0 && last == prev && linkSeq(t, recs[n-1]) == last {
			break
		}
		prev = last
		if time.Now().After(deadline) {
			t.Fatalf("the log did not catch up: %d records, gateway at %d", len(recs), last)
		}
	}
	t.Logf("%d network verdicts recorded across the restart", len(recs))
	for i, r := range recs {
		if got := linkSeq(t, r); got != uint64(i+1) {
			t.Fatalf("record %d has link_seq %d, want %d (a verdict lost or recorded twice across the restart)", i, got, i+1)
		}
	}
	file := filepath.Join(root, "a.jsonl")
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExportAudit(ctx, "", "jsonl", f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	key, _ := os.ReadFile(filepath.Join(data, "api-key"))
	out, stderr, code := (&env{url: "http://" + addr, key: strings.TrimSpace(string(key))}).spaceCLI(t, "", "audit", "verify", file, "--server")
	if code != 0 {
		t.Fatalf("verify across a kill -9: %d %s %s", code, out, stderr)
	}
}

func linkSeq(t *testing.T, r api.AuditRecord) uint64 {
	t.Helper()
	var d struct {
		LinkSeq uint64 `json:"link_seq"`
	}
	if err := json.Unmarshal(r.Detail, &d); err != nil {
		t.Fatal(err)
	}
	return d.LinkSeq
}

// TestAuditTenantView: a key of another tenant with audit:read sees only
// its tenant's records (its own API calls), never the default tenant's;
// a key without audit:read is refused.
func TestAuditTenantView(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	reader, err := e.client.CreateKey(ctx, api.CreateKeyRequest{Name: "auditor", Tenant: "audit-team", Scopes: []string{"audit:read", "sandbox:read"}})
	if err != nil {
		t.Fatal(err)
	}
	other, err := e.client.CreateKey(ctx, api.CreateKeyRequest{Name: "no-audit", Tenant: "audit-team", Scopes: []string{"sandbox:read"}})
	if err != nil {
		t.Fatal(err)
	}
	rc, _ := sdk.New(e.url, reader.Key)
	oc, _ := sdk.New(e.url, other.Key)
	if _, err := rc.ListSandboxes(ctx, sdk.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := oc.AuditRecords(ctx, sdk.AuditFilter{}); err == nil || !strings.Contains(err.Error(), "audit:read") {
		t.Fatalf("a key without audit:read listed the log: %v", err)
	}
	var recs []api.AuditRecord
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		recs, err = rc.AuditRecords(ctx, sdk.AuditFilter{Kind: "api", Limit: 10000})
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) > 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(recs) == 0 {
		t.Fatal("the tenant sees none of its own records")
	}
	for _, r := range recs {
		if r.Tenant != "audit-team" || r.KeyID != reader.ID && r.KeyID != other.ID {
			t.Fatalf("tenant audit-team sees %+v", r)
		}
	}
}
