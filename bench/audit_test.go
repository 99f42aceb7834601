package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/internal/audit"
)

// TestAuditBench measures the audit log's append path as the server uses
// it (its own SQLite file, WAL, one writer batching inserts, a signed
// checkpoint every 1000 records): the latency of Record as a producer sees
// it, p50/p99, and the committed throughput, records/s, from the first
// Record to Flush returning; then Verify's speed over the export.
func TestAuditBench(t *testing.T) {
	n := 100000
	if testing.Short() {
		n = 20000
	}
	for _, producers := range []int{1, 4} {
		dir := t.TempDir()
		_, key, _ := ed25519.GenerateKey(rand.Reader)
		db, err := audit.OpenDB(filepath.Join(dir, "audit.db"))
		if err != nil {
			t.Fatal(err)
		}
		l, err := audit.Open(context.Background(), audit.Options{DB: db, Key: key})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		lat := make([]samples, producers)
		var wg sync.WaitGroup
		t0 := time.Now()
		for p := 0; p < producers; p++ {
			wg.Add(1)
			go func(p int) {
				defer wg.Done()
				s := make(samples, 0, n/producers)
				for i := 0; i < n/producers; i++ {
					ev := audit.Event{Kind: audit.KindAPI, Action: "POST /v1/sandboxes/{id}/exec", Sandbox: "sb-0123456789abcdef",
						Target: "sb-0123456789abcdef", Result: "200", Detail: map[string]any{"remote": "127.0.0.1:40000"}}
					s0 := time.Now()
					l.Record(ctx, ev)
					s = append(s, time.Since(s0))
				}
				lat[p] = s
			}(p)
		}
		wg.Wait()
		if err := l.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		elapsed := time.Since(t0)
		var all samples
		for _, s := range lat {
			all = append(all, s...)
		}
		// The queue hides the disk from producers until it is full; then
		// a producer waits for a batch to commit, which the tail shows.
		fmt.Printf("audit append, %d producer(s): %d records in %v = %.0f records/s; Record p50=%.1fµs p99=%.1fµs p99.9=%.2fms max=%.1fms; dropped %d\n",
			producers, n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds(),
			float64(all.pct(0.5).Nanoseconds())/1000, float64(all.pct(0.99).Nanoseconds())/1000, ms(all.pct(0.999)), ms(all.pct(1)), l.Dropped())
		if producers == 4 {
			var buf bytes.Buffer
			if err := l.Export(ctx, time.Time{}, "", func(b []byte) error { buf.Write(b); buf.WriteByte('\n'); return nil }); err != nil {
				t.Fatal(err)
			}
			v0 := time.Now()
			rep, err := audit.Verify(bytes.NewReader(buf.Bytes()), audit.VerifyOptions{Keys: []ed25519.PublicKey{l.PublicKey()}})
			if err != nil || !rep.OK() {
				t.Fatalf("verify: %v %+v", err, rep.Problems)
			}
			d := time.Since(v0)
			st, _ := os.Stat(filepath.Join(dir, "audit.db"))
			fmt.Printf("audit verify: %d records (%d checkpoints, %.1f MiB export) in %v = %.0f records/s; db %.1f MiB\n",
				rep.Records, rep.Checkpoints, float64(buf.Len())/(1<<20), d.Round(time.Millisecond), float64(rep.Records)/d.Seconds(),
				float64(st.Size())/(1<<20))
		}
		l.Close()
		db.Close()
	}
}

// BenchmarkAuditRecord is Record's cost per call at steady state.
func BenchmarkAuditRecord(b *testing.B) {
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	db, err := audit.OpenDB(filepath.Join(b.TempDir(), "audit.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	l, err := audit.Open(context.Background(), audit.Options{DB: db, Key: key})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		l.Record(ctx, audit.Event{Kind: audit.KindFiles, Action: "write", Sandbox: "sb-1", Target: "/tmp/x", Result: "ok"})
	}
	if err := l.Flush(ctx); err != nil {
		b.Fatal(err)
	}
}
