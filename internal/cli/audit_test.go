package cli

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
)

// TestAuditVerify runs `space audit verify` offline on an export: it
// passes, names the changed record of a tampered copy with exit status 1,
// and refuses to run without a key unless asked for a chain-only check.
func TestAuditVerify(t *testing.T) {
	dir := t.TempDir()
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	db, err := audit.OpenDB(filepath.Join(dir, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	l, err := audit.Open(context.Background(), audit.Options{DB: db, Key: key, CheckpointEvery: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for i := 0; i < 10; i++ {
		l.Record(context.Background(), audit.Event{Kind: audit.KindFiles, Action: "write", Sandbox: "sb-1", Target: "/f", Result: "ok"})
	}
	var buf bytes.Buffer
	if err := l.Export(context.Background(), time.Time{}, "", func(b []byte) error { buf.Write(b); buf.WriteByte('\n'); return nil }); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "a.jsonl")
	os.WriteFile(file, buf.Bytes(), 0o600)
	pub := base64.StdEncoding.EncodeToString(key.Public().(ed25519.PublicKey))
	run := func(args ...string) (string, string, int) {
		var o, e bytes.Buffer
		code := Execute(context.Background(), args, strings.NewReader(""), &o, &e)
		return o.String(), e.String(), code
	}
	if out, errOut, code := run("audit", "verify", file, "--key", pub); code != 0 || !strings.HasPrefix(out, "ok: 13 records, seq 1–13, 3 signed checkpoints") {
		t.Fatalf("verify: %d %q %q", code, out, errOut)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	// Anchored at the checkpoint of seq 10 (as `space audit heads` shows it).
	var cp api.AuditRecord
	json.Unmarshal([]byte(lines[9]), &cp)
	if out, errOut, code := run("audit", "verify", file, "--key", pub, "--anchor", fmt.Sprintf("10:%s", cp.Hash)); code != 0 || !strings.Contains(out, "anchored: 1 of 1 heads found unchanged") {
		t.Fatalf("verify with an anchor: %d %q %q", code, out, errOut)
	}
	os.WriteFile(file, []byte(strings.Join(lines[:8], "\n")+"\n"), 0o600) // rolled back to before the head
	if out, errOut, code := run("audit", "verify", file, "--key", pub, "--chain-only", "--anchor", fmt.Sprintf("10:%s", cp.Hash)); code != ExitError || !strings.Contains(out, "anchor: the chain ends at seq 8") {
		t.Fatalf("a file rolled back past its anchor: %d %q %q", code, out, errOut)
	}
	if _, errOut, code := run("audit", "verify", file, "--key", pub, "--anchor", "10"); code != ExitUsage || !strings.Contains(errOut, "want SEQ:HASH") {
		t.Fatalf("bad anchor: %d %q", code, errOut)
	}
	if _, errOut, code := run("audit", "verify", file, "--key", pub, "--node", "n1"); code != ExitUsage || !strings.Contains(errOut, "--node needs --server") {
		t.Fatalf("--node without --server: %d %q", code, errOut)
	}
	lines[1], lines[2] = lines[2], lines[1]
	lines[6] = strings.Replace(lines[6], `"target":"/f"`, `"target":"/g"`, 1)
	os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600)
	out, errOut, code := run("audit", "verify", file, "--key", pub)
	if code != ExitError || !strings.Contains(out, "line 3 (seq 2): reordered") || !strings.Contains(out, "line 7 (seq 7): changed") ||
		!strings.Contains(errOut, "verification failed: 2 problem(s)") {
		t.Fatalf("tampered: %d %q %q", code, out, errOut)
	}
	if _, errOut, code := run("audit", "verify", file); code != ExitUsage || !strings.Contains(errOut, "--key") {
		t.Fatalf("without a key: %d %q", code, errOut)
	}
	if _, _, code := run("audit", "verify", file, "--chain-only"); code != ExitError {
		t.Fatalf("chain-only on a tampered file: %d", code)
	}
	if _, errOut, code := run("audit", "verify", file, "--key", "nope"); code != ExitUsage || !strings.Contains(errOut, "--key: public key") {
		t.Fatalf("bad key: %d %q", code, errOut)
	}
}
