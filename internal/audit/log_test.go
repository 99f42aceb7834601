package audit

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/internal/principal"
)

func testKey(t *testing.T) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func openLog(t *testing.T, dir string, key ed25519.PrivateKey, o Options) *Log {
	t.Helper()
	db, err := OpenDB(filepath.Join(dir, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	o.DB, o.Key = db, key
	l, err := Open(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func export(t *testing.T, l *Log, since time.Time) []string {
	t.Helper()
	var lines []string
	if err := l.Export(context.Background(), since, "", func(b []byte) error {
		lines = append(lines, string(b))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return lines
}

func verifyLines(t *testing.T, lines []string, o VerifyOptions) Report {
	t.Helper()
	rep, err := Verify(strings.NewReader(strings.Join(lines, "\n")+"\n"), o)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func record(l *Log, n int) {
	for i := 0; i < n; i++ {
		l.Record(context.Background(), Event{Kind: KindCommand, Action: "start", Sandbox: "sb-1", Target: fmt.Sprintf("cmd-%d", i),
			Detail: map[string]any{"argv": []string{"echo", fmt.Sprint(i)}, "note": "<&>"}})
	}
}

func TestChainVerifies(t *testing.T) {
	key := testKey(t)
	l := openLog(t, t.TempDir(), key, Options{CheckpointEvery: 10})
	record(l, 25)
	lines := export(t, l, time.Time{})
	// 25 events, a checkpoint after each 10, and the export's own.
	if len(lines) != 28 {
		t.Fatalf("exported %d lines, want 28:\n%s", len(lines), strings.Join(lines, "\n"))
	}
	var last Record
	json.Unmarshal([]byte(lines[len(lines)-1]), &last)
	if last.Kind != KindCheckpoint || last.Seq != 28 {
		t.Fatalf("export does not end at a checkpoint: %+v", last)
	}
	rep := verifyLines(t, lines, VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}})
	if !rep.OK() || rep.Checkpoints != 3 || rep.First != 1 || rep.Last != 28 {
		t.Fatalf("verify: %+v", rep)
	}
	// The key must be the log's.
	other := testKey(t).Public().(ed25519.PublicKey)
	rep = verifyLines(t, lines, VerifyOptions{Keys: []ed25519.PublicKey{other}})
	if rep.OK() || !hasProblem(rep, ProblemSignature, 11, 11) {
		t.Fatalf("verify with another key: %+v", rep)
	}
	if _, err := Verify(strings.NewReader(lines[0]), VerifyOptions{}); err != ErrNoKey {
		t.Fatalf("verify without a key: %v", err)
	}
	if rep := verifyLines(t, lines, VerifyOptions{ChainOnly: true}); !rep.OK() {
		t.Fatalf("chain-only: %+v", rep)
	}
}

// tamper applies f to a copy of lines.
func tamper(lines []string, f func([]string) []string) []string {
	return f(append([]string(nil), lines...))
}

func setField(t *testing.T, line, field string, v any, rehash bool) string {
	t.Helper()
	var r Record
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	json.Unmarshal([]byte(line), &m)
	m[field] = v
	b, _ := json.Marshal(m)
	if rehash {
		json.Unmarshal(b, &r)
		r.Hash, _ = Hash(r)
		b, _ = json.Marshal(r)
	}
	return string(b)
}

func TestVerifyDetectsTampering(t *testing.T) {
	key := testKey(t)
	l := openLog(t, t.TempDir(), key, Options{CheckpointEvery: 10})
	record(l, 25)
	lines := export(t, l, time.Time{})
	keys := VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}}
	cases := []struct {
		name string
		f    func([]string) []string
		kind string
		line int
		seq  uint64
	}{
		{"changed field", func(ls []string) []string { ls[4] = setField(t, ls[4], "result", "1", false); return ls }, ProblemChanged, 5, 5},
		{"changed detail", func(ls []string) []string { ls[6] = strings.Replace(ls[6], `"echo"`, `"rm"`, 1); return ls }, ProblemChanged, 7, 7},
		{"changed and rehashed", func(ls []string) []string { ls[4] = setField(t, ls[4], "target", "cmd-x", true); return ls }, ProblemChanged, 5, 5},
		{"removed", func(ls []string) []string { return append(ls[:3], ls[4:]...) }, ProblemRemoved, 4, 5},
		{"removed first", func(ls []string) []string { return ls[1:] }, ProblemUnanchored, 1, 2},
		{"removed last", func(ls []string) []string { return ls[:len(ls)-1] }, ProblemUnsigned, 23, 23},
		{"inserted copy", func(ls []string) []string { return append(ls[:8], append([]string{ls[2]}, ls[8:]...)...) }, ProblemInserted, 9, 3},
		{"inserted forged", func(ls []string) []string {
			forged := setField(t, ls[7], "action", "exit", true)
			return append(ls[:7], append([]string{forged}, ls[7:]...)...)
		}, ProblemInserted, 8, 8},
		{"swapped", func(ls []string) []string { ls[2], ls[3] = ls[3], ls[2]; return ls }, ProblemReordered, 4, 3},
		{"not a record", func(ls []string) []string { ls[5] = `{"hello":1}`; return ls }, ProblemMalformed, 6, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep := verifyLines(t, tamper(lines, c.f), keys)
			if rep.OK() {
				t.Fatalf("tampering not detected")
			}
			if !hasProblem(rep, c.kind, c.line, c.seq) {
				t.Fatalf("want a %s problem at line %d seq %d, got %v", c.kind, c.line, c.seq, rep.Problems)
			}
		})
	}
	// A followed listing may end unsigned when the caller says so.
	rep := verifyLines(t, lines[:len(lines)-1], VerifyOptions{Keys: keys.Keys, AllowUnsignedTail: true})
	if !rep.OK() {
		t.Fatalf("unsigned tail allowed: %v", rep.Problems)
	}
}

func TestRetentionKeepsChainVerifiable(t *testing.T) {
	key := testKey(t)
	l := openLog(t, t.TempDir(), key, Options{CheckpointEvery: 10, RetainRecords: 15, RetentionEvery: time.Hour})
	record(l, 40)
	if err := l.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	n, err := l.Retain(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// 44 records (40 + 4 checkpoints at 11, 22, 33, 44); keep ≥ 15:
	// cut before the checkpoint at 22 (22..44 = 23 records stay).
	if n != 21 {
		t.Fatalf("retention deleted %d records, want 21", n)
	}
	lines := export(t, l, time.Time{})
	var first Record
	json.Unmarshal([]byte(lines[0]), &first)
	if first.Seq != 22 || first.Kind != KindCheckpoint {
		t.Fatalf("after the cut the log starts at %+v, want the checkpoint at 22", first)
	}
	rep := verifyLines(t, lines, VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}})
	if !rep.OK() {
		t.Fatalf("verify after retention: %v", rep.Problems)
	}
	// The cut is on the record.
	recs, err := l.List(context.Background(), Filter{Kind: KindAudit})
	if err != nil || len(recs) != 1 || recs[0].Action != "retention" || recs[0].Result != "21" {
		t.Fatalf("retention note: %+v %v", recs, err)
	}
	// Removing the anchor leaves the rest unanchored.
	rep = verifyLines(t, lines[1:], VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}})
	if rep.OK() || rep.Problems[0].Kind != ProblemUnanchored {
		t.Fatalf("without the anchor: %+v", rep)
	}
}

func TestRetentionByAge(t *testing.T) {
	key := testKey(t)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	l := openLog(t, t.TempDir(), key, Options{CheckpointEvery: 5, RetainAge: time.Hour, RetentionEvery: time.Hour, Now: clock})
	record(l, 10) // checkpoints at 6, 12
	l.Flush(context.Background())
	mu.Lock()
	now = now.Add(2 * time.Hour)
	mu.Unlock()
	record(l, 3)
	l.Flush(context.Background())
	if n, err := l.Retain(context.Background()); err != nil || n != 11 {
		t.Fatalf("retain by age: %d %v", n, err)
	}
	lines := export(t, l, time.Time{})
	if rep := verifyLines(t, lines, VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}}); !rep.OK() || rep.First != 12 {
		t.Fatalf("verify after the age cut: %+v", rep)
	}
}

func TestRestartContinuesChain(t *testing.T) {
	dir := t.TempDir()
	key := testKey(t)
	db, err := OpenDB(filepath.Join(dir, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	l, err := Open(context.Background(), Options{DB: db, Key: key, CheckpointEvery: 100})
	if err != nil {
		t.Fatal(err)
	}
	record(l, 7)
	l.Close() // signs the tail: 8 records
	record(l, 1)
	if l.Dropped() != 1 {
		t.Fatalf("a record after Close must be dropped and counted, got %d", l.Dropped())
	}
	l2, err := Open(context.Background(), Options{DB: db, Key: key, CheckpointEvery: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	record(l2, 3)
	lines := export(t, l2, time.Time{})
	if len(lines) != 12 {
		t.Fatalf("%d lines after restart, want 12", len(lines))
	}
	if rep := verifyLines(t, lines, VerifyOptions{Keys: []ed25519.PublicKey{key.Public().(ed25519.PublicKey)}}); !rep.OK() || rep.Checkpoints != 2 {
		t.Fatalf("verify across restart: %+v", rep)
	}
	// Export since a time starts at the checkpoint before it.
	var cp Record
	json.Unmarshal([]byte(lines[7]), &cp)
	part := export(t, l2, cp.Time.Add(time.Millisecond))
	if rep := verifyLines(t, part, VerifyOptions{Keys: []ed25519.PublicKey{key.Public().(ed25519.PublicKey)}}); !rep.OK() || rep.First != 8 {
		t.Fatalf("export since: %+v", rep)
	}
	// A log whose newest record was edited in place refuses to go on.
	l2.Close()
	if _, err := db.Exec(`UPDATE audit_records SET line = replace(line, '"sign"', '"sigh"') WHERE seq = (SELECT MAX(seq) FROM audit_records)`); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(context.Background(), Options{DB: db, Key: key}); err == nil || !strings.Contains(err.Error(), "altered") {
		t.Fatalf("open of an altered log: %v", err)
	}
}

func TestTimedCheckpointAndPrincipal(t *testing.T) {
	key := testKey(t)
	l := openLog(t, t.TempDir(), key, Options{CheckpointInterval: 50 * time.Millisecond})
	ctx := principal.With(context.Background(), principal.Principal{KeyID: "key-1", Tenant: "team-a"})
	l.Record(ctx, Event{Kind: KindAPI, Action: "GET /v1/sandboxes", Result: "200"})
	l.Record(context.Background(), Event{Kind: KindAPI, Action: "GET /v1/info", Result: "401"})
	deadline := time.Now().Add(5 * time.Second)
	for {
		recs, err := l.List(context.Background(), Filter{Kind: KindCheckpoint})
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no timed checkpoint")
		}
		time.Sleep(20 * time.Millisecond)
	}
	recs, _ := l.List(context.Background(), Filter{Kind: KindAPI})
	if recs[0].KeyID != "key-1" || recs[0].Tenant != "team-a" || recs[1].KeyID != "" || recs[1].Tenant != principal.DefaultTenant {
		t.Fatalf("key and tenant: %+v", recs)
	}
	if r, _ := l.List(context.Background(), Filter{Tenant: "team-a"}); len(r) != 1 {
		t.Fatalf("tenant filter: %+v", r)
	}
}

func TestFollowAndDropNote(t *testing.T) {
	l := openLog(t, t.TempDir(), testKey(t), Options{})
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan Record, 10)
	go l.Follow(ctx, Filter{Sandbox: "sb-1"}, func(r Record) error { got <- r; return nil })
	defer cancel()
	l.dropped.Add(3) // as if the queue had overflowed
	record(l, 2)
	for i := 0; i < 2; i++ {
		select {
		case r := <-got:
			if r.Sandbox != "sb-1" {
				t.Fatalf("follow sent %+v", r)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("follow sent nothing")
		}
	}
	recs, _ := l.List(context.Background(), Filter{Kind: KindAudit})
	if len(recs) != 1 || recs[0].Action != "dropped" || recs[0].Result != "3" {
		t.Fatalf("drop note: %+v", recs)
	}
}

func TestKeyFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), KeyFileName)
	k, err := LoadOrCreateKey(p)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(p)
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v", st.Mode())
	}
	k2, err := LoadOrCreateKey(p)
	if err != nil || !bytes.Equal(k, k2) {
		t.Fatalf("reload: %v", err)
	}
	os.Chmod(p, 0o640)
	if _, err := LoadOrCreateKey(p); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("a group-readable key was accepted: %v", err)
	}
	os.Chmod(p, 0o600)
	link := p + ".link"
	os.Symlink(p, link)
	if _, err := LoadOrCreateKey(link); err == nil {
		t.Fatal("a symlinked key was accepted")
	}
}

func TestOCSFShapes(t *testing.T) {
	l := openLog(t, t.TempDir(), testKey(t), Options{})
	ctx := principal.With(context.Background(), principal.Principal{KeyID: "k1", Tenant: "t"})
	l.Record(ctx, Event{Kind: KindAPI, Action: "DELETE /v1/sandboxes/{id}", Target: "sb-1", Result: "404", Detail: map[string]any{"remote": "127.0.0.1:5555"}})
	l.Record(ctx, Event{Kind: KindCommand, Action: "exit", Sandbox: "sb-1", Target: "cmd-1", Result: "3"})
	l.Record(ctx, Event{Kind: KindFiles, Action: "remove", Sandbox: "sb-1", Target: "/tmp/x", Result: "ok"})
	l.Record(ctx, Event{Kind: KindNetwork, Action: "tcp", Sandbox: "sb-1", Detail: map[string]any{"verdict": "deny", "ip": "127.0.0.2", "port": 80, "protocol": "tcp"}})
	l.Record(ctx, Event{Kind: KindLifecycle, Action: "create", Sandbox: "sb-1", Result: "succeeded"})
	l.Flush(context.Background())
	recs, _ := l.List(context.Background(), Filter{})
	want := []struct{ class, activity, status int }{{6003, 4, 2}, {1007, 2, 1}, {1001, 4, 1}, {4001, 5, 2}, {6003, 1, 1}}
	for i, w := range want {
		ev := OCSF(recs[i])
		if ev["class_uid"] != w.class || ev["activity_id"] != w.activity || ev["status_id"] != w.status || ev["type_uid"] != w.class*100+w.activity {
			t.Errorf("record %d (%s): class %v activity %v status %v", i, recs[i].Kind, ev["class_uid"], ev["activity_id"], ev["status_id"])
		}
		if ev["actor"].(map[string]any)["user"].(map[string]any)["uid"] != "k1" || ev["time"] != recs[i].Time.UnixMilli() {
			t.Errorf("record %d: actor/time %v %v", i, ev["actor"], ev["time"])
		}
		if _, err := json.Marshal(ev); err != nil {
			t.Error(err)
		}
	}
}

func hasProblem(rep Report, kind string, line int, seq uint64) bool {
	for _, p := range rep.Problems {
		if p.Kind == kind && p.Line == line && p.Seq == seq {
			return true
		}
	}
	return false
}
